"""The weights' plaintext link: a model store's byte ranges over one plain TCP connection.

TLS costs each end of a transfer 1.3-2.1 CPU seconds per GiB, several times what the bytes
themselves cost (bench/README.md, "Weights over the model store"), and a cluster's weights are
mostly public checkpoints; its hidden states already cross the LAN in the clear on the ring. So by
default the weights do too, while what makes them trustworthy travels over TLS: the manifest,
with every piece's BLAKE3, and a one-time ticket naming the ranges (ModelStore.Grant). The worker
checks each piece against the manifest as it arrives and records only those that match, so a LAN
observer can read the weights but nobody can change them unnoticed. `up --weights-over-tls` keeps
them on the TLS stream (ModelStore.Read) instead.

The wire: the worker connects to the store's bulk port and sends its ticket; the store sends the
granted ranges' bytes back to back (`sendfile`: no copy through Python) and closes. Lengths are the
ticket's, so there is no framing. A ticket is good for one connection, within GRANT_SECONDS.
"""

import contextlib
import fcntl
import logging
import os
import queue
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("metal_cluster.model_store")

TICKET_BYTES = 32
GRANT_SECONDS = 60.0  # a ticket not used by then is forgotten
IO_TIMEOUT = 30.0  # a peer silent this long, mid-transfer, is gone
# What the receiver hands on at a time: received and written on one thread, hashed on another. Small
# enough to still be in the CPU's cache when it is written and hashed: 4 MiB chunks ran at half the
# rate of 256 KiB ones between two namespaces here (bench/README.md, "Weights over the model store").
CHUNK_BYTES = 256 * 2**10
# splice(2) copies nothing through this process, so its chunks can be bigger (fewer calls a GiB;
# 4 MiB ran slower than 1 MiB here), through a pipe of at most 1 MiB (Linux's default cap).
SPLICE_CHUNK_BYTES = 2**20
PIPE_BYTES = 2**20


@dataclass
class _Grant:
    path: Path
    ranges: list[tuple[int, int]]  # (offset, length), in order
    expires: float
    check: Callable[[], None]  # raises OSError when the file changed since its manifest


class BulkSender:
    """The store's side: a plain TCP port that sends granted ranges of the model's files."""

    def __init__(self, host: str):
        self.listener = socket.create_server((host, 0))
        self.port = self.listener.getsockname()[1]
        self.grants: dict[bytes, _Grant] = {}
        self.open: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.stopped = False
        self.sent = 0  # bytes sent, all transfers
        threading.Thread(target=self._accept, name="bulk-accept", daemon=True).start()

    def grant(self, path: Path, ranges: list[tuple[int, int]], check: Callable[[], None]) -> bytes:
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = time.monotonic()
        with self.lock:
            self.grants = {t: g for t, g in self.grants.items() if g.expires > now}
            self.grants[ticket] = _Grant(path, ranges, now + GRANT_SECONDS, check)
        return ticket

    def stop(self) -> None:
        """Stop listening and cut every transfer under way (the receivers keep what arrived)."""
        with self.lock:
            self.stopped = True
            conns, self.open = list(self.open), set()
        _close(self.listener)
        for conn in conns:
            _close(conn)

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.listener.accept()
            except OSError:
                return  # stopped
            with self.lock:
                if self.stopped:
                    _close(conn)
                    return
                self.open.add(conn)
            threading.Thread(target=self._serve, args=(conn, peer), name="bulk-send", daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        try:
            conn.settimeout(IO_TIMEOUT)
            ticket = _recv_exact(conn, TICKET_BYTES)
            with self.lock:
                grant = self.grants.pop(ticket, None)
            if grant is None or grant.expires < time.monotonic():
                log.warning("refused a weights connection from %s: no such ticket (used, expired or forged)", peer[0])
                return
            grant.check()
            with open(grant.path, "rb") as f:
                for offset, length in grant.ranges:
                    sent = conn.sendfile(f, offset, length)
                    with self.lock:
                        self.sent += sent
                    if sent != length:
                        log.warning("%s is shorter than its manifest says; cut the transfer to %s", grant.path, peer[0])
                        return
        except OSError as e:
            if not self.stopped:
                log.info("a weights transfer to %s ended early: %s", peer[0], e)
        finally:
            with self.lock:
                self.open.discard(conn)
            _close(conn)


class Buffers:
    """A fixed set of chunk buffers: the receiver takes one to fill, the hasher gives it back, so
    at most `count` chunks are in flight and no buffer is allocated per chunk."""

    def __init__(self, count: int, size: int = CHUNK_BYTES):
        self.free: queue.Queue[memoryview] = queue.Queue()
        for _ in range(count):
            self.free.put(memoryview(bytearray(size)))

    def take(self) -> memoryview:
        try:
            return self.free.get(timeout=IO_TIMEOUT)
        except queue.Empty:
            raise TimeoutError("no chunk buffer came back: the hashing thread is stuck") from None

    def give(self, buf: memoryview) -> None:
        self.free.put(buf)


def connect(host: str, port: int, ticket: bytes) -> socket.socket:
    """A connection to the store's bulk port that has shown its ticket (OSError if none can be made)."""
    conn = socket.create_connection((host, port), timeout=IO_TIMEOUT)
    try:
        conn.sendall(ticket)
    except OSError:
        conn.close()
        raise
    return conn


def receive_into(conn: socket.socket, sinks: list[tuple[int, int, int]],
                 buffers: Buffers) -> Iterator[tuple[memoryview, Callable[[], None]]]:
    """Write the granted ranges' bytes, back to back as they come, where `sinks` say: (fd, offset
    in it, length) for each range in turn; yield each chunk once it is written, as (its bytes,
    release): chunks of at most CHUNK_BYTES that never straddle two ranges; `release()` once the
    chunk is hashed. Closes `conn`. OSError (TimeoutError too) when the link or the disk fails;
    EOFError when the store ends early.

    On Linux the bytes go from the socket to the file by splice(2), without a copy through this
    process, and are read back from the page cache to be hashed; elsewhere they are received into
    `buffers` and written from there."""
    with conn:
        if hasattr(os, "splice"):
            yield from _spliced(conn, sinks)
        else:
            yield from _copied(conn, sinks, buffers)


def _chunks(sinks: list[tuple[int, int, int]], size: int = CHUNK_BYTES) -> Iterator[tuple[int, int, int]]:
    for fd, offset, length in sinks:
        for at in range(offset, offset + length, size):
            yield fd, at, min(size, offset + length - at)


def _copied(conn, sinks, buffers: Buffers):
    for fd, at, n in _chunks(sinks):
        buf = buffers.take()
        try:
            view = buf[:n]
            _recv_into_exact(conn, view)
            _pwrite_all(fd, view, at)
        except BaseException:
            buffers.give(buf)
            raise
        yield view, lambda buf=buf: buffers.give(buf)


def _spliced(conn, sinks):
    # A blocking socket with a receive timeout: splice(2) honours SO_RCVTIMEO (EAGAIN when it passes).
    conn.settimeout(None)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(IO_TIMEOUT), 0))
    pipe_out, pipe_in = os.pipe()
    try:
        with contextlib.suppress(OSError):  # a bigger pipe: fewer calls (Linux caps it, 1 MiB by default)
            fcntl.fcntl(pipe_in, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
        for fd, at, n in _chunks(sinks, SPLICE_CHUNK_BYTES):
            done = 0
            while done < n:
                got = os.splice(conn.fileno(), pipe_in, n - done)
                if not got:
                    raise EOFError("the peer closed the connection early")
                while got:
                    moved = os.splice(pipe_out, fd, got, offset_dst=at + done)
                    got -= moved
                    done += moved
            # Read back from the page cache: a file that grows as it arrives cannot be mapped ahead.
            yield memoryview(os.pread(fd, n, at)), _nothing
    finally:
        os.close(pipe_in)
        os.close(pipe_out)


def _nothing() -> None:
    pass


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into_exact(conn, memoryview(buf))
    return bytes(buf)


def _recv_into_exact(conn: socket.socket, view: memoryview) -> None:
    while view:
        got = conn.recv_into(view)
        if not got:
            raise EOFError("the peer closed the connection early")
        view = view[got:]


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def host_of(address: str) -> str:
    """The host of a `host:port` gRPC address (`[v6]:port` too)."""
    return address.rpartition(":")[0].strip("[]")
