"""A guest for verification tests: a ``Runner`` that answers the in-guest verification's
commands (``vmsandbox.guest.verify``, its NVLink checks too) from strings or from a folder of
recorded outputs (``FakeGuest.scenario``: tests/fixtures/guest/<scenario>, or
tests/fixtures/real/<model>-<driver>/verify)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from framework import paths

from vmsandbox.guest import verify
from vmsandbox.guest.ssh import ExecResult
from vmsandbox.guest.verify import nvlink

SCENARIOS = paths.FIXTURES / "guest"
CHECK_OF = {
    verify.LSPCI: "lspci",
    verify.DRIVER_PROBE: "probe",
    verify.NVIDIA_SMI: "nvidia-smi",
    verify.KERNEL_LOG: "kernel-log",
    verify.COMPUTE: "compute",
    nvlink.CUDA_INIT: "cuda-init",
    nvlink.NVLINK_STATUS: "nvlink",
    nvlink.TOPOLOGY: "topology",
}


class FakeGuest:
    """A ``Runner`` answering the verification commands from files or strings.

    ``outputs`` maps a check name (``lspci``, ``probe``, ``nvidia-smi``, ``kernel-log``,
    ``compute``) to stdout, or to (exit status, stdout, stderr). A command without an answer
    fails the test: verification must not run it.
    """

    def __init__(self, outputs: Mapping[str, str | tuple[int, str, str]]) -> None:
        self.outputs = dict(outputs)
        self.calls: list[tuple[str, bytes | None, float | None]] = []

    @classmethod
    def scenario(cls, name: str | Path, **override: str | tuple[int, str, str]) -> FakeGuest:
        """The outputs of a folder of tests/fixtures/guest (or any folder): NAME.out, with
        NAME.status beside it for a non-zero exit status."""
        outputs: dict[str, str | tuple[int, str, str]] = {}
        for path in sorted((SCENARIOS / name).glob("*.out")):
            status_file = path.with_suffix(".status")
            status = int(status_file.read_text()) if status_file.exists() else 0
            outputs[path.stem] = (status, path.read_text(), "")
        outputs.update(override)
        return cls(outputs)

    @property
    def checks_run(self) -> list[str]:
        return [CHECK_OF[command] for command, _stdin, _timeout in self.calls]

    def __call__(
        self, command: str, *, stdin: bytes | None = None, timeout: float | None = None
    ) -> ExecResult:
        self.calls.append((command, stdin, timeout))
        check = CHECK_OF.get(command)
        assert check is not None, f"verification ran an unknown command: {command!r}"
        answer = self.outputs.get(check)
        assert answer is not None, f"verification ran {check!r}, which this guest does not expect"
        if isinstance(answer, str):
            answer = (0, answer, "")
        return ExecResult(exit_status=answer[0], stdout=answer[1], stderr=answer[2])
