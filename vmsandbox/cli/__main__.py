"""``python -m vmsandbox.cli ARGS...``: the ``vmsandbox`` command."""

import sys

from vmsandbox.cli import main

sys.exit(main())
