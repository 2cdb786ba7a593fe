"""While stages load, one line per stage now and then with its weight fetch: bytes, rate, time left.

The stages report their fetch in Health (a worker answers Health while it loads); a stage reading
the model from this host's disk fetches nothing and says nothing here.
"""

import contextlib
import threading
import time

from metal_cluster.coordinator.stages import StageCallError

EVERY_S = 5.0


@contextlib.contextmanager
def reported(stages: list, say, every_s: float = EVERY_S):
    fetching = [s for s in stages if getattr(s, "model_store", "")]
    if not fetching:
        yield
        return
    stop = threading.Event()
    thread = threading.Thread(target=_watch, args=(fetching, say, every_s, stop), name="load-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=every_s + 5)


def _watch(stages: list, say, every_s: float, stop: threading.Event) -> None:
    began = time.monotonic()
    last: dict[str, tuple[int, int]] = {}
    while not stop.wait(every_s):
        for stage in stages:
            try:
                h = stage.health(timeout=2)
            except StageCallError:
                continue
            if not h.fetch_bytes_total or last.get(stage.name) == (h.fetch_bytes_done, h.fetch_bytes_total):
                continue
            last[stage.name] = (h.fetch_bytes_done, h.fetch_bytes_total)
            say(line(stage.name, h.fetch_bytes_done, h.fetch_bytes_total, time.monotonic() - began))


def line(name: str, done: int, total: int, elapsed_s: float) -> str:
    rate = done / max(elapsed_s, 1e-6)
    left = f", {(total - done) / rate:.0f}s left" if 0 < rate and done < total else ""
    return (f"stage {name}: fetched {done / 2**20:.1f} of {total / 2**20:.1f} MiB of weights "
            f"({100 * done / total:.0f}%, {rate / 2**20:.1f} MiB/s{left})")
