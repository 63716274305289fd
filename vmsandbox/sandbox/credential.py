"""A secret a sandbox holds (the OpenShell gateway's sandbox token), kept on the host only as a
salted digest, so the sandbox can later be recognised by the secret without the host keeping it.

The digest is ``hmac-sha256$<salt hex>$<HMAC-SHA256(salt, secret) hex>`` with 16 random bytes of
salt per sandbox. The secret is a signed token with far more entropy than a password, so a fast
keyed hash is enough (a slow one would only make each AuthenticateSandbox, which checks every
sandbox, slow); the salt keeps two sandboxes given the same secret from sharing a digest.
Comparison is constant-time (``hmac.compare_digest``).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

from vmsandbox.errors import InvalidArgument

SCHEME = "hmac-sha256"
_SALT_BYTES = 16
# \Z, not $: "$" also matches before a trailing newline
_DIGEST = re.compile(rf"^{SCHEME}\$([0-9a-f]{{{2 * _SALT_BYTES}}})\$([0-9a-f]{{64}})\Z")


def digest(secret: str) -> str:
    """A fresh salted digest of ``secret`` (non-empty)."""
    if not secret:
        raise InvalidArgument("an empty secret has no digest", details={"field": "secret"})
    salt = secrets.token_bytes(_SALT_BYTES)
    return f"{SCHEME}${salt.hex()}${_mac(salt, secret)}"


def matches(secret: str, stored: str) -> bool:
    """Whether ``secret`` is the one ``stored`` (a ``digest``) was made from."""
    found = _DIGEST.match(stored)
    if found is None or not secret:
        return False
    return hmac.compare_digest(_mac(bytes.fromhex(found.group(1)), secret), found.group(2))


def check(stored: str, field: str) -> str:
    """``stored`` if it is a digest as ``digest`` makes them; INVALID_ARGUMENT otherwise (a raw
    secret must never reach a record). The value is not repeated: it may be that secret."""
    if not isinstance(stored, str) or _DIGEST.match(stored) is None:
        raise InvalidArgument(
            f"{field} must be a digest made by vmsandbox.sandbox.credential.digest "
            f"({SCHEME}$<salt>$<mac>), not a secret itself",
            details={"field": field},
        )
    return stored


def _mac(salt: bytes, secret: str) -> str:
    return hmac.new(salt, secret.encode(), hashlib.sha256).hexdigest()
