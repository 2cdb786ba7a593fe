"""Where one stage's decode step goes: host time to build it vs the device's time to run it.

Builds the stage as `serve` does (StageHost assign + start from a model folder), decodes one
request, and splits each step into: `prepare` (request table, packing), `graph` (building this
stage's layers, logits and argmax lazily), `submit` (mx.async_eval) and `wait` (reading the token
back), first one step at a time (nothing overlaps), then one step ahead as under vLLM's async
scheduling. The device time of a step is then about `wait` in the first mode, and a step ahead
costs max(host, device).

`--ops` also counts each decode step's MLX ops (bench/graph_ops.py: the graph's primitive nodes,
the compiled calls and the nodes they make, attention's nodes, the rest built op by op), ours and,
with --mlx-lm, mlx-lm's on the same folder.

  python3 bench/step_profile.py FOLDER [FOLDER ...] [--steps 32] [--mlx-lm] [--compile on|off|both] [--ops]
      [--num-blocks 64]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scheduler_double import SchedulerDouble  # noqa: E402

import graph_ops  # noqa: E402

from metal_cluster.proto import PROTO_VERSION, pb  # noqa: E402
from metal_cluster.stage_worker.step import runner as runner_module  # noqa: E402
from metal_cluster.stage_worker.host import StageHost  # noqa: E402

BLOCK_SIZE = graph_ops.BLOCK_SIZE
COMPILE_CHOICES = {"on": (True,), "off": (False,), "both": (False, True)}


class Clock:
    """Accumulates seconds per phase for the step being timed."""

    def __init__(self):
        self.phases: dict[str, list[float]] = {}
        self.current: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.current[name] = self.current.get(name, 0.0) + seconds

    def close_step(self) -> None:
        for name, s in self.current.items():
            self.phases.setdefault(name, []).append(s)
        self.current = {}

    def medians_ms(self) -> dict[str, float]:
        return {name: 1000 * statistics.median(v) for name, v in self.phases.items()}


def timed(clock: Clock, name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.add(name, time.perf_counter() - t0)

    return wrapper


def instrument(host: StageHost, clock: Clock) -> None:
    runner = host.runner
    runner.prepare = timed(clock, "prepare", runner.prepare)
    runner._forward = timed(clock, "graph", runner._forward)
    runner.shard.logits = timed(clock, "graph", runner.shard.logits)
    original_async_eval = runner_module.mx.async_eval

    class _Mx:  # the runner's view of mx, with async_eval timed
        def __getattr__(self, name):
            return getattr(mx, name)

        @staticmethod
        def async_eval(*arrays):
            t0 = time.perf_counter()
            original_async_eval(*arrays)
            clock.add("submit", time.perf_counter() - t0)

    runner_module.mx = _Mx()


def profile(host: StageHost, clock: Clock, ahead: bool, steps: int, warm: int = 4, stream=None) -> dict:
    next_id = [host.next_step]  # step ids go on across runs on one stage
    import contextlib

    on_stream = (lambda: mx.stream(stream)) if stream is not None else contextlib.nullcontext

    def step_fn(step):
        step.step_id = next_id[0]
        next_id[0] += 1
        t0 = time.perf_counter()
        with on_stream():
            answer = host.launch(step)
        clock.add("launch", time.perf_counter() - t0)

        def read():
            t1 = time.perf_counter()
            with on_stream():
                response = answer()
            clock.add("wait", time.perf_counter() - t1)
            return {s.req_id: s.token_id for s in response.sampled}

        return read if ahead else read()

    sched = SchedulerDouble(step_fn, host.runner.pool.num_blocks, BLOCK_SIZE, ahead=ahead)
    sched.add("r", list(range(1000, 1128)), warm + steps + 4)
    for _ in range(1 + warm):
        sched.step()
    clock.phases, clock.current = {}, {}
    t0 = time.perf_counter()
    for _ in range(steps):
        sched.step()
        clock.close_step()
    per_step = (time.perf_counter() - t0) / steps
    sched.run()
    return dict(step_ms=1000 * per_step, **clock.medians_ms())


def mlx_lm_profile(folder: Path, steps: int, warm: int = 4) -> dict:
    """mlx-lm's own decode loop (generate_step's pattern), split the same way."""
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    model, _ = load(str(folder))
    cache = make_prompt_cache(model)
    clock = Clock()
    with mx.stream(generation_stream):
        y = mx.argmax(model(mx.array([list(range(1000, 1128))]), cache=cache)[:, -1], axis=-1)
    mx.eval(y)
    t_start = None
    for i in range(warm + steps):
        if i == warm:
            clock.phases, clock.current, t_start = {}, {}, time.perf_counter()
        t0 = time.perf_counter()
        with mx.stream(generation_stream):
            nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        y.item()
        t3 = time.perf_counter()
        clock.add("graph", t1 - t0)
        clock.add("submit", t2 - t1)
        clock.add("wait", t3 - t2)
        clock.close_step()
        y = nxt
    per_step = (time.perf_counter() - t_start) / steps
    del model, cache
    return dict(step_ms=1000 * per_step, **clock.medians_ms())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--mlx-lm", action="store_true", help="also split mlx-lm's own decode loop")
    parser.add_argument("--compile", choices=tuple(COMPILE_CHOICES), default="on",
                        help="the decode step's pure parts through mx.compile (stage_worker/step/tracing/compiled.py), as serve runs them, or not, or both")
    parser.add_argument("--num-blocks", type=int, default=64,
                        help="the KV pool's blocks: what serve would allocate (e.g. 2377, gpu_serving's) to see whether the pool's size moves a step")
    parser.add_argument("--ops", action="store_true", help="also count the MLX ops of a decode step (bench/graph_ops.py)")
    args = parser.parse_args()
    print(f"device: {mx.default_device()}")
    print("| model | mode | step (ms) | launch | prepare | graph | submit | wait |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for folder in args.folders:
        if args.mlx_lm:
            r = mlx_lm_profile(folder, args.steps)
            cells = " | ".join(f"{r.get(k, 0.0):.2f}" for k in ("launch", "prepare", "graph", "submit", "wait"))
            print(f"| {folder.name} | mlx-lm | {r['step_ms']:.2f} | {cells} |", flush=True)
            mx.clear_cache()
        host = graph_ops.build_host(folder, num_blocks=args.num_blocks)
        clock = Clock()
        instrument(host, clock)
        stream = mx.new_stream(mx.default_device())
        modes = [("sync", False, None), ("ahead", True, None), ("ahead, own stream", True, stream)]
        for compiled in COMPILE_CHOICES[args.compile]:
            runner_module.COMPILE = compiled
            for mode, ahead, on in modes if args.compile != "both" else modes[:2]:
                r = profile(host, clock, ahead, args.steps, stream=on)
                cells = " | ".join(f"{r.get(k, 0.0):.2f}" for k in ("launch", "prepare", "graph", "submit", "wait"))
                label = f"{mode}, {'compiled' if compiled else 'not compiled'}"
                print(f"| {folder.name} | {label} | {r['step_ms']:.2f} | {cells} |", flush=True)
        del host
        mx.clear_cache()
    if args.ops:
        print_ops(args.folders, args.mlx_lm, COMPILE_CHOICES[args.compile])


def print_ops(folders, with_mlx_lm: bool, compile_modes) -> None:
    """Ops per decode step, on a fresh stage per folder (so its traces are made while counted)."""
    print("\n| model | loop | nodes per step | compiled calls | nodes from them | kernel nodes (calls) | other nodes |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for folder in folders:
        if with_mlx_lm:
            r = graph_ops.mlx_lm_ops(folder, as_gpu=mx.default_device().type == mx.DeviceType.gpu)
            print(f"| {folder.name} | mlx-lm | {r['nodes']} | - | - | - | - |", flush=True)
        host = graph_ops.build_host(folder, num_blocks=64)
        for compiled in compile_modes:
            runner_module.COMPILE = compiled
            r = graph_ops.stage_ops(host)
            print(f"| {folder.name} | ours, {'compiled' if compiled else 'not compiled'} | {r['nodes']} | "
                  f"{r['compiled_calls']} | {r['traced']} | {r['attention']} ({r['attention_calls']}) | {r['outside']} |",
                  flush=True)
        del host
        mx.clear_cache()


if __name__ == "__main__":
    main()
