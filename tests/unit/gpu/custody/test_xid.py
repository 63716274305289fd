"""NVIDIA's Xid catalogue sorted into application, reset and reboot faults (xid.py)."""

from __future__ import annotations

import pytest

from vmsandbox.gpu.custody import xid


@pytest.mark.parametrize("code", [13, 31, 43, 45, 68, 94])
def test_application_errors_are_the_applications(code: int) -> None:
    assert xid.classify(code).kind == xid.APP


@pytest.mark.parametrize(("code", "kind"), [(48, xid.RESET), (95, xid.RESET), (79, xid.REBOOT)])
def test_gpu_faults(code: int, kind: str) -> None:
    assert xid.classify(code).kind == kind


def test_an_unknown_xid_is_reset_rather_than_handed_on() -> None:
    assert xid.classify(999).kind == xid.RESET


def test_xid_154_names_its_action() -> None:
    line = "NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x2"
    assert xid.classify(154, line + " (Node Reboot Required)").kind == xid.REBOOT
    assert xid.classify(154, line + " (GPU Reset Required)").kind == xid.RESET
