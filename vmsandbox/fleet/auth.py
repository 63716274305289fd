"""Ray's token authentication, required by every fleet process that joins or uses the cluster.

Ray reads ``RAY_AUTH_MODE=token`` and the token from ``RAY_AUTH_TOKEN``, the file named by
``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``. Every process of the cluster, the head, each
host's node, the agents and the fleet server, needs the same token; with the mode off, anyone
who reaches a Ray port could run code on the hosts, so the fleet refuses to run.
"""

from __future__ import annotations

import os
from pathlib import Path

from vmsandbox.errors import FailedPrecondition

MODE = "RAY_AUTH_MODE"
TOKEN = "RAY_AUTH_TOKEN"
TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"


def token_source() -> str | None:
    """Where Ray will read the token from; None when there is none."""
    if os.environ.get(TOKEN):
        return TOKEN
    path = os.environ.get(TOKEN_PATH)
    if path:
        return path if Path(path).is_file() else None
    default = Path.home() / ".ray" / "auth_token"
    return str(default) if default.is_file() else None


def check_token_auth() -> None:
    """FAILED_PRECONDITION unless token authentication is on and a token is at hand."""
    if os.environ.get(MODE, "").lower() != "token":
        raise FailedPrecondition(
            f"Ray token authentication is off: set {MODE}=token and the cluster's token in "
            f"{TOKEN} (or a file named by {TOKEN_PATH}); the fleet never runs without it",
            details={"field": MODE, "value": os.environ.get(MODE, "")},
        )
    if token_source() is None:
        raise FailedPrecondition(
            f"{MODE}=token but no token: set {TOKEN}, or {TOKEN_PATH} to a file holding it",
            details={"field": TOKEN},
        )
