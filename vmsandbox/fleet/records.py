"""The fleet's durable records, in Ray's control store (the GCS's internal key-value store, in
the fleet's namespace): they outlive every fleet process and every host.

- A *placement record* per sandbox (``model.Record``, key ``sandbox/<gateway>/<id>``): the
  host that holds the sandbox or may hold it. A create writes it before it asks a host and
  clears the host only on that host's own refusal; a delete drops it once the host answered.
  So "this sandbox does not exist" is said only where no record is, or where the record's host
  answered without it; a lost host's sandboxes stay known to every fleet process.
- A *host binding* per host name (``model.Binding``, key ``host/<name>``): the digest of the
  host key of the machine that first joined under the name; another machine is refused the
  name until an operator releases it (``vmsandbox fleet release``).

The store is Ray's internal KV (``RayKV``); the tests give ``Records`` a dictionary instead.
Writing a key only where none is (``overwrite=False``) is atomic in the GCS: two creates of one
id, or two machines joining under one name, cannot both win.
"""

from __future__ import annotations

from typing import Protocol

from vmsandbox.errors import FailedPrecondition
from vmsandbox.fleet import model
from vmsandbox.fleet.model import Binding, Record

SANDBOX_KEY = "sandbox/"
HOST_KEY = "host/"


class Store(Protocol):
    """A key-value store whose ``put`` without ``overwrite`` is atomic."""

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes, *, overwrite: bool) -> bool:
        """Write ``value``; False when ``overwrite`` is off and the key has a value."""

    def delete(self, key: str) -> None: ...

    def keys(self, prefix: str) -> list[str]:
        """Every key that starts with ``prefix``."""

    def scan(self, prefix: str) -> dict[str, bytes]:
        """Every key that starts with ``prefix``, with its value."""


class RayKV:
    """Ray's internal KV in the GCS, in the fleet's namespace (the process is connected)."""

    def get(self, key: str) -> bytes | None:
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_get(key, namespace=model.NAMESPACE)

    def put(self, key: str, value: bytes, *, overwrite: bool) -> bool:
        from ray.experimental import internal_kv

        existed = internal_kv._internal_kv_put(
            key, value, overwrite=overwrite, namespace=model.NAMESPACE
        )
        return overwrite or not existed

    def delete(self, key: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(key, namespace=model.NAMESPACE)

    def keys(self, prefix: str) -> list[str]:
        from ray.experimental import internal_kv

        client = internal_kv.internal_kv_get_gcs_client()
        found = client.internal_kv_keys(prefix.encode(), namespace=model.NAMESPACE.encode())
        return [key.decode() for key in found]

    def scan(self, prefix: str) -> dict[str, bytes]:
        from ray.experimental import internal_kv

        keys = [key.encode() for key in self.keys(prefix)]
        if not keys:
            return {}
        client = internal_kv.internal_kv_get_gcs_client()
        values = client.internal_kv_multi_get(keys, namespace=model.NAMESPACE.encode())
        return {key.decode(): value for key, value in values.items()}


def _key(gateway: str, sandbox_id: str) -> str:
    return f"{SANDBOX_KEY}{gateway}/{sandbox_id}"


class Records:
    """The placement records and host bindings in ``store`` (default: Ray's)."""

    def __init__(self, store: Store | None = None) -> None:
        self.store: Store = store if store is not None else RayKV()

    # -- placement records ------------------------------------------------------------------

    def get(self, gateway: str, sandbox_id: str) -> Record | None:
        data = self.store.get(_key(gateway, sandbox_id))
        return Record.from_json(data) if data else None

    def add(self, record: Record) -> bool:
        """Write ``record`` unless its sandbox has one (False then)."""
        key = _key(record.gateway, record.sandbox_id)
        return self.store.put(key, record.to_json(), overwrite=False)

    def write(self, record: Record) -> None:
        self.store.put(_key(record.gateway, record.sandbox_id), record.to_json(), overwrite=True)

    def drop(self, gateway: str, sandbox_id: str) -> None:
        self.store.delete(_key(gateway, sandbox_id))

    def recorded(self) -> set[tuple[str, str]]:
        """(gateway, sandbox id) of every record, read without their values."""
        found = set()
        for key in self.store.keys(SANDBOX_KEY):
            gateway, _, sandbox_id = key[len(SANDBOX_KEY) :].partition("/")
            found.add((gateway, sandbox_id))
        return found

    def of(self, gateway: str | None = None) -> list[Record]:
        """The records of ``gateway``'s sandboxes (of every gateway's when None)."""
        prefix = SANDBOX_KEY + (f"{gateway}/" if gateway is not None else "")
        return [Record.from_json(data) for data in self.store.scan(prefix).values() if data]

    # -- host bindings ----------------------------------------------------------------------

    def binding(self, host: str) -> Binding | None:
        data = self.store.get(HOST_KEY + host)
        return Binding.from_json(data) if data else None

    def bind(self, host: str, key: str, node_id: str = "") -> Binding:
        """Host name ``host`` for the machine whose host key has digest ``key`` (bound now when
        the name is free; its node id updated when given); FAILED_PRECONDITION when the name
        belongs to another machine."""
        wanted = Binding(host, key, node_id)
        while not self.store.put(HOST_KEY + host, wanted.to_json(), overwrite=False):
            bound = self.binding(host)
            if bound is None:
                continue  # released meanwhile
            if bound.key != key:
                raise FailedPrecondition(
                    f"host name {host} belongs to another machine (another host key), which "
                    "joined under it first: join under another name, or, if that machine is "
                    f"gone for good, release the name with `vmsandbox fleet release {host}`",
                    details={"field": "name", "value": host},
                )
            if node_id and bound.node_id != node_id:
                self.store.put(HOST_KEY + host, wanted.to_json(), overwrite=True)
            return wanted if node_id else bound
        return wanted

    def release(self, host: str) -> list[Record]:
        """Forget host ``host``: its binding, and the records of the sandboxes on it (of every
        gateway), which are returned."""
        gone = [record for record in self.of() if record.host == host]
        for record in gone:
            self.drop(record.gateway, record.sandbox_id)
        self.store.delete(HOST_KEY + host)
        return gone
