"""The ``vmsandbox`` command: its parser (``args``, with the sizes people type in ``sizes``) and
its commands (``commands``, whose ``main`` is the entry point, here as ``vmsandbox.cli.main``;
``gpus``: the GPUs, their custody and the operator's commands for them);
``python -m vmsandbox.cli`` runs it too.

A face: it may import ``openshell`` (``vmsandbox serve``), ``compat`` and everything below them.
``commands`` imports the heavy modules inside the commands that need them, so this package stays
quick to import and ``vmsandbox --help`` starts fast.
"""

from vmsandbox.cli.commands import main

__all__ = ["main"]
