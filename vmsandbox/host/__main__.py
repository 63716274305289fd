"""``python -m vmsandbox.host``: the inventory as JSON (``--table`` for the text table).

No libvirt here: ``in_use_by`` stays empty. ``vmsandbox gpus`` fills it.
"""

from __future__ import annotations

import argparse
import json

from . import discover, render_table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vmsandbox.host", description=__doc__)
    parser.add_argument("--table", action="store_true", help="print the text table")
    parser.add_argument("--no-nvml", action="store_true", help="do not ask NVML")
    args = parser.parse_args(argv)
    inventory = discover(use_nvml=not args.no_nvml)
    if args.table:
        print(render_table(inventory), end="")
    else:
        print(json.dumps(inventory.to_dict(), indent=2))


if __name__ == "__main__":
    main()
