"""A warm standby for a worker: a second process of the same `metal-cluster worker`, its imports and
TLS set-up done, idle, that takes the worker's ports over the moment the serving process resets.

A plan ends with a new process (MLX's ring can be joined once per process). Starting an interpreter
and importing MLX, gRPC and the model code was the survivors' share of a re-plan: 0.5-1 s on a quiet
2-core host, 2-4 s on a loaded one. With a standby the reset is a hand-over: the standby listens
within milliseconds, and the process that served re-executes itself (which frees its memory and the
old ring's sockets) and becomes the next standby. The two processes take turns.

The worker's first process keeps its pid all along (launchd, systemd and `serve` watch it); the
standby is its child, in its process group. They share a socket pair, so a process learns at once
(end of file) that its peer is gone:
- the child, whatever its role, exits: the worker is its first process, and a kill -9 of that pid
  still takes the stage down at once;
- the first process, serving: its standby died; it starts another one a little later;
- the first process, standing by: the serving child died; it takes the ports over, idle.

The line protocol: `ready` (standby, imports done), `go <monotonic time>` (serving process, its gRPC
server stopped), `taking` (standby, before it binds). A standby takes only a fresh `go`, and the
serving process waits for `taking` a bounded time, then restarts itself as before: never two
listeners on one port.

This module imports nothing heavy: the CLI calls it before the worker's imports.
"""

import logging
import os
import socket
import subprocess
import sys
import threading
import time

log = logging.getLogger("metal_cluster.worker")

STANDBY_ENV = "METAL_CLUSTER_STANDBY"  # "1": this process stands by
LINK_FD_ENV = "METAL_CLUSTER_STANDBY_LINK"  # this process's end of the socket pair
FIRST_PID_ENV = "METAL_CLUSTER_WORKER_PID"  # the worker's first process
DELAY_ENV = "METAL_CLUSTER_STANDBY_DELAY"  # seconds to wait before the imports (just handed over)
OFF_ENV = "METAL_CLUSTER_NO_STANDBY"  # "1": no standby (a host short of memory)
# After a hand-over the new standby's imports would compete for the CPU with the re-plan they make
# way for (load, KV allocation, the resumed requests' prefill): they wait this long first.
SETTLE_S = 3.0
TAKE_S = 2.0  # the serving process waits this long for `taking`; a standby refuses a `go` older than half
RESPAWN_S = 5.0  # a standby that died is replaced after this long
MAX_RESPAWNS = 3  # in a row, without one of them becoming ready


def enabled() -> bool:
    return os.environ.get(OFF_ENV) != "1"


def pause_after_hand_over() -> None:
    """In a process that has just handed its ports over: let the re-plan have the CPU first."""
    delay = float(os.environ.pop(DELAY_ENV, "0") or 0)
    if delay > 0:
        time.sleep(delay)


def is_first_process() -> bool:
    return os.environ.get(FIRST_PID_ENV, str(os.getpid())) == str(os.getpid())


class Link:
    """This process's end of the socket pair with its twin, and what the twin said."""

    def __init__(self, sock: socket.socket, standing_by: bool):
        self.sock = sock
        self.standing_by = standing_by
        self.ready = threading.Event()  # the twin stands by, imports done
        self.taking = threading.Event()  # the twin takes the ports now
        self.turn = threading.Event()  # (standing by) this process serves now
        self.peer_pid = 0
        self.child: subprocess.Popen | None = None
        self.respawns = 0
        self.lock = threading.Lock()
        self.closed = False
        os.set_inheritable(sock.fileno(), True)
        threading.Thread(target=self._read, name="standby-link", daemon=True).start()
        if not standing_by:
            self._send("ping")  # a standby already waiting (this process re-executed itself) says so

    # --- set-up ----------------------------------------------------------------------------------
    @classmethod
    def from_env(cls) -> "Link | None":
        fd = os.environ.get(LINK_FD_ENV)
        if not fd:
            return None
        try:
            sock = socket.socket(fileno=int(fd))
        except OSError:  # not there after all (a hand-made environment): no standby
            os.environ.pop(LINK_FD_ENV, None)
            return None
        return cls(sock, standing_by=os.environ.get(STANDBY_ENV) == "1")

    @classmethod
    def spawn(cls) -> "Link | None":
        """From the worker's first process, serving: start its standby."""
        ours, theirs = socket.socketpair()
        link = cls(ours, standing_by=False)
        link._start_child(theirs)
        return link

    def _start_child(self, theirs: socket.socket) -> None:
        from metal_cluster.stage_worker.worker_env import PARENT_PID_ENV

        os.environ[LINK_FD_ENV] = str(self.sock.fileno())
        os.environ.setdefault(FIRST_PID_ENV, str(os.getpid()))
        env = {**os.environ, STANDBY_ENV: "1", LINK_FD_ENV: str(theirs.fileno())}
        env.pop(PARENT_PID_ENV, None)  # the child follows this process, through the link
        env.pop(DELAY_ENV, None)
        child = subprocess.Popen([sys.executable, *sys.orig_argv[1:]], env=env, pass_fds=(theirs.fileno(),))
        theirs.close()
        self.child, self.peer_pid = child, child.pid
        log.info("starting a warm standby for this worker (pid %d)", child.pid)

    # --- the serving side ------------------------------------------------------------------------
    def hand_over(self) -> bool:
        """Ask the standby to take the ports (this process's gRPC server has stopped): whether it does."""
        if not self.ready.is_set():
            return False
        self.taking.clear()
        if not self._send(f"go {time.monotonic():.6f}"):
            return False
        return self.taking.wait(TAKE_S)

    # --- the standby side ------------------------------------------------------------------------
    def wait_turn(self, still_wanted=lambda: True) -> None:
        """Stand by until this process is to serve. `still_wanted()` is asked every second; False
        ends the process (the server that started the worker is gone)."""
        self._send("ready")
        log.info("standing by as this worker's warm standby (pid %d): takes over at the next reset",
                 os.getpid())
        while not self.turn.wait(1.0):
            if not still_wanted():
                log.info("the server that started this worker is gone; stopping")
                os._exit(0)
        self.standing_by = False
        os.environ.pop(STANDBY_ENV, None)

    # --- both ------------------------------------------------------------------------------------
    def _send(self, line: str) -> bool:
        try:
            self.sock.sendall(line.encode() + b"\n")
            return True
        except OSError:
            return False

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                data = self.sock.recv(4096)
            except OSError:
                data = b""
            if not data:
                self._peer_gone()
                return
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                self._heard(line.decode(errors="replace").split())

    def _heard(self, words: list[str]) -> None:
        if not words:
            return
        if words[0] == "ping":
            if self.standing_by and not self.turn.is_set():
                self._send("ready")
        elif words[0] == "ready":
            self.respawns = 0
            if not self.ready.is_set():
                self.ready.set()
                log.info("warm standby ready: it takes over at the next reset")
        elif words[0] == "taking":
            self.ready.clear()
            self.taking.set()
        elif words[0] == "go" and self.standing_by and not self.turn.is_set():
            age = time.monotonic() - float(words[1])
            if age > TAKE_S / 2:  # the serving process has given up waiting by now, or will have
                log.warning("standby: a hand-over %.1fs old refused (the serving process restarts itself)", age)
                return
            self._send("taking")
            log.info("standby taking over this worker's ports")
            self.turn.set()

    def _peer_gone(self) -> None:
        self.ready.clear()
        if self.child is not None:
            self.child.poll()  # reaped, not left a zombie
        if not is_first_process():
            log.info("this worker's first process (pid %s) is gone; stopping", os.environ.get(FIRST_PID_ENV))
            logging.shutdown()
            os._exit(0)
        if self.standing_by:
            log.warning("the serving process of this worker is gone; its standby takes over, idle")
            self.turn.set()
        threading.Thread(target=self._respawn, name="standby-respawn", daemon=True).start()

    def _respawn(self) -> None:
        """The first process's standby is gone: start another (a few tries, then without one)."""
        with self.lock:
            if self.closed:
                return
            self.respawns += 1
            if self.respawns > MAX_RESPAWNS:
                log.warning("warm standby failed %d times; this worker goes on without one "
                            "(a reset restarts the process itself)", MAX_RESPAWNS)
                return
        time.sleep(RESPAWN_S)
        ours, theirs = socket.socketpair()
        with self.lock:
            old, self.sock = self.sock, ours
        old.close()
        os.set_inheritable(ours.fileno(), True)
        self._start_child(theirs)
        threading.Thread(target=self._read, name="standby-link", daemon=True).start()
