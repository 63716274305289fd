"""NVIDIA Xid errors sorted by what they say about the GPU, after NVIDIA's Xid catalogue
("Analyzing Xid Errors with the Xid Catalog", docs.nvidia.com/deploy/xid-errors/, Ampere and
later; its "Resolution Bucket (Immediate Action)" column).

Three kinds matter to custody:

- ``app``: the application's fault (a bad address, an illegal instruction, a channel the
  driver cleaned up, a contained ECC error the application must restart after). The GPU
  itself is fine: reported, never quarantined (RESTART_APP, IGNORE).
- ``reset``: the GPU needs a reset before it is trusted again (RESET_GPU): it is quarantined
  and gets one automatic reset once its sandbox lets it go.
- ``reboot``: a reset does not cure it (RESTART_BM: the GPU fell off the bus; CONTACT_SUPPORT,
  CHECK_MECHANICALS): quarantined until an operator acts.

An Xid the table does not know is taken as ``reset``: vmsandbox resets a GPU it cannot judge
rather than hand it on. Xid 154 ("GPU recovery action changed") names its action in its text.
"""

from __future__ import annotations

from dataclasses import dataclass

APP, RESET, REBOOT = "app", "reset", "reboot"

# Xid -> (kind, NVIDIA's mnemonic in short).
CATALOGUE: dict[int, tuple[str, str]] = {
    8: (APP, "GPU stopped processing (channel idle timeout)"),
    13: (APP, "graphics engine exception"),
    31: (APP, "GPU memory page fault"),
    32: (APP, "invalid or corrupted push buffer stream"),
    38: (APP, "driver firmware error"),
    42: (APP, "video processor exception"),
    43: (APP, "GPU stopped processing (reset channel verification error)"),
    45: (APP, "preemptive cleanup, due to a previous error"),
    63: (APP, "ECC page retirement or row remapping recorded"),
    68: (APP, "NVDEC0 exception"),
    69: (APP, "graphics engine class error"),
    94: (APP, "contained ECC error"),
    48: (RESET, "double-bit ECC error"),
    61: (RESET, "internal micro-controller breakpoint"),
    62: (RESET, "internal micro-controller halt"),
    64: (RESET, "ECC page retirement or row remapping failure"),
    74: (RESET, "NVLink error"),
    92: (RESET, "high single-bit ECC error rate"),
    95: (RESET, "uncontained ECC error"),
    109: (RESET, "context switch timeout"),
    119: (RESET, "GSP RPC timeout"),
    120: (RESET, "GSP error"),
    121: (RESET, "C2C link error"),
    136: (RESET, "link training failure"),
    140: (RESET, "unrecovered ECC error"),
    143: (RESET, "GPU initialisation failure"),
    79: (REBOOT, "GPU has fallen off the bus"),
    123: (REBOOT, "SPI PMU RPC write failure"),
    144: (REBOOT, "NVLink SAW error"),
    145: (REBOOT, "NVLink RLW error"),
}


@dataclass(frozen=True)
class XidKind:
    xid: int
    kind: str  # app, reset or reboot
    what: str


def classify(xid: int, line: str = "") -> XidKind:
    """What ``xid`` (with its kernel log ``line``) says about the GPU."""
    if xid == 154:
        text = line.lower()
        if "reboot" in text:
            return XidKind(xid, REBOOT, "GPU recovery action: node reboot required")
        if "reset" in text:
            return XidKind(xid, RESET, "GPU recovery action: GPU reset required")
        return XidKind(xid, APP, "GPU recovery action changed")
    kind, what = CATALOGUE.get(xid, (RESET, "an Xid the catalogue of vmsandbox does not know"))
    return XidKind(xid, kind, what)
