"""The libvirt connection, and libvirt's errors as vmsandbox's error codes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import libvirt

from vmsandbox.errors import FailedPrecondition, Internal, NotFound, Unavailable

# libvirt prints every error to stderr unless a handler is registered; we raise them instead.
libvirt.registerErrorHandler(lambda _ctx, _err: None, None)

_UNAVAILABLE_CODES = {
    libvirt.VIR_ERR_NO_CONNECT,
    libvirt.VIR_ERR_INVALID_CONN,
    libvirt.VIR_ERR_SYSTEM_ERROR,
    libvirt.VIR_ERR_RPC,
    libvirt.VIR_ERR_AUTH_FAILED,
    libvirt.VIR_ERR_OPERATION_TIMEOUT,
}


def open_connection(uri: str) -> libvirt.virConnect:
    try:
        return libvirt.open(uri)
    except libvirt.libvirtError as exc:
        raise Unavailable(f"cannot connect to libvirt at {uri}: {exc.get_error_message()}") from exc


def is_alive(conn: libvirt.virConnect | None) -> bool:
    if conn is None:
        return False
    try:
        return bool(conn.isAlive())
    except libvirt.libvirtError:
        return False


def translate(exc: libvirt.libvirtError, doing: str) -> Exception:
    """Map a libvirt error to the exception a caller should see."""
    code = exc.get_error_code()
    message = exc.get_error_message() or str(exc)
    if code == libvirt.VIR_ERR_NO_DOMAIN:
        return NotFound(f"{doing}: {message}")
    if code in _UNAVAILABLE_CODES:
        return Unavailable(f"{doing}: libvirt is unavailable: {message}")
    if code in (
        libvirt.VIR_ERR_CONFIG_UNSUPPORTED,
        libvirt.VIR_ERR_OPERATION_INVALID,
        libvirt.VIR_ERR_ARGUMENT_UNSUPPORTED,
        libvirt.VIR_ERR_OPERATION_FAILED,
        libvirt.VIR_ERR_INTERNAL_ERROR,
        libvirt.VIR_ERR_XML_ERROR,
        libvirt.VIR_ERR_NO_SUPPORT,
    ):
        return FailedPrecondition(f"{doing}: libvirt refused: {message}")
    return Internal(f"{doing}: {message}")


@contextmanager
def libvirt_errors(doing: str) -> Iterator[None]:
    """Re-raise libvirt errors inside the block as vmsandbox errors."""
    try:
        yield
    except libvirt.libvirtError as exc:
        raise translate(exc, doing) from exc
