"""How a node signs in to NATS, and what its config must say for that to be safe.

Sans-IO: it reads a :class:`~sage.config.FleetConfig`, never a file or a socket (the
async shell that reads the secrets and connects is sage.fleet.member).

Every node of a fleet acts for principals on the word of the others (docs/security.md,
"Fleet trust model"), and the NATS servers' per-user permissions are what keep one
node from writing another's keys.  A node that signs in with no credentials at all
only works on a server without authorization, where any client of the server may act
as any node.  So :func:`auth_method` refuses such a ``[fleet]`` (:class:`FleetNoAuth`,
naming the settings that fix it) unless its operator wrote ``insecure_no_auth = true``,
for a trial on one machine; then every start logs ``fleet.insecure_no_auth`` and
``astrid doctor`` shows a failing line.  Credentials *and* the flag are refused when
the config is read (sage/config.py): a leftover flag would let a later edit that drops
the credentials start without any, silently.

:func:`plaintext_urls` names the servers a node would reach without TLS over a network
(not loopback): what ``astrid doctor`` fails on, since a password or a JWT would cross
it in clear.
"""

from __future__ import annotations

import enum
import ipaddress
from urllib.parse import urlsplit

from sage.config import FleetConfig
from sage.errors import FleetNoAuth

__all__ = ("AuthMethod", "auth_method", "is_loopback", "plaintext_urls", "tls_on")


class AuthMethod(enum.Enum):
    """How the node signs in: the ``[fleet]`` setting that says so is the value."""

    PASSWORD = "password_file"
    NKEY = "nkey_seed"
    CREDS = "creds"
    NONE = "insecure_no_auth"
    """No credentials, as its operator asked: a server without authorization."""


def auth_method(config: FleetConfig) -> AuthMethod:
    """How ``config``'s node signs in; :class:`FleetNoAuth` when it names no credentials
    and does not say ``insecure_no_auth = true``."""
    if config.password_file:
        return AuthMethod.PASSWORD
    if config.nkey_seed:
        return AuthMethod.NKEY
    if config.creds:
        return AuthMethod.CREDS
    if config.insecure_no_auth:
        return AuthMethod.NONE
    raise FleetNoAuth(
        "fleet: no credentials: [fleet] names none of password_file, nkey_seed, creds, so"
        f" node {config.node!r} would sign in to NATS as nobody (on a server without"
        " authorization any client may act as any node); give the node its own NATS user:"
        ' password_file = "/etc/sage/fleet.password" (0600; `astrid fleet permissions'
        f" --node {config.node}` prints the server's entry), or nkey_seed or creds; for a"
        " trial on one machine only, write insecure_no_auth = true in [fleet]"
    )


def tls_on(config: FleetConfig) -> bool:
    """Whether the node connects with TLS: a CA or a client certificate, or a ``tls://``
    URL (then every connection wants it)."""
    return bool(config.ca or config.cert) or any(url.startswith("tls://") for url in config.urls)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a URL's host name or IP address) is this machine's loopback."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def plaintext_urls(config: FleetConfig) -> list[str]:
    """The URLs of ``config`` a node would reach without TLS over a network: every one off
    loopback when TLS is off (empty when it is on)."""
    if tls_on(config):
        return []
    return [url for url in config.urls if not is_loopback(urlsplit(url).hostname or "")]
