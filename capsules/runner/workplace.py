"""Where a session works and which model it runs: what a spawn may ask for, checked.

Pure (but for resolving a path): ``astrid sage spawn --cwd DIR --model NAME``
reach the runner as ``cwd`` and ``model``; the principal's config says what
is allowed (``[[principals]] work_roots`` and ``models``).  A refusal is a
:class:`SessionError` whose code the caller sees.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from capsules.runner.errors import SessionError
from sage import config
from sage.config import PrincipalConfig

__all__ = ("MODEL_PATTERN", "chosen_model", "work_folder")

MODEL_PATTERN = re.compile(config.MODEL_PATTERN)
"""A model name: never a flag, never a path, at most 100 characters."""


def work_folder(principal: PrincipalConfig, home: Path, asked: str | None) -> str:
    """The resolved working folder for ``asked``; ``""`` (the home) when none is asked.

    Allowed: the home and each of the principal's ``work_roots``, with every
    folder below them, after symlinks are resolved (a link inside a root that
    points out of it is refused)."""
    if asked is None:
        return ""
    if not asked or "\0" in asked or not os.path.isabs(asked):
        raise SessionError("bad_cwd", f"cwd must be an absolute path, not {asked!r}")
    real = os.path.realpath(asked)
    roots = [os.path.realpath(home), *(os.path.realpath(root) for root in principal.work_roots)]
    if not any(real == root or real.startswith(root.rstrip("/") + "/") for root in roots):
        listed = ", ".join(roots)
        raise SessionError(
            "cwd_not_allowed",
            f"{asked}: principal {principal.name!r} may work only in {listed}"
            " (its home and [[principals]] work_roots)",
        )
    if not os.path.isdir(real):
        raise SessionError("cwd_missing", f"{asked}: no such folder")
    return real


def chosen_model(principal: PrincipalConfig, asked: str | None) -> str:
    """``asked`` when the principal may use it; ``""`` (the configured model) for none."""
    if asked is None:
        return ""
    if not MODEL_PATTERN.match(asked):
        raise SessionError("bad_model", f"{asked[:100]!r} is not a model name")
    allowed = [m for m in (principal.model, *principal.models) if m]
    if asked not in allowed:
        choice = ", ".join(allowed) if allowed else "none but the CLI's default"
        raise SessionError(
            "model_not_allowed",
            f"model {asked!r} is not allowed for principal {principal.name!r}: {choice}"
            " ([[principals]] model and models)",
        )
    return asked
