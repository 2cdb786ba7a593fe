"""Start `metal-cluster serve` as a real process for tests, with bounded waits and full cleanup."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(model, *extra, log_path, timeout=300, command="serve"):
    port = free_port()
    cmd = [sys.executable, "-m", "metal_cluster.coordinator", command]
    cmd += ([str(model)] if model else []) + ["--port", str(port), *extra]
    with open(log_path, "w") as log:
        # Its own session, so EngineCore and every other child go down with it.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, timeout, log_path)
        yield url
    finally:
        _stop(proc)


@contextlib.contextmanager
def running_servers(specs: dict, *, timeout=300):
    """Several servers started at once, {name: (model, extra args, log path)} -> {name: url}. A
    start is mostly vLLM's imports and set-up, on one core: on CI's two cores, servers that start
    together are ready in about the time of one. If any fails to start, the others are stopped."""
    from concurrent.futures import ThreadPoolExecutor

    with contextlib.ExitStack() as stack:
        servers = {name: running_server(model, *extra, log_path=log, timeout=timeout)
                   for name, (model, extra, log) in specs.items()}
        with ThreadPoolExecutor(len(servers)) as pool:
            starts = {name: pool.submit(server.__enter__) for name, server in servers.items()}
        urls, failures = {}, []
        for name, start in starts.items():
            if start.exception() is None:
                urls[name] = start.result()
                stack.push(servers[name].__exit__)
            else:
                failures.append(start.exception())
        if failures:
            raise failures[0]
        yield urls


def tree_rss(url) -> int:
    """Resident memory of the server listening at `url` and all its children (EngineCore, ...)."""
    import psutil

    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            root = psutil.Process(conn.pid)
            return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    raise LookupError(f"nothing listens at {url}")


def _wait_healthy(proc, url, timeout, log_path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server not healthy after {timeout}s:\n{_tail(log_path)}")


def _stop(proc):
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            # The session leader is gone; make sure no child outlived it.
            os.killpg(proc.pid, signal.SIGKILL)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            continue
        return


def _tail(path, n=40):
    with open(path) as f:
        return "".join(f.readlines()[-n:])
