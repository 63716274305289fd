"""The client of NVIDIA's ``fmpm`` (NVIDIA/Fabric-Manager-Client), the partition tool of
Fabric Manager's shared NVSwitch mode.

What ``fmpm`` does, from its source: ``-l`` prints the partition list as JSON, ``-a ID``
activates and ``-d ID`` deactivates a partition; ``--unix-domain-socket PATH`` or
``--hostname H`` pick the FM instance (default TCP 127.0.0.1). Every message goes to stdout;
the exit status is FM's ``fmReturn_t`` (0 success, negative errors, so 255, 254, ... as a
process status). Failures print one line:

- ``Failed to connect to Fabric Manager instance.`` or ``Failed to initialize Fabric Manager
  API interface library.``: FM cannot be reached (UNAVAILABLE here);
- ``Failed to get partition list. fmReturn: N``: FM did not answer the list (UNAVAILABLE);
- ``Failed to activate partition. fmReturn: N`` / ``Failed to deactivate partition. fmReturn:
  N``: FM refused, e.g. a partition overlapping an active one (FAILED_PRECONDITION, with the
  line).
"""

from __future__ import annotations

import builtins
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from vmsandbox.errors import FailedPrecondition, Unavailable
from vmsandbox.gpu.fabric.partitions import PartitionTable, parse_partition_list

# fmpm connects with a 1 s timeout and FM answers in milliseconds; activation trains NVLinks.
DEFAULT_TIMEOUT = 120.0
_UNREACHABLE = (
    "Failed to connect to Fabric Manager instance",
    "Failed to initialize Fabric Manager API interface library",
)
_FM_RETURN = re.compile(r"fmReturn:\s*(-?\d+)")


@dataclass(frozen=True)
class Fmpm:
    """How to run fmpm: ``binary`` is a path or a name looked up on PATH; at most one of
    ``unix_socket`` and ``hostname`` picks the FM instance (neither: fmpm's 127.0.0.1)."""

    binary: str = "fmpm"
    unix_socket: str | None = None
    hostname: str | None = None
    timeout: float = DEFAULT_TIMEOUT

    def list(self) -> PartitionTable:
        """Every partition FM supports, with which are active."""
        return parse_partition_list(self._run("-l", doing="listing partitions"))

    def activate(self, partition_id: int) -> None:
        self._run("-a", str(partition_id), doing=f"activating partition {partition_id}")

    def deactivate(self, partition_id: int) -> None:
        self._run("-d", str(partition_id), doing=f"deactivating partition {partition_id}")

    def where(self) -> str:
        """The FM instance, as a message names it."""
        if self.unix_socket:
            return f"Fabric Manager at unix socket {self.unix_socket}"
        return f"Fabric Manager at {self.hostname or '127.0.0.1'}"

    def resolve(self) -> str:
        """The fmpm executable; FAILED_PRECONDITION when there is none."""
        if "/" in self.binary:
            executable = os.path.isfile(self.binary) and os.access(self.binary, os.X_OK)
            found = self.binary if executable else None
        else:
            found = shutil.which(self.binary)
        if found is None:
            where = "is not an executable file" if "/" in self.binary else "is not on PATH"
            raise FailedPrecondition(
                f"fmpm {self.binary!r} {where}: this host's GPUs sit on NVSwitches in shared "
                "NVSwitch mode, and their partitions are managed with NVIDIA's fmpm "
                "(NVIDIA/Fabric-Manager-Client); install it or set 'fmpm' in config.toml "
                "(VMSANDBOX_FMPM)",
                details={"field": "fmpm", "value": self.binary},
            )
        return found

    def _run(self, *args: str, doing: str) -> str:
        argv = [self.resolve(), *self._connection(), *args]
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=self.timeout, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise Unavailable(
                f"{doing}: fmpm did not finish within {self.timeout:g} s ({self.where()})",
                details={"argv": argv},
            ) from exc
        except OSError as exc:
            raise FailedPrecondition(
                f"{doing}: fmpm {argv[0]} cannot be run: {exc.strerror or exc}",
                details={"argv": argv},
            ) from exc
        output = done.stdout + done.stderr
        if done.returncode == 0:
            return done.stdout
        line = next((ln.strip() for ln in output.splitlines() if ln.strip()), "")
        match = _FM_RETURN.search(output)
        details = {
            "argv": argv,
            "exit_status": done.returncode,
            "output": output.strip()[:2000],
            "fm_return": int(match[1]) if match else None,
        }
        if any(marker in output for marker in _UNREACHABLE) or args[0] == "-l":
            raise Unavailable(
                f"{doing}: {self.where()} cannot be reached: fmpm says {line!r} "
                f"(exit status {done.returncode}); is nv-fabricmanager running with "
                "FABRIC_MODE=1, and do fm_unix_socket / fm_hostname name it?",
                details=details,
            )
        raise FailedPrecondition(
            f"{doing}: Fabric Manager refused: fmpm says {line!r} (exit status {done.returncode})",
            details=details,
        )

    def _connection(self) -> builtins.list[str]:
        if self.unix_socket:
            return ["--unix-domain-socket", self.unix_socket]
        if self.hostname:
            return ["--hostname", self.hostname]
        return []
