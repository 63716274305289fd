"""The fleet's unit tests' shared pieces: a key-value store over a dictionary in place of
Ray's control store (records.py's ``Store``)."""

from __future__ import annotations

import pytest


class DictStore:
    """A Store over a dictionary."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def put(self, key: str, value: bytes, *, overwrite: bool) -> bool:
        if not overwrite and key in self.data:
            return False
        self.data[key] = value
        return True

    def delete(self, key: str) -> None:
        self.data.pop(key, None)

    def keys(self, prefix: str) -> list[str]:
        return [k for k in self.data if k.startswith(prefix)]

    def scan(self, prefix: str) -> dict[str, bytes]:
        return {k: v for k, v in self.data.items() if k.startswith(prefix)}


@pytest.fixture
def store() -> DictStore:
    return DictStore()
