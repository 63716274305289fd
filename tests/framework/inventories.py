"""The fake hosts' inventories: ``discover()`` run under umockdev (framework/fake_hosts.py),
one subprocess per host, in parallel; ``HGX`` names the HGX H100 board's eight GPUs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from framework.fake_hosts import inventory_from_dict, probe

from vmsandbox.host.model import Inventory

# HGX: node 0 has switches 16 (18, 19) and 3f (41, 42); node 1 has 98 (9a, 9b) and bf (c1, c2)
HGX = [f"0000:{bus}:00.0" for bus in ("18", "19", "41", "42", "9a", "9b", "c1", "c2")]


def discover_hosts(cases: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Inventory]:
    """``discover()`` once per entry (name -> fake host and probe case), in parallel."""
    with ThreadPoolExecutor(len(cases)) as pool:
        results = pool.map(lambda entry: probe(entry[0], [entry[1]])[0], cases.values())
        return {
            name: inventory_from_dict(result["inventory"])
            for name, result in zip(cases, results, strict=True)
        }
