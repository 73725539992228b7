"""Run ids, run manifests and x-redact masking.

``runs/<run_id>/run_manifest.json`` per call (cache hits included), with
``artifacts/`` next to it for the sandbox's stdout spill.  Inputs go in with
every ``x-redact: true`` property (nested objects and array items too)
replaced by ``"<redacted>"``.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import msgspec

from sage.forge.registry import private_dir, write_replace

__all__ = ("REDACTED", "RunStore", "mask_input", "new_run_id")

REDACTED = "<redacted>"
RUN_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "_" + os.urandom(4).hex()


def mask_input(schema: Any, value: Any) -> Any:
    """``value`` with the schema's ``x-redact: true`` fields replaced."""
    if not isinstance(schema, dict):
        return value
    if schema.get("x-redact") is True:
        return REDACTED
    if isinstance(value, dict):
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        extra = schema.get("additionalProperties")
        return {
            k: mask_input(props.get(k, extra if isinstance(extra, dict) else None), v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        items = schema.get("items")
        return [mask_input(items, v) for v in value]
    return value


class RunStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def artifacts(self, run_id: str) -> Path:
        return private_dir(self.directory / run_id / "artifacts")

    def write(self, run_id: str, manifest: dict[str, Any], *, durable: bool = True) -> Path:
        """Write the manifest; ``durable=False`` skips the fsyncs (see ``write_replace``)."""
        path = self.directory / run_id / "run_manifest.json"
        write_replace(path, msgspec.json.format(msgspec.json.encode(manifest)), durable=durable)
        return path

    def read(self, run_id: str) -> dict[str, Any] | None:
        if not RUN_ID_RE.match(run_id):
            return None
        try:
            data = msgspec.json.decode((self.directory / run_id / "run_manifest.json").read_bytes())
        except (OSError, msgspec.DecodeError):
            return None
        return data if isinstance(data, dict) else None

    def recent(self, name: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
        if not self.directory.is_dir():
            return []
        out: list[dict[str, Any]] = []
        for run in sorted(self.directory.iterdir(), reverse=True):
            manifest = self.read(run.name)
            if manifest is None or (name is not None and manifest.get("tool") != name):
                continue
            out.append(
                {
                    k: manifest.get(k)
                    for k in (
                        "run_id",
                        "tool",
                        "scope",
                        "principal_id",
                        "session_id",
                        "ok",
                        "duration_ms",
                        "cache",
                    )
                }
            )
            if len(out) >= limit:
                break
        return out
