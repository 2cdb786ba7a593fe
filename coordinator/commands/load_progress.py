"""While stages start (weights, warm-up, KV pool, ring), what each is doing: rich progress bars on
a terminal, else one plain line per change (logs, launchd, systemd) and a fetch line now and then.

The stages say what they do in Health (`phase`, and the bytes of a weight fetch); a worker answers
Health while it loads, and the in-process stage answers from its own fields.
"""

import contextlib
import sys
import threading
import time

from metal_cluster.coordinator.cluster.stages import StageCallError

EVERY_S = 5.0  # between two fetch lines of one stage (plain output)
POLL_S = 0.1  # often enough to see a phase of a fraction of a second


@contextlib.contextmanager
def reported(stages: list, say, every_s: float = EVERY_S, terminal: bool | None = None):
    """`say(line)` gets the plain lines; on a terminal (stderr) rich draws bars instead."""
    terminal = sys.stderr.isatty() if terminal is None else terminal
    view = Bars(stages) if terminal else Lines(say, every_s)
    stop = threading.Event()
    thread = threading.Thread(target=_watch, args=(stages, view, stop), name="load-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def _watch(stages: list, view, stop: threading.Event) -> None:
    try:
        while True:
            for stage in stages:
                try:
                    view.update(stage.name, stage.health(timeout=2))
                except StageCallError:
                    continue
            if stop.wait(POLL_S):
                return
    finally:
        view.close()


class Lines:
    """One line per phase change of a stage; a fetch line at most every `every_s` per stage."""

    def __init__(self, say, every_s: float):
        self.say, self.every_s = say, every_s
        self.began = time.monotonic()
        self.phases: dict[str, str] = {}
        self.fetch_said: dict[str, tuple[float, int]] = {}

    def update(self, name: str, h) -> None:
        if h.phase and self.phases.get(name) != h.phase:
            self.phases[name] = h.phase
            self.say(f"stage {name}: {h.phase}")
        if h.fetch_bytes_total:
            said_at, done = self.fetch_said.get(name, (time.monotonic(), -1))
            now = time.monotonic()
            finished = h.fetch_bytes_done == h.fetch_bytes_total
            if done != h.fetch_bytes_done and (finished or now - said_at >= self.every_s):
                self.fetch_said[name] = (now, h.fetch_bytes_done)
                self.say(line(name, h.fetch_bytes_done, h.fetch_bytes_total, now - self.began))

    def close(self) -> None:
        pass


class Bars:
    """A rich progress row per stage: its phase, a bar of fetched bytes (or a pulse), time spent."""

    def __init__(self, stages: list):
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn,
                                   TimeElapsedColumn)

        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                 TimeElapsedColumn(), console=Console(stderr=True), transient=False,
                                 redirect_stdout=False, redirect_stderr=False)
        self.tasks = {s.name: self.progress.add_task(f"stage {s.name}: starting", total=None) for s in stages}
        self.progress.start()

    def update(self, name: str, h) -> None:
        fetching = h.fetch_bytes_total and h.phase.startswith("fetching")
        self.progress.update(self.tasks[name], description=f"stage {name}: {h.phase or h.state}",
                             total=h.fetch_bytes_total if fetching else None,
                             completed=h.fetch_bytes_done if fetching else 0)

    def close(self) -> None:
        self.progress.stop()


def line(name: str, done: int, total: int, elapsed_s: float) -> str:
    rate = done / max(elapsed_s, 1e-6)
    left = f", {(total - done) / rate:.0f}s left" if 0 < rate and done < total else ""
    return (f"stage {name}: fetched {done / 2**20:.1f} of {total / 2**20:.1f} MiB of weights "
            f"({100 * done / total:.0f}%, {rate / 2**20:.1f} MiB/s{left})")
