"""Test-only: one client of the chaos test (tests/reliability/test_chaos.py).

``python tests/framework/chaos_worker.py --worker ID --seconds S --seed N --log FILE [--filler]``,
with the configuration in ``$VMSANDBOX_CONFIG``: for S seconds it creates, destroys, claims and
reconciles sandboxes at random, and writes each call's outcome as one JSON line to FILE (a "begin"
line first for destroys, so that a worker killed mid-destroy can be told apart).

No guest boots, so that eight clients fit on a small machine for minutes: creates define their
sandboxes (GPU ones too: the definition holds the GPUs and, in shared NVSwitch mode, the
activated Fabric Manager partition; a start would fail on a host without VFIO), and pooled
guests are defined, not started, by the ``--filler``. A claim takes one of them; the claimed
guest's hostname command, the only thing a claim asks of the guest, is answered here. All the
rest (the host lock, reservations, libvirt, files, fmpm) is the real thing.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from vmsandbox.config import Config
from vmsandbox.errors import VmSandboxError
from vmsandbox.gpu.request import GpuRequest
from vmsandbox.guest.ssh import ExecResult
from vmsandbox.sandbox import runner
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.pool.shapes import PoolFull, shape_spec
from vmsandbox.sandbox.pool.steps import FILL_STEPS
from vmsandbox.sandbox.spec import SandboxSpec

IMAGE = "chaos"
DEFINED_FILL = tuple(s for s in FILL_STEPS if s.name not in ("start", "wait", "settle"))


def answering(*_args: Any, **_kwargs: Any) -> ExecResult:
    return ExecResult(0, "", "")


class Worker:
    def __init__(self, worker: str, seed: int, log: IO[str]) -> None:
        self.worker = worker
        self.rng = random.Random(seed)
        self.log = log
        self.made = 0
        self.manager = SandboxManager(Config.load(), reconcile=False)
        self.manager.pool.guest_run = answering

    def note(self, op: str, **data: Any) -> None:
        self.log.write(json.dumps({"op": op, "worker": self.worker, "t": time.time(), **data}))
        self.log.write("\n")
        self.log.flush()

    def call(self, op: str, body: Callable[[], dict[str, Any]]) -> None:
        try:
            self.note(op, ok=True, **body())
        except VmSandboxError as exc:
            self.note(op, ok=False, code=exc.code, message=exc.message)
        except Exception as exc:  # the test fails on any of these
            self.note(
                op,
                ok=False,
                code="RAW",
                message=f"{type(exc).__name__}: {exc}",
                trace=traceback.format_exc(),
            )

    def name(self, prefix: str) -> str:
        self.made += 1
        return f"{prefix}{self.worker}-{self.made}"

    def create(self) -> dict[str, Any]:
        count = self.rng.choice([0, 1, 1, 2, 4])
        spec = SandboxSpec(
            name=self.name("c"),
            image=IMAGE,
            memory_mib=256,
            disk_gib=1,
            gpu=GpuRequest(count=count) if count else None,
        )
        made = self.manager.create(spec, start=False)
        return {"name": made.name, "uuid": made.uuid, "gpus": [g["bdf"] for g in made.gpus]}

    def destroy(self) -> dict[str, Any]:
        mine = [s for s in self.manager.list() if s.local and s.name[0] in "ck"]
        if not mine:
            return {"name": None}
        victim = self.rng.choice(mine)
        self.note("begin-destroy", uuid=victim.uuid)
        self.manager.destroy(victim.name, uuid=victim.uuid)
        return {"name": victim.name, "uuid": victim.uuid}

    def claim(self) -> dict[str, Any]:
        shape = self.manager.config.pool[0]
        spec = SandboxSpec(
            name=self.name("k"),
            image=shape.image,
            cpus=shape.cpus,
            memory_mib=shape.memory_mib,
            disk_gib=shape.disk_gib,
        )
        image = self.manager.images.get(shape.image)
        made = self.manager.pool.claim(spec, spec.name or "", image, lambda _l: None, False)
        if made is None:
            return {"name": None}
        return {"name": made.name, "uuid": made.uuid}

    def fill(self) -> dict[str, Any]:
        """One pooled guest, defined, not booted (while the shape has room)."""
        m = self.manager
        shape = m.config.pool[0]
        spec = shape_spec(shape)
        creation = m.pool.creation(
            spec, spec.name or "", m.images.get(shape.image), lambda _l: None
        )
        creation.pool_key, creation.doing = shape.key, "fill"
        creation.room = lambda now: (
            sum(1 for h in now.holds.values() if h.pool == shape.key) < shape.count
        )
        try:
            runner.run(DEFINED_FILL, creation, m.locked, m.checkpoint)
        except PoolFull:
            return {"name": None}
        return {"name": spec.name, "uuid": creation.uuid}

    def reconcile(self) -> dict[str, Any]:
        return {"report": self.manager.reconcile()}

    def run(self, seconds: float, filler: bool) -> None:
        end = time.monotonic() + seconds
        ops: list[tuple[str, Callable[[], dict[str, Any]], int]] = [
            ("create", self.create, 5),
            ("destroy", self.destroy, 4),
            ("claim", self.claim, 3),
            ("reconcile", self.reconcile, 1),
        ]
        if filler:
            ops = [("fill", self.fill, 6), ("destroy", self.destroy, 1)]
        names = [op for op, _body, weight in ops for _ in range(weight)]
        bodies = {op: body for op, body, _weight in ops}
        while time.monotonic() < end:
            op = self.rng.choice(names)
            self.call(op, bodies[op])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--filler", action="store_true")
    args = parser.parse_args()
    with args.log.open("a") as log:
        worker = Worker(args.worker, args.seed, log)
        print("started", flush=True)
        worker.run(args.seconds, args.filler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
