"""Time from `metal-cluster serve` (no arguments: the embedded default model, every default) to the
first answer of the README's curl request, and where the start went (the server's `start:` line).
Run: `.venv/bin/python bench/first_answer.py [--runs 3] [--cold]`. The goal is 20 s on a 2-core Linux machine.
"""

import argparse
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_first_start  # noqa: E402  (the test's own start and request, so both measure the same)


def one_run(log_dir: Path, k: int) -> tuple[float, str]:
    class Factory:
        def mktemp(self, name):
            path = log_dir / f"{name}-{k}"
            path.mkdir(parents=True, exist_ok=True)
            return path

    gen = test_first_start.default_server.__wrapped__(Factory())
    _, first, log_path = next(gen)
    gen.close()
    where = re.search(r"start: (.*)", log_path.read_text())
    return first, where.group(1) if where else "(no start line)"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cold", action="store_true",
                        help="drop the page cache before the first run (root: /proc/sys/vm/drop_caches), as on a "
                             "machine just booted")
    args = parser.parse_args()
    log_dir = Path(f"/tmp/mc-bench-first-answer-{int(time.time())}")
    times = []
    for k in range(args.runs):
        if k == 0 and args.cold:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        first, where = one_run(log_dir, k)
        times.append(first)
        print(f"run {k + 1}: first answer after {first:.1f} s; {where}", flush=True)
    print(f"median {sorted(times)[len(times) // 2]:.1f} s over {len(times)} runs (goal 20 s); logs in {log_dir}")


if __name__ == "__main__":
    main()
