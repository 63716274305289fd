"""What most unit tests stand on, in place of tests/conftest.py's real ones: a fresh state
directory and image store (``config``, from ``unit_config``), the fake hypervisor (``hv``) and a
``SandboxManager`` over both that does not reconcile at start (``manager``). A module that needs
another ``config`` defines its own, and ``manager`` follows it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from framework.fake_hypervisor import FakeHypervisor, unit_config

from vmsandbox.config import Config
from vmsandbox.sandbox.manager import SandboxManager


@pytest.fixture
def config(tmp_path: Path) -> Config:
    """A state directory and an image store holding one 16 MiB qcow2 image, ``tiny``."""
    return unit_config(tmp_path)


@pytest.fixture
def hv() -> FakeHypervisor:
    return FakeHypervisor()


@pytest.fixture
def manager(config: Config, hv: FakeHypervisor) -> Iterator[SandboxManager]:
    with SandboxManager(config, hypervisor=hv, reconcile=False) as mgr:
        yield mgr
