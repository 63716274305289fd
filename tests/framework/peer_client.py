"""A client of the driver's socket run as another uid: what a second gateway (or a fleet agent)
on the same host sends and sees.

``as_uid(uid, socket, calls, gateway=None)`` runs this file as ``uid`` (a child process: the
socket's gate reads the peer's uid from the kernel) and returns one answer per call. A call is
``[rpc, {field: value}]`` with the request's fields (``sandbox`` a DriverSandbox as a dict); an
answer is ``{"code": "OK", ...}`` with the response as a dict, or ``{"code": CODE, "message": ...}``
for an error. ``gateway`` is sent as the ``vmsandbox-gateway`` metadata.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from framework.paths import REPO


def as_uid(
    uid: int, socket_path: Path, calls: list[list[Any]], gateway: str | None = None
) -> list[dict[str, Any]]:
    """Run ``calls`` on ``socket_path`` as ``uid`` (and its group of the same number)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": f"{REPO}:{REPO / 'tests'}",
    }
    done = subprocess.run(
        [sys.executable, __file__, str(socket_path), gateway or "", json.dumps(calls)],
        user=uid,
        group=uid,
        extra_groups=[],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def main() -> None:
    import grpc
    from google.protobuf import json_format

    from vmsandbox.openshell.proto import compute_driver_pb2 as pb
    from vmsandbox.openshell.proto import compute_driver_pb2_grpc as pb_grpc
    from vmsandbox.openshell.proto import host_info_pb2 as info_pb
    from vmsandbox.openshell.proto import host_info_pb2_grpc as info_grpc

    socket_path, gateway, calls = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    metadata = (("vmsandbox-gateway", gateway),) if gateway else ()
    with grpc.insecure_channel(f"unix:{socket_path}") as channel:
        driver, info = pb_grpc.ComputeDriverStub(channel), info_grpc.HostInfoStub(channel)
        for rpc, fields in calls:
            if rpc == "GetHostInfo":
                call, request = info.GetHostInfo, info_pb.GetHostInfoRequest()
            else:
                call = getattr(driver, rpc)
                request = json_format.ParseDict(fields, getattr(pb, f"{rpc}Request")())
            try:
                answer = call(request, timeout=60, metadata=metadata)
            except grpc.RpcError as exc:
                print(json.dumps({"code": exc.code().name, "message": exc.details()}))
                continue
            shown = json_format.MessageToDict(answer, preserving_proto_field_name=True)
            print(json.dumps({"code": "OK", **shown}))


if __name__ == "__main__":
    main()
