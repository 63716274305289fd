"""The ``vmsandbox`` command: its parser (``args``, with the sizes people type in ``sizes``), its
commands (``commands``, whose ``main`` is the entry point, here as ``vmsandbox.cli.main``;
``images`` has the ``images`` subcommands, ``access`` those that use a running sandbox: exec, ssh,
ssh-config, forward, logs; ``files`` is ``cp``; ``lifetime`` is ``--ttl``, extend and reap;
``suspension`` is suspend and resume; ``completion`` is shell completion; ``gpus`` the GPUs, their
custody and the operator's commands for them), what they print (``output``: text or JSON, errors and
exit statuses) and what the command modules share (``common``). ``python -m vmsandbox.cli`` runs it
too.

A face: it may import ``openshell`` (``vmsandbox serve``), ``compat`` and everything below them.
``commands`` imports the heavy modules inside the commands that need them, so this package stays
quick to import and ``vmsandbox --help`` starts fast.
"""

from vmsandbox.cli.commands import main

__all__ = ["main"]
