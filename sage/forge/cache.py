"""The deterministic-result cache (``meta.deterministic`` tools, ok results only).

Key: sha256 over (tool name, impl sha256, schema fingerprint, sha256 of the
canonical input JSON).  Secrets never enter it (they are not in the input).
An entry ``cache/<key>.json`` holds the already-redacted envelope and the
run id of the call that filled it (the seed).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import msgspec

from sage.files import write_replace
from sage.forge.registry import canonical

__all__ = ("ResultCache", "cache_key")


def cache_key(name: str, impl_sha256: str, schema_fingerprint: str, arguments: Any) -> str:
    input_hash = hashlib.sha256(canonical(arguments)).hexdigest()
    return hashlib.sha256(
        canonical([name, impl_sha256, schema_fingerprint, input_hash])
    ).hexdigest()


class ResultCache:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def get(self, key: str) -> dict[str, Any] | None:
        try:
            entry = msgspec.json.decode((self.directory / f"{key}.json").read_bytes())
        except (OSError, msgspec.DecodeError):
            return None
        if not isinstance(entry, dict) or not isinstance(entry.get("envelope"), dict):
            return None
        return entry

    def put(self, key: str, envelope: dict[str, Any], seed_run_id: str) -> None:
        data = msgspec.json.encode({"envelope": envelope, "seed_run_id": seed_run_id})
        write_replace(self.directory / f"{key}.json", data)
