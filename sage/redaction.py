"""What counts as a secret by its name, and how it is hidden: one rule for logs and audit.

A key names a secret when one of its words (split at ``_ - . space`` and
camelCase) is token, secret, password, passwd, authorization, credential(s),
or the pair api+key / private+key (also joined: apikey, privatekey,
accesstoken, authtoken).  So ``hook_token``, ``ANTHROPIC_API_KEY`` and
``privateKey`` are hidden, ``input_tokens`` is not.
"""

from __future__ import annotations

import functools
import itertools
import re
from typing import Any, Final

__all__ = ("REDACTED", "is_secret_key", "redact")

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
