"""Test-only entry point: the vmsandbox CLI with a crash checkpoint installed.

``python tests/framework/crash_cli.py STAGE ARGS...`` runs ``vmsandbox ARGS...``; when a create
reaches checkpoint STAGE (sandbox/create.py: ``locked`` or a step's name, also of a pool fill or
claim: sandbox/pool/steps.py's ``FILL_STEPS``, ``CLAIM_STEPS`` and ``GPU_CLAIM_STEPS``, e.g.
``attach``) it prints ``vmsandbox-checkpoint STAGE`` on stderr and waits there to be killed.
The product has no such hook of its own: the tests put it in through
``SandboxManager.checkpoint``. A STAGE ``before-METHOD`` or ``after-METHOD`` stops around a call
of that ``LibvirtHypervisor`` method instead (``after-save``: a suspend whose guest's memory is
saved and not yet recorded so; ``before-start`` of a resume: nothing restored yet).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from vmsandbox import cli
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.vm.hypervisor import LibvirtHypervisor


def main() -> int:
    stage, args = sys.argv[1], sys.argv[2:]

    def stop_at(reached: str) -> None:
        if reached == stage:
            print(f"vmsandbox-checkpoint {stage}", file=sys.stderr, flush=True)
            time.sleep(3600)

    when, _, method = stage.partition("-")
    if when in ("before", "after") and hasattr(LibvirtHypervisor, method):
        real = getattr(LibvirtHypervisor, method)

        def around(self: LibvirtHypervisor, *call: Any, **named: Any) -> Any:
            if when == "before":
                stop_at(stage)
            result = real(self, *call, **named)
            if when == "after":
                stop_at(stage)
            return result

        setattr(LibvirtHypervisor, method, around)
    else:
        SandboxManager.checkpoint = staticmethod(stop_at)
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
