"""A new user's first minute: `metal-cluster serve` with no arguments (the embedded default model,
every default) in a terminal (a pseudo-terminal), timed from the command to its first answer; the
progress it draws there; then the README's curl example."""

import concurrent.futures
import fcntl
import json
import os
import pty
import struct
import termios
import threading
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from server_process import free_port

README = Path(__file__).resolve().parent.parent / "README.md"
# The goal is 20 s (bench/README.md has the measured figure). The limit guards against a hang, not
# the goal: on 2026-12-01 a fresh-clone CI run on this 2-core machine took 43 s here (the day's
# first run, 26.9 s), and the commit before that day's merges took as long as the merged head.
FIRST_ANSWER_LIMIT_S = 60


def readme_curl() -> tuple[str, dict]:
    """The quick start's curl example: its path and JSON body, as the README writes them."""
    block = re.search(r"```bash\n(curl http://127\.0\.0\.1:8000(\S+) .*?)```", README.read_text(), re.S)
    assert block, "README.md lost its curl example"
    body = re.search(r"-d '(.*?)'", block.group(1), re.S).group(1)
    return block.group(2), json.loads(body)


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    """(url, seconds from the command to the first answer of the README's request, log path)."""
    log_path = tmp_path_factory.mktemp("first-start") / "serve.log"
    port = free_port()
    path, body = readme_curl()
    began = time.monotonic()
    master, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "metal_cluster.coordinator", "serve", "--port", str(port)],
                            stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal, start_new_session=True)
    os.close(terminal)
    copier = threading.Thread(target=_copy_until_closed, args=(master, log_path), daemon=True)
    copier.start()
    url = f"http://127.0.0.1:{port}"
    try:
        first = None
        while time.monotonic() - began < 300:
            assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}"
            try:
                post(url + path, body, timeout=300)
                first = time.monotonic() - began
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        assert first is not None, f"no answer after 300 s:\n{log_path.read_text()[-3000:]}"
        yield url, first, log_path
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(20)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        copier.join(10)


def _copy_until_closed(fd: int, path: Path) -> None:
    """What the terminal shows, into the log (and the pty drained, so the server never blocks on it)."""
    with open(path, "wb") as log:
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: every writer is gone
                break
            if not data:
                break
            log.write(data)
            log.flush()
    os.close(fd)


def test_a_terminal_shows_progress_bars_while_the_stage_starts(default_server):
    _, _, log_path = default_server
    shown = log_path.read_bytes().decode(errors="replace")
    assert "\x1b[" in shown  # rich drew (cursor movement, colour)
    for phase in ("stage local: loading weights", "stage local: warming up", "stage local: allocating the KV pool"):
        assert phase in shown, shown[-3000:]
    assert "━" in shown  # a bar


def test_first_answer_within_the_limit(default_server):
    _, first, log_path = default_server
    log = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", log_path.read_bytes().decode(errors="replace"))  # the terminal's colours
    where = [line.split("] ", 1)[-1] for line in log.splitlines() if "start: load" in line]
    assert len(where) == 1 and "warm-up" in where[0] and "KV" in where[0], log[-3000:]
    assert where[0].endswith("; EngineCore forked" if sys.platform == "linux" else "; EngineCore spawned")
    print(f"serve -> first answer: {first:.1f} s; {where[0].split('start: ', 1)[1]}")
    assert first <= FIRST_ANSWER_LIMIT_S, f"first answer after {first:.1f} s (limit {FIRST_ANSWER_LIMIT_S} s): {where[0]}"


def test_readme_curl_without_sampling_fields_says_paris(default_server):
    url, _, _ = default_server
    path, body = readme_curl()
    assert not {"temperature", "top_p", "top_k", "seed"} & set(body)
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda _: post(url + path, body, timeout=120)["choices"][0]["message"]["content"],
                                range(10)))
    print("answers:", answers)
    assert sum("Paris" in a for a in answers) >= 9, answers
