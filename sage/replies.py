"""The one reply shape on the bus, and its parser.

Every request topic answers with a JSON object:

- success: ``{"ok": true, ...fields}``;
- failure: ``{"ok": false, "error": CODE, "message": TEXT, ...fields}``, where
  ``CODE`` is a stable snake_case reason (a :class:`~sage.errors.SageError`'s
  ``code``) and ``TEXT`` one line for a person.

Capsules build replies with :func:`ok`, :func:`error` and :func:`from_error`;
the CLI and other clients read them with :func:`parse`, which returns the
fields of a success and raises :class:`ReplyError` (carrying the reply's code)
for a failure.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sage.errors import ProtocolError, SageError

__all__ = ("ReplyError", "error", "from_error", "ok", "parse")


class ReplyError(SageError):
    """A request was answered with ``{"ok": false}``; ``code`` is the reply's ``error``."""

    code = "error"

    def __init__(self, code: str, message: str, reply: dict[str, Any]) -> None:
        super().__init__(f"{code}: {message}" if message else code, code=code)
        self.reply = reply


def ok(**fields: Any) -> dict[str, Any]:
    """A success reply carrying ``fields``."""
    return {"ok": True, **fields}


def error(code: str, message: str, **fields: Any) -> dict[str, Any]:
    """A failure reply: ``code`` for programs, ``message`` for people."""
    return {"ok": False, "error": code, "message": message, **fields}


def from_error(exc: SageError, **fields: Any) -> dict[str, Any]:
    """The failure reply for a sage error: its ``code`` and its message."""
    return error(exc.code, str(exc), **fields)


def parse(payload: bytes | str | dict[str, Any]) -> dict[str, Any]:
    """The fields of a success reply; :class:`ReplyError` for a failure.

    A payload that is not a JSON object with a boolean ``ok`` is a
    :class:`~sage.errors.ProtocolError`: the responder broke the contract.
    """
    if isinstance(payload, dict):
        data: Any = payload
    else:
        try:
            data = msgspec.json.decode(payload)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"reply is not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("ok"), bool):
        raise ProtocolError("reply is not an object with a boolean 'ok'")
    if data["ok"]:
        return data
    code = data.get("error")
    message = data.get("message")
    raise ReplyError(
        code if isinstance(code, str) and code else "error",
        message if isinstance(message, str) else "",
        data,
    )
