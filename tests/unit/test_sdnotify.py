"""sd_notify: datagrams to NOTIFY_SOCKET, silent without it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from sage.daemon.sdnotify import Notifier, watchdog_interval


def test_disabled_without_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without NOTIFY_SOCKET nothing is sent and nothing fails."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier()
    assert not notifier.enabled
    assert notifier.notify("READY=1") is False


def test_sends_states_to_path_socket(tmp_path: Path) -> None:
    """READY=1 and STATUS arrive as one datagram on the notify socket."""
    path = str(tmp_path / "notify")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    try:
        notifier = Notifier(path)
        assert notifier.notify("READY=1", "STATUS=ok")
        assert receiver.recv(1024) == b"READY=1\nSTATUS=ok"
        notifier.close()
    finally:
        receiver.close()


def test_abstract_socket_name() -> None:
    """An address starting with @ is an abstract socket name."""
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind("\0sage-test-notify")
    notifier = Notifier("@sage-test-notify")
    try:
        assert notifier.notify("WATCHDOG=1")
        assert receiver.recv(64) == b"WATCHDOG=1"
    finally:
        notifier.close()
        receiver.close()


def test_watchdog_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watchdog is pinged at half of WATCHDOG_USEC, only for our pid."""
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert watchdog_interval() == 5.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    monkeypatch.delenv("WATCHDOG_PID")
    assert watchdog_interval() is None
