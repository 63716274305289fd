"""A create that needs a booted guest to fail: a duplicate name is ALREADY_EXISTS and keeps the
original."""

from __future__ import annotations

import pytest
from framework.sandboxes import leftovers

from vmsandbox.config import Config
from vmsandbox.errors import AlreadyExists
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.spec import SandboxSpec


def test_duplicate_name_is_already_exists_and_keeps_the_original(
    manager: SandboxManager, config: Config, booted: Sandbox
):
    before = sorted(leftovers(config, booted.name))
    with pytest.raises(AlreadyExists):
        manager.create(SandboxSpec(name=booted.name))
    assert sorted(leftovers(config, booted.name)) == before
    assert manager.exec(booted.name, "true").exit_status == 0
