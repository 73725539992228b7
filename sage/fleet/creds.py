"""A NATS user credentials file (``.creds``): the user JWT and its NKey seed, checked.

The sans-IO half of ``[fleet] creds`` (the async shell is sage.fleet.member).  A
``.creds`` file, as ``nsc generate creds`` writes it, holds two armoured blocks::

    -----BEGIN NATS USER JWT-----
    eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.eyJ...
    ------END NATS USER JWT------
    ...
    -----BEGIN USER NKEY SEED-----
    SUA...
    ------END USER NKEY SEED------

:func:`parse_creds` finds both, and checks what the node can check alone: the
JWT is three base64url parts whose header is an ed25519-nkey JWT and whose claims
are a user's (``nats.type`` ``user``, a ``U...`` subject, an ``A...`` issuer), it
has not expired, and the seed is a user's NKey seed whose public key is the JWT's
subject.  Whether the operator and its account trust the JWT only the NATS
servers know: they refuse a JWT they do not trust (``fleet_auth_failed``).

Nothing of the file's content is ever put in an error: the JWT is no secret, but
the file also holds the seed, and a mangled file may hold anything.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass, field
from typing import Any

from sage.errors import SageError

__all__ = ("CredsInvalid", "UserCreds", "parse_creds")

_BLOCK = r"-{3,}BEGIN WHAT-{3,}[ \t]*\r?\n[ \t]*([^\s]+)[ \t]*\r?\n[ \t]*-{3,}END WHAT-{3,}"
_JWT = re.compile(_BLOCK.replace("WHAT", "NATS USER JWT"))
_SEED = re.compile(_BLOCK.replace("WHAT", "USER NKEY SEED"))
_JWT_SHAPE = re.compile(r"^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\Z")


class CredsInvalid(SageError):
    """A ``[fleet] creds`` file that is no usable NATS user credentials file."""

    code = "fleet_credentials_invalid"


@dataclass(frozen=True)
class UserCreds:
    """What a ``.creds`` file holds, checked.  ``seed`` is secret: never log it."""

    jwt: str
    seed: str = field(repr=False)
    user: str
    """The user's public key (``U...``), the JWT's subject."""
    account: str
    """The account that signed the JWT (``A...``)."""
    name: str
    expires: int | None
    """Unix time after which the servers refuse the JWT; None: it does not expire."""


def _b64url(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def _claims(jwt: str) -> dict[str, Any]:
    """The JWT's claims, if its shape and header are those of a NATS JWT (else ValueError)."""
    if not _JWT_SHAPE.match(jwt):
        raise ValueError("not three base64url parts")
    header_part, claims_part, _ = jwt.split(".")
    try:
        header = json.loads(_b64url(header_part))
        claims = json.loads(_b64url(claims_part))
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise ValueError("its parts are not base64url JSON") from None
    if not isinstance(header, dict) or str(header.get("typ", "")).upper() != "JWT":
        raise ValueError("its header is not a JWT's")
    if header.get("alg") not in ("ed25519-nkey", "ed25519"):
        raise ValueError("it is not signed with an NKey (alg ed25519-nkey)")
    if not isinstance(claims, dict):
        raise ValueError("its claims are not an object")
    return claims


def parse_creds(data: bytes, where: str, *, now: float) -> UserCreds:
    """The credentials in ``data`` (the content of the file ``where``), checked;
    :class:`CredsInvalid` naming ``where`` and what is wrong, never the content."""
    import nkeys

    def invalid(why: str) -> CredsInvalid:
        return CredsInvalid(f"fleet: {where}: {why}")

    text = data.decode("utf-8", errors="replace")
    jwt_match = _JWT.search(text)
    seed_match = _SEED.search(text)
    if jwt_match is None or seed_match is None:
        missing = " and ".join(
            what
            for what, match in (("NATS USER JWT", jwt_match), ("USER NKEY SEED", seed_match))
            if match is None
        )
        raise invalid(f"not a NATS user credentials file (no {missing} block)")
    jwt, seed = jwt_match.group(1), seed_match.group(1)
    try:
        claims = _claims(jwt)
    except ValueError as exc:
        raise invalid(f"the user JWT is malformed: {exc}") from None
    nats_claims = claims.get("nats")
    kind = nats_claims.get("type") if isinstance(nats_claims, dict) else None
    subject, issuer = claims.get("sub"), claims.get("iss")
    if kind != "user" or not isinstance(subject, str) or not subject.startswith("U"):
        raise invalid("the JWT is not a user's (nats.type user, subject U...)")
    if not isinstance(issuer, str) or not issuer.startswith("A"):
        raise invalid("the user JWT is not signed by an account (issuer A...)")
    expires = claims.get("exp")
    if expires is not None and (not isinstance(expires, int) or isinstance(expires, bool)):
        raise invalid("the user JWT's exp is not a number")
    if expires and expires <= now:
        raise invalid(f"the user JWT expired (exp {expires}); make new credentials")
    try:
        pair = nkeys.from_seed(bytearray(seed.encode()))
        public = pair.public_key.decode()
        pair.wipe()
    except Exception:  # nkeys raises its own errors, and binascii's, for a bad seed
        raise invalid("the USER NKEY SEED block is not an NKey seed") from None
    if public != subject:
        raise invalid("the NKey seed is not the key of the JWT's user (its subject)")
    name = claims.get("name")
    return UserCreds(
        jwt=jwt,
        seed=seed,
        user=subject,
        account=issuer,
        name=name if isinstance(name, str) else "",
        expires=expires or None,
    )
