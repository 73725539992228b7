"""Loopback and metadata deny for Python tools that were given the network.

Placed read-only at ``/forge/site/sitecustomize.py`` inside the sandbox (on
``PYTHONPATH``) only when the persona's policy shares the host network.  On
import as ``sitecustomize`` it patches :class:`socket.socket`'s ``connect``,
``connect_ex``, ``sendto`` and ``sendmsg`` (which ``create_connection``,
``http.client``, ``urllib``, ``ssl`` and ``asyncio`` all go through) to
refuse, with ``PermissionError`` (``EACCES``):

* loopback ``127.0.0.0/8``, ``::1`` and their IPv4-mapped / NAT64 / 6to4
  spellings, the unspecified ``0.0.0.0`` / ``::`` (which reach the host) and
  names that resolve to any of them (``localhost``) - unless the policy opts
  into loopback;
* always: link-local ``169.254.0.0/16`` (AWS/GCP/Azure IMDS at
  169.254.169.254, ECS at 169.254.170.2), ``fe80::/10``, AWS's IPv6 IMDS
  ``fd00:ec2::254`` and Alibaba's ``100.100.100.200``;
* abstract Unix sockets (a shared network namespace shares them: the host's
  D-Bus, X11 ...).

This is a guard against accidents, not a wall: it covers Python only, and
a tool that wants to can go around it (``_socket``, ``ctypes``, a
subprocess run with ``python -I`` or ``curl``).  ``bash`` tools are not
covered at all.  See docs/forge-sandbox.md.

As ``sage.forge.sitecustomize`` (on the host) importing it does nothing: the
patch is installed only when the module is imported as ``sitecustomize``.
The runner rewrites the ``ALLOW_LOOPBACK`` line when the policy opts in.
"""

from __future__ import annotations

import errno
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # ipaddress is imported on the first connect: it costs ~7 ms at start-up
    import ipaddress

    Address = ipaddress.IPv4Address | ipaddress.IPv6Address

ALLOW_LOOPBACK = False

_METADATA = ("100.100.100.200", "fd00:ec2::254")


def _embedded(addr: Address) -> Address:
    """The IPv4 address an IPv6 spelling carries (mapped, NAT64, 6to4), else ``addr``."""
    import ipaddress

    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return addr.ipv4_mapped
        if addr.sixtofour is not None:
            return addr.sixtofour
        if addr in ipaddress.ip_network("64:ff9b::/96"):
            return ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    return addr


def denied_address(host: str, allow_loopback: bool = False) -> bool:
    """Is the literal address ``host`` refused? (Not an address: False.)"""
    import ipaddress

    try:
        addr: Address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    metadata = {ipaddress.ip_address(a) for a in _METADATA}
    for candidate in {addr, _embedded(addr)}:
        if candidate in metadata or candidate.is_link_local:
            return True
        if candidate.is_unspecified:
            return True
        if candidate.is_loopback and not allow_loopback:
            return True
    return False


def denied(address: object, family: int, allow_loopback: bool = False) -> bool:
    """Is a connect/sendto to ``address`` (a socket address of ``family``) refused?"""
    if family == getattr(socket, "AF_UNIX", -1):
        if isinstance(address, bytes):
            return address[:1] == b"\0"
        if isinstance(address, str):
            return address[:1] == "\0"
        return False
    if family not in (socket.AF_INET, socket.AF_INET6):
        return False
    if not isinstance(address, tuple) or not address:
        return False
    host = address[0]
    if isinstance(host, bytes):
        host = host.decode("idna", "replace")
    if not isinstance(host, str):
        return False
    if host == "":
        return True  # "" means INADDR_ANY: the host itself
    import ipaddress

    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, family)
        except OSError:
            return False  # connect will fail to resolve it as well
        return any(denied_address(str(info[4][0]), allow_loopback) for info in infos)
    return denied_address(host, allow_loopback)


def _refuse(address: object) -> PermissionError:
    return PermissionError(
        errno.EACCES,
        f"forge sandbox: connecting to {address!r} (loopback or metadata address) is not allowed",
    )


def install(allow_loopback: bool = False) -> None:
    """Patch :class:`socket.socket` (idempotent)."""
    cls = socket.socket
    if getattr(cls, "_forge_guarded", False):
        return
    connect = cls.connect
    connect_ex = cls.connect_ex
    sendto = cls.sendto
    sendmsg = getattr(cls, "sendmsg", None)

    def guarded_connect(self: socket.socket, address: object) -> None:
        if denied(address, self.family, allow_loopback):
            raise _refuse(address)
        connect(self, address)  # type: ignore[arg-type]

    def guarded_connect_ex(self: socket.socket, address: object) -> int:
        if denied(address, self.family, allow_loopback):
            return errno.EACCES
        return connect_ex(self, address)  # type: ignore[arg-type]

    def guarded_sendto(self: socket.socket, data: bytes, *args: object) -> int:
        address = args[-1] if args else None
        if address is not None and denied(address, self.family, allow_loopback):
            raise _refuse(address)
        return sendto(self, data, *args)  # type: ignore[call-overload,no-any-return]

    setattr(cls, "connect", guarded_connect)  # noqa: B010
    setattr(cls, "connect_ex", guarded_connect_ex)  # noqa: B010
    setattr(cls, "sendto", guarded_sendto)  # noqa: B010
    if sendmsg is not None:

        def guarded_sendmsg(self: socket.socket, buffers: object, *args: object) -> int:
            address = args[2] if len(args) > 2 else None
            if address is not None and denied(address, self.family, allow_loopback):
                raise _refuse(address)
            return sendmsg(self, buffers, *args)  # type: ignore[no-any-return]

        setattr(cls, "sendmsg", guarded_sendmsg)  # noqa: B010
    setattr(cls, "_forge_guarded", True)  # noqa: B010


if __name__ == "sitecustomize":  # pragma: no cover - runs inside the sandbox only
    install(ALLOW_LOOPBACK)
