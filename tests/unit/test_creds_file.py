"""sage.fleet.creds: a `.creds` file read and checked, without a server; every refusal
names the file and what is wrong, never the content."""

from __future__ import annotations

import time

import nkeys
import pytest

from sage.fleet.creds import CredsInvalid, UserCreds, parse_creds
from tests.support.nats_jwt import Operator, creds_text, mint, new_pair, public, seed_of

WHERE = "/etc/sage/a.creds"


def parts(text: str) -> tuple[str, str]:
    jwt, seed = (line for line in text.splitlines() if line.startswith(("eyJ", "SU")))
    return jwt, seed


def refusal(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    with pytest.raises(CredsInvalid) as info:
        parse_creds(raw, WHERE, now=time.time())
    assert info.value.code == "fleet_credentials_invalid"
    message = str(info.value)
    assert message.startswith(f"fleet: {WHERE}: "), message
    return message.removeprefix(f"fleet: {WHERE}: ")


def test_a_good_creds_file_gives_its_jwt_seed_and_user() -> None:
    operator = Operator()
    text = operator.user_creds("a")
    jwt, seed = parts(text)
    creds = parse_creds(text.encode(), WHERE, now=time.time())
    assert isinstance(creds, UserCreds)
    assert (creds.jwt, creds.seed, creds.name, creds.expires) == (jwt, seed, "a", None)
    assert creds.user == public(nkeys.from_seed(bytearray(seed.encode())))
    assert creds.account == public(operator.account)
    assert seed not in repr(creds)


def test_crlf_line_ends_are_read_too() -> None:
    text = Operator().user_creds("a")
    assert parse_creds(text.replace("\n", "\r\n").encode(), WHERE, now=time.time()).name == "a"


@pytest.mark.parametrize(
    ("mangle", "why"),
    [
        (lambda t, j, s: "", "not a NATS user credentials file (no NATS USER JWT and USER NKEY"),
        (lambda t, j, s: s + "\n", "(no NATS USER JWT and USER NKEY SEED block)"),
        (lambda t, j, s: t.split("****")[0], "(no USER NKEY SEED block)"),
        (lambda t, j, s: t.replace(j, "eyJsecret7781"), "malformed: not three base64url parts"),
        (
            lambda t, j, s: t.replace(j, "eyJsecret7781.eyJzz.abc"),
            "malformed: its parts are not base64url JSON",
        ),
        (lambda t, j, s: t.replace(s, "SUsecret7781"), "block is not an NKey seed"),
        (
            lambda t, j, s: t.replace(s, seed_of(new_pair(nkeys.PREFIX_BYTE_USER))),
            "the NKey seed is not the key of the JWT's user",
        ),
        (
            lambda t, j, s: t.replace(j, _account_jwt()),
            "the JWT is not a user's (nats.type user, subject U...)",
        ),
        (
            lambda t, j, s: t.replace(j, _user_jwt_by_operator(s)),
            "the user JWT is not signed by an account (issuer A...)",
        ),
        (
            lambda t, j, s: t.replace(j, _user_jwt(s, exp=int(time.time()) - 5)),
            "the user JWT expired",
        ),
        (
            lambda t, j, s: t.replace(j, _user_jwt(s, exp="soon")),
            "the user JWT's exp is not a number",
        ),
    ],
)
def test_each_malformed_file_is_refused_saying_why_and_never_its_content(
    mangle: object, why: str
) -> None:
    text = Operator().user_creds("a")
    jwt, seed = parts(text)
    assert callable(mangle)
    message = refusal(mangle(text, jwt, seed))
    assert why in message, message
    for secret in (seed, jwt, "secret7781"):
        assert secret[:12] not in message


def test_a_file_of_binary_garbage_is_refused() -> None:
    assert "not a NATS user credentials file" in refusal(b"\xff\x00\xfe" * 50)


def _account_jwt() -> str:
    operator, account = new_pair(nkeys.PREFIX_BYTE_OPERATOR), new_pair(nkeys.PREFIX_BYTE_ACCOUNT)
    return mint(operator, public(account), "acc", {"type": "account"})


def _user_jwt_by_operator(seed: str) -> str:
    user = nkeys.from_seed(bytearray(seed.encode()))
    return mint(new_pair(nkeys.PREFIX_BYTE_OPERATOR), public(user), "a", {"type": "user"})


def _user_jwt(seed: str, **claims: object) -> str:
    user = nkeys.from_seed(bytearray(seed.encode()))
    account = new_pair(nkeys.PREFIX_BYTE_ACCOUNT)
    return mint(account, public(user), "a", {"type": "user"}, dict(claims))


def test_creds_text_round_trips() -> None:
    pair = new_pair(nkeys.PREFIX_BYTE_USER)
    jwt = mint(new_pair(nkeys.PREFIX_BYTE_ACCOUNT), public(pair), "u", {"type": "user"})
    creds = parse_creds(creds_text(jwt, seed_of(pair)).encode(), WHERE, now=time.time())
    assert creds.jwt == jwt
