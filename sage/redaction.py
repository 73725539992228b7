"""Hiding secrets: by their name (logs, audit) and by their value (what a forged tool printed).

The one place both rules and their one marker, :data:`REDACTED`, live.

**By name** (:func:`is_secret_key`, :func:`redact`): a key names a secret when
one of its words (split at ``_ - . space`` and camelCase) is token, secret,
password, passwd, authorization, credential(s), or the pair api+key /
private+key (also joined: apikey, privatekey, accesstoken, authtoken).  So
``hook_token``, ``ANTHROPIC_API_KEY`` and ``privateKey`` are hidden,
``input_tokens`` is not.

**By value** (:func:`redact_json`, :func:`redact_text`, pure): the runner injects vault secrets into a tool's environment; a buggy (or
nosy) tool may print them.  Before anything reaches Claude, the audit log
or a run manifest, :func:`redact_json` walks the parsed stdout (dict keys
and string leaves, depth-capped) and :func:`redact_text` cleans stderr and
any other text.  A value is found in each of its :func:`secret_forms`: the
raw value, its base64 (standard and urlsafe, with and without padding) and
its hex (lower and upper case).

"Split across lines": a tool that wraps the value (``base64`` wraps at 76
columns, ``textwrap``, a JSON string holding ``"sk-a\\nbc"``) must not get
it past us.  Matching therefore ignores whitespace *inside* a form: every
form is searched as a regular expression that allows any run of whitespace
(spaces, tabs, CR, LF) between two of its characters, so ``sk-ab\\ncd``
matches the secret ``sk-abcd`` and the whole stretch, line break included,
becomes ``<redacted>``.  A secret split across two *different* JSON leaves
(``["sk-ab", "cd"]``) is out of reach of a leaf-wise redaction; to catch it
:func:`redact_json` also looks at the concatenation of all string leaves
and, when a secret shows up only there, redacts every leaf that holds a
piece of it.

Short secrets are a footgun: a 3-character value would redact every ``abc``
in every output (and its base64 forms are even shorter to collide).  Values
shorter than :data:`MIN_SECRET_LENGTH` (8) are still redacted raw, but not
in their encoded forms; the vault should refuse to store them at all
(recommendation to the vault: ``len(value) >= 8``).  Empty values are ignored.
"""

from __future__ import annotations

import base64
import binascii
import functools
import itertools
import re
from collections.abc import Iterable, Sequence
from typing import Any, Final

__all__ = (
    "MIN_SECRET_LENGTH",
    "REDACTED",
    "is_secret_key",
    "redact",
    "redact_json",
    "redact_text",
    "secret_forms",
)

REDACTED: Final = "<redacted>"

_SECRET_WORDS: Final = frozenset(
    {"token", "secret", "password", "passwd", "authorization", "credential", "credentials"}
)
_SECRET_JOINED: Final = frozenset({"apikey", "privatekey", "accesstoken", "authtoken"})
_SECRET_PAIRS: Final = frozenset({("api", "key"), ("private", "key")})
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_SPLIT = re.compile(r"[\s_.\-]+")


@functools.lru_cache(maxsize=4096)
def is_secret_key(key: str) -> bool:
    """Whether ``key`` names a secret (see the module docstring)."""
    words = [w.lower() for w in _SPLIT.split(_CAMEL.sub("_", key)) if w]
    if any(w in _SECRET_WORDS or w in _SECRET_JOINED for w in words):
        return True
    return any(pair in _SECRET_PAIRS for pair in itertools.pairwise(words))


def redact(value: Any) -> Any:
    """A copy of JSON builtins ``value`` with the values of secret-named keys replaced."""
    if isinstance(value, dict):
        return {
            k: (REDACTED if isinstance(k, str) and is_secret_key(k) else redact(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


# By value: what a forged tool printed.
MIN_SECRET_LENGTH = 8
"""Below this, only the raw value is redacted (encoded forms would collide too often)."""

_WS = r"\s*"


def secret_forms(value: str) -> list[str]:
    """The raw value, its base64 (std/urlsafe, padded/unpadded) and hex (lower/upper) forms."""
    if not value:
        return []
    forms = [value]
    if len(value) >= MIN_SECRET_LENGTH:
        raw = value.encode()
        for encoded in (base64.b64encode(raw), base64.urlsafe_b64encode(raw)):
            text = encoded.decode("ascii")
            forms += [text, text.rstrip("=")]
        hexed = binascii.hexlify(raw).decode("ascii")
        forms += [hexed, hexed.upper()]
    unique: list[str] = []
    for form in forms:
        if form and form not in unique:
            unique.append(form)
    # longest first, so a padded form wins over its unpadded prefix
    unique.sort(key=len, reverse=True)
    return unique


@functools.lru_cache(maxsize=256)
def _pattern(secrets: tuple[str, ...]) -> re.Pattern[str] | None:
    forms: list[str] = []
    for secret in secrets:
        for form in secret_forms(secret):
            if form not in forms:
                forms.append(form)
    if not forms:
        return None
    forms.sort(key=len, reverse=True)
    parts = [_WS.join(re.escape(ch) for ch in form) for form in forms]
    return re.compile("|".join(parts))


def _key(secrets: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted({s for s in secrets if s}))


def redact_text(text: str, secrets: Sequence[str]) -> str:
    """``text`` with every form of every secret (whitespace inside allowed) replaced."""
    pattern = _pattern(_key(secrets))
    if pattern is None or not text:
        return text
    return pattern.sub(REDACTED, text)


def redact_json(value: Any, secrets: Sequence[str], depth: int = 32) -> Any:
    """A copy of ``value`` with secrets out of every string leaf and dict key.

    A leaf holding a secret is replaced by ``<redacted>`` whole (the design's
    rule: the tool's structure stays, the leaf does not); so is a key.  Past
    ``depth`` levels the rest is replaced by ``<redacted>`` (a structure too
    deep to check is not passed on).  A secret spread over several leaves is
    caught on the concatenation of all leaves (see the module docstring).
    """
    key = _key(secrets)
    pattern = _pattern(key)
    if pattern is None:
        return value
    result = _walk(value, pattern, depth)
    leaves: list[str] = []
    _leaves(result, leaves, depth)
    joined = "".join(leaves)
    if not pattern.search(joined):
        return result
    # a secret across leaves: redact every leaf that overlaps a match
    spans = [m.span() for m in pattern.finditer(joined)]
    hit: set[int] = set()
    offset = 0
    for index, leaf in enumerate(leaves):
        start, end = offset, offset + len(leaf)
        if any(s < end and e > start for s, e in spans):
            hit.add(index)
        offset = end
    counter = [0]
    return _replace(result, hit, counter, depth)


def _walk(value: Any, pattern: re.Pattern[str], depth: int) -> Any:
    if isinstance(value, str):
        return REDACTED if pattern.search(value) else value
    if depth <= 0:
        return REDACTED if isinstance(value, dict | list | tuple) else value
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for k, v in value.items():
            new_key = k
            if isinstance(k, str) and pattern.search(k):
                new_key = REDACTED
                while new_key in out or new_key in value:
                    new_key += "_"  # keys must stay distinct
            out[new_key] = _walk(v, pattern, depth - 1)
        return out
    if isinstance(value, list | tuple):
        return [_walk(item, pattern, depth - 1) for item in value]
    return value


def _leaves(value: Any, out: list[str], depth: int) -> None:
    if isinstance(value, str):
        out.append(value)
    elif depth > 0 and isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                out.append(k)
            _leaves(v, out, depth - 1)
    elif depth > 0 and isinstance(value, list):
        for item in value:
            _leaves(item, out, depth - 1)


def _replace(value: Any, hit: set[int], counter: list[int], depth: int) -> Any:
    if isinstance(value, str):
        index = counter[0]
        counter[0] += 1
        return REDACTED if index in hit else value
    if depth > 0 and isinstance(value, dict):
        out: dict[Any, Any] = {}
        for k, v in value.items():
            new_key = k
            if isinstance(k, str):
                index = counter[0]
                counter[0] += 1
                if index in hit:
                    new_key = f"{REDACTED}{index}"  # keys must stay distinct
            out[new_key] = _replace(v, hit, counter, depth - 1)
        return out
    if depth > 0 and isinstance(value, list):
        return [_replace(item, hit, counter, depth - 1) for item in value]
    return value
