"""A byte stream over a connected Unix stream socket, safe to cancel at any moment.

anyio's own Unix socket stream (asyncio backend, up to at least 4.16) waits
for a socket with ``loop.add_reader(fd, future.set_result, None)``.  When the
waiting task is cancelled in the same loop iteration in which the socket
turns ready (a connection cut off as a slow consumer while its peer writes,
say), asyncio then calls ``set_result`` on a cancelled future, and its
exception handler prints an ``InvalidStateError`` traceback: 191 of them in
the supervisor's JSON log under fuzzing.  :class:`UnixStream` does the same
work with ``anyio.wait_readable`` / ``anyio.wait_writable``, whose callbacks
check the future first.  :func:`connect_unix` and :func:`accept` are the two
ways to get one besides wrapping a socket.
"""

from __future__ import annotations

import errno
import os
import socket

import anyio
import anyio.abc
import anyio.lowlevel

__all__ = ("UnixStream", "accept", "connect_unix")


class UnixStream(anyio.abc.SocketStream):
    """A connected stream socket (made non-blocking); closing the stream closes it."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._closed = False

    @property
    def _raw_socket(self) -> socket.socket:
        return self._sock

    async def receive(self, max_bytes: int = 65536) -> bytes:
        await anyio.lowlevel.checkpoint()  # a peer that always has data never starves the loop
        while True:
            if self._closed:
                raise anyio.ClosedResourceError
            try:
                data = self._sock.recv(max_bytes)
            except BlockingIOError:
                await anyio.wait_readable(self._sock)
                continue
            except OSError as exc:
                if self._closed:
                    raise anyio.ClosedResourceError from None
                raise anyio.BrokenResourceError from exc
            if not data:
                raise anyio.EndOfStream
            return data

    async def send(self, item: bytes) -> None:
        await anyio.lowlevel.checkpoint()
        view = memoryview(item)
        while view:
            if self._closed:
                raise anyio.ClosedResourceError
            try:
                sent = self._sock.send(view)
            except BlockingIOError:
                await anyio.wait_writable(self._sock)
                continue
            except OSError as exc:
                if self._closed:
                    raise anyio.ClosedResourceError from None
                raise anyio.BrokenResourceError from exc
            view = view[sent:]

    async def send_eof(self) -> None:
        self._sock.shutdown(socket.SHUT_WR)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            anyio.notify_closing(self._sock)  # a task waiting on it gets ClosedResourceError
            self._sock.close()
        await anyio.lowlevel.checkpoint()


async def connect_unix(path: str | os.PathLike[str]) -> UnixStream:
    """Connect to the Unix stream socket at ``path`` (OSError as ``socket.connect`` raises it)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        try:
            sock.connect(os.fspath(path))
        except BlockingIOError:  # the listener's backlog is full: wait for room
            await anyio.wait_writable(sock)
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                raise OSError(code, os.strerror(code), os.fspath(path)) from None
    except BaseException:
        sock.close()
        raise
    return UnixStream(sock)


async def accept(listener: socket.socket) -> socket.socket:
    """The next connection on a non-blocking listening socket."""
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            await anyio.wait_readable(listener)
            continue
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                await anyio.sleep(0.1)  # out of descriptors: let some close, then try again
                continue
            if exc.errno == errno.ECONNABORTED:
                continue
            raise
        return conn
