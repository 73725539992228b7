"""systemd's notify protocol: READY=1, STOPPING=1, WATCHDOG=1, STATUS=...

When ``NOTIFY_SOCKET`` is set, each state is one datagram to that socket (a
path, or an abstract name starting with ``@``).  Without it every call is a
no-op, so the supervisor runs the same under systemd and in a terminal.
"""

from __future__ import annotations

import os
import socket

__all__ = ("Notifier", "watchdog_interval")


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        self.address = "\0" + address[1:] if address.startswith("@") else address
        self._sock: socket.socket | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *states: str) -> bool:
        """Send ``states`` (e.g. "READY=1"); False when disabled or the send failed."""
        if self._sock is None:
            return False
        try:
            self._sock.sendto("\n".join(states).encode(), self.address)
        except OSError:
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval() -> float | None:
    """Half of systemd's watchdog period in seconds, if the watchdog is on for us."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2_000_000
    except ValueError:
        return None
