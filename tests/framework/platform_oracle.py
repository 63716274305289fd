"""What each platform's own code makes of a GPU spec: the oracle of
tests/unit/compat/test_compat_platforms.py.

Runs in .venv-platforms (setup/platforms.sh), never in vmsandbox's virtualenv: one request per
line on stdin, ``{"platform": NAME, "input": VALUE}`` (``"absent": true`` when the field is
not given at all), one JSON answer per line on stdout, until stdin closes. JSON carries NaN and
the infinities as Python's json module writes them.

Each answer comes from the released package's own function where the package has one:

- ``openshell`` 0.1.5: ``google.protobuf.json_format.ParseDict`` into the package's generated
  ``openshell_pb2.SandboxSpec``. The rules after parsing live only in OpenShell's Rust source
  and are restated below (``_openshell_gateway``), each citing its file at NVIDIA/OpenShell
  commit 2f7fb65591ee5746217ace154afc0aa6bf1afc6d, whose ``ResourceRequirements``,
  ``GpuResourceRequirements`` and ``SandboxTemplate`` match the package's descriptors field for
  field.
- ``opensandbox-server`` 1.1.1: ``CreateSandboxRequest.model_validate`` (what FastAPI runs on
  the body; a failure is the 422), then both runtimes: Docker's
  ``DockerContainerOpsMixin._resolve_resource_limits`` and Kubernetes'
  ``_translate_resource_limits_for_k8s`` (an ``HTTPException`` is the 400).
- ``tako-vm`` 0.3.0: both readers of a job type, ``JobTypeGPUConfig.model_validate`` (the config
  file) and ``JobType.from_dict`` (the registry JSON).
- ``flowmesh`` 0.1.13: the CLI's ``build_ssh_task_yaml`` writes the GPU block of an SSH task.
  The package has no reader of that block: FlowMesh reads it in its worker, in the source
  repository only; that rule is restated below (``_flowmesh_resolver``), citing its files.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from typing import Any

# Unicode White_Space: what Rust's str::trim strips (Python's str.strip also strips U+001C..1F).
_RUST_WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)


def _refused(stage: str, why: object) -> dict[str, Any]:
    return {"refused": stage, "why": str(why)[:300]}


# --- OpenShell -------------------------------------------------------------------------------


def openshell(spec: object, absent: bool) -> dict[str, Any]:
    """json_format into SandboxSpec, then the gateway's and the VM driver's GPU rules."""
    from google.protobuf import json_format, struct_pb2
    from openshell._proto import openshell_pb2

    message = openshell_pb2.SandboxSpec()
    try:
        json_format.ParseDict(spec, message)
    except Exception as err:  # ParseError, or a TypeError json_format lets through
        return _refused("json_format", f"{type(err).__name__}: {err}")
    requested = message.HasField("resource_requirements") and (
        message.resource_requirements.HasField("gpu")
    )
    gpu = message.resource_requirements.gpu
    count = gpu.count if requested and gpu.HasField("count") else None
    config: dict[str, Any] | None = None
    if message.HasField("template") and message.template.HasField("driver_config"):
        fields = message.template.driver_config.fields
        if "vm" in fields:
            block = fields["vm"]
            if block.WhichOneof("kind") != "struct_value":
                # crates/openshell-server/src/compute/mod.rs select_driver_config
                return _refused("gateway", "template.driver_config.vm must be an object")
            config = _struct_to_json(block.struct_value, struct_pb2)
    return _openshell_gateway(requested, count, config)


def _struct_to_json(struct: Any, struct_pb2: Any) -> dict[str, Any]:
    """crates/openshell-core/src/proto_struct.rs struct_to_json_value (NaN becomes null)."""

    def value(item: Any) -> Any:
        kind = item.WhichOneof("kind")
        if kind == "number_value":
            number = item.number_value
            return None if number != number or number in (float("inf"), float("-inf")) else number
        if kind == "string_value":
            return item.string_value
        if kind == "bool_value":
            return item.bool_value
        if kind == "struct_value":
            return {key: value(inner) for key, inner in item.struct_value.fields.items()}
        if kind == "list_value":
            return [value(inner) for inner in item.list_value.values]
        return None

    return {key: value(item) for key, item in struct.fields.items()}


def _openshell_gateway(
    requested: bool, count: int | None, config: dict[str, Any] | None
) -> dict[str, Any]:
    # crates/openshell-server/src/grpc/validation.rs validate_gpu_request_fields
    if count == 0:
        return _refused("gateway", "gpu count must be greater than 0")
    ids: list[str] | None = None
    if config is not None:
        # crates/openshell-driver-vm/src/driver.rs VmSandboxDriverConfig: deny_unknown_fields
        unknown = sorted(key for key in config if key != "gpu_device_ids")
        if unknown:
            return _refused("vm driver", f"invalid vm driver_config: unknown field {unknown[0]}")
        if "gpu_device_ids" in config:
            # crates/openshell-core/src/proto_struct.rs deserialize_optional_non_empty_string_list
            raw = config["gpu_device_ids"]
            if not isinstance(raw, list) or not all(isinstance(item, str) for item in raw):
                return _refused("vm driver", "invalid vm driver_config: expected a sequence")
            if not raw:
                return _refused("vm driver", "must be a non-empty list of strings")
            for index, item in enumerate(raw):
                if not item.strip(_RUST_WHITESPACE):
                    return _refused("vm driver", f"[{index}] must be a non-empty string")
            ids = raw
    if ids:
        # crates/openshell-core/src/gpu.rs validate_specific_gpu_device_request
        for index, item in enumerate(ids):
            if item in ids[:index]:
                return _refused("vm driver", f"contains duplicate device ID '{item}'")
        if not requested:
            return _refused("vm driver", "driver_config.gpu_device_ids requires a gpu request")
        if (count or 1) != len(ids):
            return _refused(
                "vm driver",
                f"gpu count ({count or 1}) must match driver_config.gpu_device_ids "
                f"length ({len(ids)})",
            )
    if not requested:
        return {"gpu": False}
    # crates/openshell-driver-vm/src/driver.rs validate_gpu_request and vm_gpu_device_id: one
    # GPU per VM. vmsandbox passes more; the test names that difference.
    single = None
    if (count or 1) > 1:
        single = "VM GPU sandboxes support only one GPU"
    return {"gpu": True, "count": count, "device_ids": ids, "vm_driver_limit": single}


# --- OpenSandbox -----------------------------------------------------------------------------


def opensandbox(limits: object, absent: bool) -> dict[str, Any]:
    """The request model (422), then the Docker and the Kubernetes readings (400 or a result)."""
    import pydantic
    from fastapi import HTTPException
    from opensandbox_server.api.schema import CreateSandboxRequest
    from opensandbox_server.services.docker.container_ops import DockerContainerOpsMixin
    from opensandbox_server.services.k8s.provider_common import (
        _translate_resource_limits_for_k8s,
    )

    body: dict[str, Any] = {"image": {"uri": "python:3.12"}, "entrypoint": ["python"]}
    if absent:  # resourceLimits may be left out only for a pooled sandbox
        body["extensions"] = {"poolRef": "pool"}
    else:
        body["resourceLimits"] = limits
    try:
        request = CreateSandboxRequest.model_validate(body)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        return {"status": 422, "why": f"{first['loc']}: {first['msg']}"}
    answer: dict[str, Any] = {"status": 200}
    try:
        _, _, gpu = DockerContainerOpsMixin._resolve_resource_limits(None, request)  # type: ignore[arg-type]
        answer["docker"] = {"status": 200, "gpu": gpu}
    except HTTPException as err:
        answer["docker"] = {"status": err.status_code, "why": str(err.detail)[:300]}
    root = request.resource_limits.root if request.resource_limits else {}
    try:
        answer["k8s"] = {"status": 200, "limits": _translate_resource_limits_for_k8s(root)}
    except HTTPException as err:
        answer["k8s"] = {"status": err.status_code, "why": str(err.detail)[:300]}
    return answer


# --- Tako ------------------------------------------------------------------------------------


def _tako_job(job: Any) -> dict[str, Any]:
    from tako_vm.job_types import JobType

    try:
        read = JobType.from_dict(job)
    except Exception as err:  # pydantic's ValidationError, or what dict and list raise
        return {"ok": False, "why": f"{type(err).__name__}: {err}"}
    return {
        "ok": True,
        "enabled": read.gpu_enabled,
        "vendor": read.gpu_vendor,
        "count": read.gpu_count,
        "device_ids": read.gpu_device_ids,
    }


def tako(block: object, absent: bool) -> dict[str, Any]:
    """A job type's ``gpu`` block through both of Tako's readers."""
    import pydantic
    from tako_vm.config import JobTypeGPUConfig

    try:
        model = JobTypeGPUConfig() if absent else JobTypeGPUConfig.model_validate(block)
        config: dict[str, Any] = {"ok": True, **model.model_dump()}
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        config = {"ok": False, "why": f"{first['loc']}: {first['msg']}"}
    job = {"name": "job"} if absent else {"name": "job", "gpu": block}
    return {"config": config, "from_dict": _tako_job(job)}


def tako_job(job: object, absent: bool) -> dict[str, Any]:
    """A whole job type (legacy top-level ``gpu_*`` keys included) through ``from_dict``."""
    return {"from_dict": _tako_job(job)}


# --- FlowMesh --------------------------------------------------------------------------------


def flowmesh_cli(options: dict[str, Any], absent: bool) -> dict[str, Any]:
    """The GPU block ``flowmesh ssh`` writes for ``--gpu N --gpu-memory M``."""
    import yaml
    from flowmesh.ssh import build_ssh_task_yaml

    text = build_ssh_task_yaml(
        name="task",
        public_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
        user="flowmesh",
        mode="direct",
        ttl=600,
        idle_timeout=300,
        gpu=options.get("gpu"),
        gpu_memory=options.get("gpu_memory"),
        cpu=None,
        memory=None,
        image=None,
        worker=None,
        env_pairs=None,
    )
    spec = yaml.safe_load(text)["spec"]
    return {"block": spec.get("resources", {}).get("hardware", {}).get("gpu")}


def flowmesh(block: object, absent: bool) -> dict[str, Any]:
    """FlowMesh's worker reading ``resources.hardware.gpu``: only in its source repository."""
    return _flowmesh_resolver(None if absent else block)


def _parse_mem_to_bytes(text: str) -> int | None:
    """mlsys-io/FlowMesh src/shared/utils/parsing.py parse_mem_to_bytes at 202106ee."""
    import re

    match = re.match(r"^\s*([0-9]+)\s*([KkMmGgTt][Ii]?[Bb]?)?\s*$", text)
    if not match:
        return None
    unit = (match.group(2) or "").lower()[:1]
    return int(match.group(1)) * 1024 ** {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}[unit]


def _flowmesh_resolver(block: object) -> dict[str, Any]:
    """The rule of mlsys-io/FlowMesh src/worker/executors/ssh_session/config.py
    _resolve_gpu_devices at 7d2a77aca8b8f7982148c7fb50fac05ca0c7137c, with
    src/shared/utils/hardware.py (normalize_gpu_type, parse_gpu_memory_bytes) at
    6f1ac4c2d28e57711811d3f3e10ac7a37f1cd3a5, on a block of the shape its ``GPURequirements``
    model takes (count an integer, type a string, memory a string or a number, no other key).
    """
    if block is None:
        return {"gpus": "none"}  # tests/shared/test_spec_uses_gpu.py: no block, no GPU
    if not isinstance(block, dict) or set(block) - {"count", "type", "memory"}:
        return _refused("model", "GPURequirements takes count, type and memory only")
    count, kind, memory = block.get("count"), block.get("type"), block.get("memory")
    if count is None and not kind and not memory:
        return {"gpus": "all"}  # the worker's whole GPU set
    requested = count if count is not None else 1
    if requested <= 0:
        return {"gpus": "none"}
    minimum = None
    if memory:
        try:
            minimum = _parse_mem_to_bytes(memory) if isinstance(memory, str) else int(memory)
        except (ValueError, OverflowError) as err:  # int() of NaN or an infinity
            return _refused("worker", err)
        if minimum is None:
            return _refused("worker", f"resources.hardware.gpu.memory {memory!r} is not valid")
    normalized = None if kind is None else kind.strip().lower()
    if normalized in ("", "any", "auto", "*"):
        normalized = None
    return {"gpus": requested, "type": normalized, "min_memory_bytes": minimum}


HANDLERS = {
    "openshell": openshell,
    "opensandbox": opensandbox,
    "tako": tako,
    "tako_job": tako_job,
    "flowmesh": flowmesh,
    "flowmesh_cli": flowmesh_cli,
}


def main() -> None:
    """Answer requests until stdin closes; a crash of the oracle itself is reported, not fatal."""
    logging.disable(logging.WARNING)  # parse_gpu_request logs every value it drops
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = HANDLERS[request["platform"]](
                request.get("input"), request.get("absent", False)
            )
        except Exception:
            answer = {"oracle_error": traceback.format_exc()}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
