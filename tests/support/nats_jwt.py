"""NATS JWTs minted in the test, for servers in operator mode (decentralized auth).

What ``nsc`` does, in small: an operator, its system account and one account
(``SAGE``, JetStream on), each an NKey with a JWT signed by the key above it, and
users of the account with their own JWT and ``.creds`` file.  A NATS JWT is
``base64url(header) . base64url(claims) . base64url(ed25519 signature)``: the
header is ``{"typ":"JWT","alg":"ed25519-nkey"}``, the signature is the issuer's
NKey's over the first two parts, and ``jti`` is the base32 SHA-512/256 of the
claims without it (as the Go jwt library computes it).

:meth:`Operator.server_config` is the part of a server's config that trusts the
operator: ``operator``, ``system_account``, ``resolver: MEMORY`` and
``resolver_preload`` with both accounts' JWTs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from typing import Any

import nkeys

__all__ = ("Operator", "creds_text", "mint", "new_pair")

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
UNLIMITED = -1
JETSTREAM_LIMITS = {
    "mem_storage": UNLIMITED,
    "disk_storage": UNLIMITED,
    "streams": UNLIMITED,
    "consumer": UNLIMITED,
}
"""An account's JetStream limits: any of the two storages not 0 turns JetStream on."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def new_pair(prefix: int) -> nkeys.KeyPair:
    """A fresh NKey pair of a kind (nkeys.PREFIX_BYTE_OPERATOR, _ACCOUNT, _USER)."""
    return nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), prefix)))


def public(pair: nkeys.KeyPair) -> str:
    key: bytes = pair.public_key
    return key.decode()


def seed_of(pair: nkeys.KeyPair) -> str:
    seed: bytes = pair.seed
    return seed.decode()


def mint(
    issuer: nkeys.KeyPair,
    subject: str,
    name: str,
    nats: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> str:
    """A JWT with these claims (and the top-level ``extra``, e.g. ``exp``), signed by
    ``issuer``."""
    claims: dict[str, Any] = {
        **(extra or {}),
        "iat": int(time.time()),
        "iss": public(issuer),
        "name": name,
        "sub": subject,
        "nats": {**nats, "version": 2},
    }
    digest = hashlib.new("sha512_256", json.dumps(claims, sort_keys=True).encode()).digest()
    claims["jti"] = base64.b32encode(digest).rstrip(b"=").decode()
    signed = f"{_b64(json.dumps(HEADER).encode())}.{_b64(json.dumps(claims).encode())}"
    return f"{signed}.{_b64(issuer.sign(signed.encode()))}"


def creds_text(jwt: str, seed: str) -> str:
    """A ``.creds`` file's content, as ``nsc generate creds`` writes it."""
    return (
        f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n\n"
        "*************************************************************\n"
    )


def user_permissions(permissions: dict[str, Any]) -> dict[str, Any]:
    """A server config's user ``permissions`` (as ``astrid fleet permissions`` prints
    them) as a user JWT's claims: ``pub``, ``sub`` and ``resp`` (what ``nsc add user
    --allow-pub ... --deny-pub ... --allow-sub ... --allow-pub-response`` writes)."""
    claims: dict[str, Any] = {}
    for block, key in (("publish", "pub"), ("subscribe", "sub")):
        rules = permissions.get(block) or {}
        claims[key] = {k: list(v) for k, v in rules.items() if k in ("allow", "deny")}
    if permissions.get("allow_responses"):
        claims["resp"] = {"max": 1, "ttl": 0}
    return claims


class Operator:
    """An operator with its system account and a ``SAGE`` account with JetStream."""

    def __init__(self, name: str = "sage-test") -> None:
        self.pair = new_pair(nkeys.PREFIX_BYTE_OPERATOR)
        self.system = new_pair(nkeys.PREFIX_BYTE_ACCOUNT)
        self.account = new_pair(nkeys.PREFIX_BYTE_ACCOUNT)
        limits = {"subs": UNLIMITED, "conn": UNLIMITED, "data": UNLIMITED}
        limits |= {"payload": UNLIMITED, "imports": UNLIMITED, "exports": UNLIMITED}
        limits |= {"wildcards": True, "leaf": UNLIMITED}
        self.jwt = mint(
            self.pair,
            public(self.pair),
            name,
            {"type": "operator", "system_account": public(self.system)},
        )
        self.system_jwt = mint(
            self.pair, public(self.system), "SYS", {"type": "account", "limits": limits}
        )
        self.account_jwt = mint(
            self.pair,
            public(self.account),
            "SAGE",
            {"type": "account", "limits": limits | JETSTREAM_LIMITS},
        )

    def server_config(self) -> dict[str, Any]:
        """The keys of a server config that make it trust this operator's accounts."""
        return {
            "operator": self.jwt,
            "system_account": public(self.system),
            "resolver": "MEMORY",
            "resolver_preload": {
                public(self.system): self.system_jwt,
                public(self.account): self.account_jwt,
            },
        }

    def user_creds(self, name: str, permissions: dict[str, Any] | None = None) -> str:
        """A ``.creds`` file's content for a new user of the SAGE account (any subject
        when ``permissions`` is None; else those, in the server config's shape)."""
        user = new_pair(nkeys.PREFIX_BYTE_USER)
        claims: dict[str, Any] = {"type": "user", "subs": UNLIMITED, "data": UNLIMITED}
        claims["payload"] = UNLIMITED
        claims |= user_permissions(permissions or {})
        jwt = mint(self.account, public(user), name, claims)
        return creds_text(jwt, seed_of(user))
