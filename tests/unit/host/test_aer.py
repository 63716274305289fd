"""AER lines of the host kernel's log (host/aer.py), as Linux 6.1 prints them."""

from __future__ import annotations

from vmsandbox.host import aer

LINES = [
    # recorded in the nested GPU host (Debian 12's kernel) after pcie_aer_inject_error gpu1 DLP
    "[  102.644474] pcieport 0000:00:06.0: AER: Uncorrected (Fatal) error message received from "
    "0000:00:06.0",
    "pcieport 0000:00:1c.0: AER: Multiple Corrected error received: 0000:01:00.0",
    "vfio-pci 0000:02:00.0: AER: PCIe Bus Error: severity=Uncorrected (Non-Fatal), "
    "type=Transaction Layer, (Requester ID)",
    "pcieport 0000:00:06.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Data Link Layer, "
    "(Receiver ID)",
    "pci 0000:02:00.0: AER: can't recover (no error_detected callback)",
    "pcieport 0000:00:06.0: AER: Root Port link has been reset (0)",
    "pcieport 0000:00:06.0: AER: device recovery failed",
    "radeon 0000:01:00.0: ring 0 stalled",
]


def test_the_lines_parse_to_source_reporter_and_severity() -> None:
    events = aer.parse(LINES)
    assert [(e.source, e.reporter, e.severity) for e in events] == [
        ("0000:00:06.0", "0000:00:06.0", "fatal"),
        ("0000:01:00.0", "0000:00:1c.0", "corrected"),
        ("0000:02:00.0", "0000:02:00.0", "nonfatal"),
        ("0000:00:06.0", "0000:00:06.0", "fatal"),
        ("0000:00:06.0", "0000:00:06.0", "recovery-failed"),
    ]


def test_an_event_concerns_its_source_and_its_reporter() -> None:
    event = aer.parse(LINES[1:2])[0]
    assert event.concerns(["0000:01:00.0"]) and event.concerns(["0000:00:1c.0"])
    assert not event.concerns(["0000:02:00.0"])
