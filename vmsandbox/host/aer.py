"""PCIe Advanced Error Reporting (AER) in the host kernel's log: which device or port reported
which error, from the lines the kernel's AER driver prints.

The lines look like these (the driver's name, then the function's address; Linux 6.1 to 6.5
say "error received: BDF", later kernels "error message received from BDF")::

    pcieport 0000:00:06.0: AER: Uncorrected (Fatal) error message received from 0000:00:06.0
    pcieport 0000:00:1c.0: AER: Multiple Corrected error received: 0000:01:00.0
    vfio-pci 0000:02:00.0: PCIe Bus Error: severity=Uncorrected (Non-Fatal), type=...
    pcieport 0000:00:06.0: AER: device recovery failed

An error is the device's own or its port's: the port's link carries every transaction of the
device below it, so a GPU is concerned by a line that names it, a function of its card, or
the bridge it sits behind. ``severity`` is ``corrected`` (the hardware fixed it: reported,
nothing more), ``nonfatal`` or ``fatal`` (uncorrected: the device's state can no longer be
trusted), or ``recovery-failed`` (the kernel's recovery gave up on the device).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_ADDRESS = r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]"
_LINE = re.compile(rf"(?:^|\s)(?P<reporter>{_ADDRESS}): (?:AER: )?(?P<rest>.*)$")
_RECEIVED = re.compile(
    rf"(?:Multiple )?(?P<severity>Corrected|Uncorrected \((?:Non-)?Fatal\)) error "
    rf"(?:received: |message received from )(?P<source>{_ADDRESS})"
)
_BUS_ERROR = re.compile(r"PCIe Bus Error: severity=(?P<severity>Corrected|Uncorrected \([^)]*\))")
_SEVERITY = {
    "Corrected": "corrected",
    "Uncorrected (Non-Fatal)": "nonfatal",
    "Uncorrected (Fatal)": "fatal",
}
UNCORRECTED = ("nonfatal", "fatal", "recovery-failed")


@dataclass(frozen=True)
class AerEvent:
    """One AER line: the function the error is about (``source``), the one that printed it
    (``reporter``), its severity, and the line."""

    source: str
    reporter: str
    severity: str
    line: str

    def concerns(self, functions: Iterable[str]) -> bool:
        return any(bdf in (self.source, self.reporter) for bdf in functions)


def parse_line(line: str) -> AerEvent | None:
    """The AER event a kernel log line reports, None for any other line."""
    if "AER" not in line and "PCIe Bus Error" not in line:
        return None
    match = _LINE.search(line.strip())
    if match is None:
        return None
    reporter, rest = match["reporter"].lower(), match["rest"]
    if received := _RECEIVED.search(rest):
        severity = _SEVERITY[received["severity"]]
        return AerEvent(received["source"].lower(), reporter, severity, line.strip())
    if bus := _BUS_ERROR.search(rest):
        severity = _SEVERITY.get(bus["severity"], "nonfatal")
        return AerEvent(reporter, reporter, severity, line.strip())
    if "device recovery failed" in rest:
        return AerEvent(reporter, reporter, "recovery-failed", line.strip())
    return None


def parse(lines: Iterable[str]) -> list[AerEvent]:
    return [event for line in lines if (event := parse_line(line)) is not None]
