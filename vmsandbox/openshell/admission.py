"""The operator's resource admission policy, echoed to the gateway in GetCapabilities.

An OpenShell v0.1 gateway is configured per driver with two settings and refuses to use a
driver whose ``resource_admission_policy`` does not state the same ones:

- ``allow_driver_config``: whether callers may send ``template.driver_config`` (for vmsandbox
  the GPU selection by device, ``gpu_device_ids``). vmsandbox refuses a non-empty one itself
  when it is not allowed, because a gateway is not the only client a driver socket can have.
- ``resource_admission``: whether external resources a sandbox attaches must carry approval
  labels, and which (``required_labels``; the value ``${workspace}`` stands for the sandbox's
  workspace). A vmsandbox sandbox attaches no labelled external resource (disks and networks
  are its own; GPUs are exempt upstream), so this half is stated, not applied.

The config keys are ``openshell_allow_driver_config`` (default false),
``openshell_resource_admission`` (default true) and ``openshell_required_labels`` (default the
gateway's: ``openshell.ai/sandbox-attachable = "true"`` and
``openshell.ai/sandbox-attachable-workspace = "${workspace}"``); set them as the gateway's
``[openshell.drivers.<name>]`` block is set. The policy string is ``v1:`` and the JSON the
gateway writes: ``{"allow_driver_config":B,"resource_admission":{"enabled":B,
"required_labels":{...}}}``, compact, labels sorted by key. A policy the gateway would refuse
at its start (labels required but none given, a reserved or malformed label, only
``${workspace}`` values) is refused here with FAILED_PRECONDITION naming the config key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from google.protobuf import struct_pb2

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, InvalidArgument

WORKSPACE_PLACEHOLDER = "${workspace}"
DEFAULT_REQUIRED_LABELS = {
    "openshell.ai/sandbox-attachable": "true",
    "openshell.ai/sandbox-attachable-workspace": WORKSPACE_PLACEHOLDER,
}
RESERVED_LABEL_KEYS = (
    "openshell.ai/managed-by",
    "openshell.ai/gateway-id",
    "openshell.ai/sandbox-workspace",
)
_LABELS_KEY = "openshell_required_labels"
_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?\Z")
_PREFIX_PART = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\Z")


@dataclass(frozen=True)
class AdmissionPolicy:
    """The effective policy of this driver (see the module docstring)."""

    allow_driver_config: bool = False
    enabled: bool = True
    required_labels: Mapping[str, str] = field(
        default_factory=lambda: dict(DEFAULT_REQUIRED_LABELS)
    )

    @classmethod
    def from_config(cls, config: Config) -> AdmissionPolicy:
        """The configured policy; FAILED_PRECONDITION when the gateway would refuse it."""
        labels = (
            dict(DEFAULT_REQUIRED_LABELS)
            if config.openshell_required_labels is None
            else dict(config.openshell_required_labels)
        )
        policy = cls(
            config.openshell_allow_driver_config, config.openshell_resource_admission, labels
        )
        policy.validate()
        return policy

    def validate(self) -> None:
        """The gateway's own checks of a policy, with the config key named."""
        if self.enabled and not self.required_labels:
            raise _bad("is empty while openshell_resource_admission is true")
        for key, value in sorted(self.required_labels.items()):
            if key in RESERVED_LABEL_KEYS:
                raise _bad(f"names {key!r}, a label the drivers reserve for their own metadata")
            if not valid_label_key(key):
                raise _bad(f"key {key!r} is not a label key (an optional DNS prefix and '/')")
            if value != WORKSPACE_PLACEHOLDER and not _VALUE.match(value):
                raise _bad(
                    f"value {value!r} of {key!r} is not a label value; only the whole value "
                    f"{WORKSPACE_PLACEHOLDER} is substituted"
                )
        if self.enabled and all(v == WORKSPACE_PLACEHOLDER for v in self.required_labels.values()):
            raise _bad(f"needs a shared approval label besides {WORKSPACE_PLACEHOLDER} values")

    def acknowledgement(self) -> str:
        """The ``resource_admission_policy`` string, exactly as the gateway writes its own."""
        body = {
            "allow_driver_config": self.allow_driver_config,
            "resource_admission": {
                "enabled": self.enabled,
                "required_labels": dict(sorted(self.required_labels.items())),
            },
        }
        return "v1:" + json.dumps(body, separators=(",", ":"), ensure_ascii=False)

    def check_driver_config(self, driver_config: struct_pb2.Struct | None) -> None:
        """INVALID_ARGUMENT for a non-empty ``template.driver_config`` the operator does not
        allow (an empty one says nothing and passes, as at the gateway)."""
        if self.allow_driver_config or driver_config is None or not driver_config.fields:
            return
        keys = ", ".join(sorted(driver_config.fields))
        raise InvalidArgument(
            f"template.driver_config ({keys}) is not allowed on this host: the operator has "
            "not enabled openshell_allow_driver_config, so GPUs are chosen by count only",
            details={"field": "template.driver_config", "value": sorted(driver_config.fields)},
        )


def valid_label_key(key: str) -> bool:
    """A Kubernetes label key: an optional lowercase DNS prefix and '/', then a name."""
    prefix, slash, name = key.rpartition("/")
    if not name or not _VALUE.match(name) or len(name) > 63:
        return False
    if not slash:
        return True
    return (
        0 < len(prefix) <= 253
        and "/" not in prefix
        and all(_PREFIX_PART.match(part) for part in prefix.split("."))
    )


def _bad(problem: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"config {_LABELS_KEY} {problem}: the gateway refuses such a resource admission policy",
        details={"field": _LABELS_KEY},
    )
