"""Stage-worker processes on this machine, for `serve --pipeline-parallel-size N`: the
single-machine form of a cluster (loopback gRPC and ring)."""

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from metal_cluster.coordinator.blas import openblas_env
from metal_cluster.stage_worker.net.auth import TOKEN_ENV
from metal_cluster.stage_worker.worker_env import PARENT_PID_ENV

START_TIMEOUT_S = 120


class WorkerStartError(RuntimeError):
    pass


@dataclass
class LocalWorker:
    address: str
    pid: int


def _free_ports(n: int, host: str, avoid: tuple[int, ...] = ()) -> list[int]:
    """`n` ports free now, none of them in `avoid` (ports that are free now but promised elsewhere:
    the API server binds its own only after the workers are up)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)  # held until all are chosen, so none comes back twice
            if s.getsockname()[1] not in avoid:
                ports.append(s.getsockname()[1])
        return ports
    finally:
        for s in socks:
            s.close()


@contextlib.contextmanager
def started(count: int, host: str = "127.0.0.1", avoid: tuple[int, ...] = ()):
    """Yield `count` fresh workers (none for count 1: the stage runs in-process), on ports not in `avoid`."""
    if count <= 0:
        yield []
        return
    ports = _free_ports(2 * count, host, avoid)
    procs, addresses = [], []
    # Local workers get a fresh secret of their own; the executor finds it in the environment.
    token = os.environ.setdefault(TOKEN_ENV, secrets.token_urlsafe(24))
    try:
        for k in range(count):
            grpc_port, ring_port = ports[2 * k], ports[2 * k + 1]
            cmd = [sys.executable, "-m", "metal_cluster.coordinator", "worker", "--host", host,
                   "--port", str(grpc_port), "--ring-port", str(ring_port), "--no-advertise"]
            env = {**openblas_env(), TOKEN_ENV: token, PARENT_PID_ENV: str(os.getpid())}
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
            addresses.append(f"{host}:{grpc_port}")
        _wait_ready(procs, addresses)
        print(f"metal-cluster: {count} local stage workers up: {', '.join(addresses)}", file=sys.stderr, flush=True)
        yield [LocalWorker(a, p.pid) for a, p in zip(addresses, procs)]
    finally:
        for proc in procs:
            _stop(proc)


def _wait_ready(procs, addresses):
    from metal_cluster.coordinator.cluster.stages import RemoteStage, StageCallError

    deadline = time.monotonic() + START_TIMEOUT_S
    for proc, address in zip(procs, addresses):
        stage = RemoteStage(address)
        try:
            stage.wait_ready(deadline, still_starting=lambda: proc.poll() is None)
        except StageCallError as e:
            if proc.poll() is not None:
                raise WorkerStartError(f"stage worker {address} exited with {proc.returncode} before it was ready") from None
            raise WorkerStartError(f"stage worker {address} not ready after {START_TIMEOUT_S}s: {e}") from None
        finally:
            stage.close()


def _stop(proc):
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
