"""What the GPU runs in one decode step, kernel by kernel: ours against mlx-lm's, same folders.

bench/step_profile.py splits a step's wall time on the host; it cannot say whether the device is
busy or waiting, nor which kernels take the time. torch's profiler can: Kineto records, through
CUPTI, every kernel this process launches, MLX's included (CUPTI sees the driver, not the
framework). So each loop decodes under it, and per step it reports:

- `wall`: ms per step; `busy`: ms the device spent in kernels (their union, not their sum);
- `idle`: the share of the step's span with no kernel running (the host is what it waits on);
- the kernels with the most time per step, by name, with their count per step.

Loops: mlx-lm's own decode loop (generate_step's pattern), and our stage built as `serve` builds it
(StageHost assign + start from the folder, bench/graph_ops.build_host) decoding one step ahead as
under vLLM's async scheduling, once per `--num-blocks` (the pool's size), and with `--unfused` once
more with METAL_CLUSTER_FUSE=0's separate projections, and with `--separate-norm-rope` once more
with METAL_CLUSTER_NORM_ROPE=0's four q/k norm and RoPE ops a layer, with `--separate-add-norm` with
METAL_CLUSTER_ADD_NORM=0's residual add and RMSNorm ops, and with `--uncarried` with
METAL_CLUSTER_CARRY=0's last residual add of each block as its own op. Folders are bench/gpu_serving.py's.

On the GPU machine (a CUDA torch beside MLX's CUDA build):
    python3 bench/kernel_profile.py [--formats 4bit,bf16] [--num-blocks 64,2377] [--unfused] [--separate-norm-rope] [--separate-add-norm] [--uncarried] [--by-grid] [--steps 32] [--json out.json]
Here (no CUDA: the loops run, the kernel table is empty), a smoke test:
    .venv/bin/python bench/kernel_profile.py --small --steps 2
"""

import argparse
import gc
import json
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "tests"))
sys.path.insert(0, str(ROOT))

from scheduler_double import SchedulerDouble  # noqa: E402

import gpu_serving  # noqa: E402
import graph_ops  # noqa: E402

from metal_cluster.stage_worker.model import fuse  # noqa: E402

PROMPT = list(range(1000, 1128))
DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def ours(folder: Path, num_blocks: int, tokens: int):
    """Our stage's decode, one step ahead, of a request of `tokens` tokens: returns (step, finish)."""
    host = graph_ops.build_host(folder, num_blocks=num_blocks)
    next_id = [host.next_step]

    def step_fn(step):
        step.step_id = next_id[0]
        next_id[0] += 1
        answer = host.launch(step)
        return lambda: {s.req_id: s.token_id for s in answer().sampled}

    sched = SchedulerDouble(step_fn, host.runner.pool.num_blocks, graph_ops.BLOCK_SIZE, ahead=True)
    sched.add("r", PROMPT, tokens)
    return sched.step, sched.run


def mlx_lm(folder: Path, tokens: int):
    """mlx-lm's decode loop as generate_step runs it: build n+1, submit it, then read n."""
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    model, _ = load(str(folder))
    cache = make_prompt_cache(model)
    with mx.stream(generation_stream):
        y = mx.argmax(model(mx.array([PROMPT]), cache=cache)[:, -1], axis=-1)
    mx.eval(y)
    state = {"y": y}

    def step():
        with mx.stream(generation_stream):
            nxt = mx.argmax(model(state["y"][:, None], cache=cache)[:, -1], axis=-1)
        mx.async_eval(nxt)
        state["y"].item()
        state["y"] = nxt

    return step, lambda: state["y"].item()


WARM = 8


def record(step, steps: int, warm: int = WARM) -> tuple[float, list[dict]]:
    """Decode `steps` steps under the profiler after `warm` outside it: (ms per step, device events)."""
    for _ in range(warm):
        step()
    activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - t0) / steps
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text()).get("traceEvents", [])
    return 1000 * wall, [e for e in events if e.get("cat") in DEVICE_EVENTS and "dur" in e]


def short_name(event: dict, by_grid: bool) -> str:
    """A kernel's name without its arguments, shortened; with by_grid, its launch grid after it."""
    name = re.sub(r"\(.*\)$", "", event["name"])
    name = name if len(name) <= 90 else name[:87] + "..."
    grid = event.get("args", {}).get("grid")
    return f"{name} {grid}" if by_grid and grid else name


def summarize(wall_ms: float, events: list[dict], steps: int, top: int, by_grid: bool) -> dict:
    if not events:
        return dict(wall_ms=wall_ms, busy_ms=0.0, idle=None, kernels=0.0, top=[])
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)  # microseconds
    busy, end = 0.0, spans[0][0]
    for lo, hi in spans:
        busy += max(0.0, hi - max(lo, end))
        end = max(end, hi)
    span = spans[-1][1] - spans[0][0]
    by_name = defaultdict(list)
    for e in events:
        by_name[short_name(e, by_grid)].append(e["dur"])
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return dict(
        wall_ms=wall_ms, busy_ms=busy / steps / 1000, idle=1 - busy / span, kernels=len(events) / steps,
        top=[dict(name=n, per_step=len(d) / steps, us_per_step=sum(d) / steps, us_median=statistics.median(d))
             for n, d in ranked])


def show(label: str, r: dict) -> None:
    idle = "-" if r["idle"] is None else f"{100 * r['idle']:.0f} %"
    print(f"\n### {label}: {r['wall_ms']:.2f} ms a step, device busy {r['busy_ms']:.2f} ms, idle {idle}, "
          f"{r['kernels']:.0f} kernels a step", flush=True)
    if r["top"]:
        print("| kernel | per step | us per step | us median |\n|---|---:|---:|---:|")
        for k in r["top"]:
            print(f"| `{k['name']}` | {k['per_step']:.1f} | {k['us_per_step']:.0f} | {k['us_median']:.1f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="4bit,bf16")
    ap.add_argument("--num-blocks", default="64,2377", help="our pool's sizes, comma-separated")
    ap.add_argument("--unfused", action="store_true", help="also our stage with separate projections")
    ap.add_argument("--separate-norm-rope", action="store_true", help="also our stage with MLX's q/k norm and RoPE ops")
    ap.add_argument("--separate-add-norm", action="store_true", help="also our stage with MLX's residual add and RMSNorm ops")
    ap.add_argument("--uncarried", action="store_true", help="also our stage with each block's last residual add its own op")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--by-grid", action="store_true", help="kernels told apart by launch grid too (a matmul's shapes)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/gpu-serving"))
    ap.add_argument("--small", action="store_true", help="gpu_serving's tiny shape: a smoke test of the script")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    config = gpu_serving.SHAPES["qwen3-8b"][1 if args.small else 0]
    formats = args.formats.split(",")
    folders = gpu_serving.ensure_folders(args.work_dir, config, formats, args.small)
    print(f"device: {mx.default_device()}, torch {torch.__version__}, CUDA profiling {torch.cuda.is_available()}")
    results = []
    for fmt in formats:
        tokens = WARM + args.steps + 4
        loops = [("mlx-lm", lambda f=folders[fmt]: mlx_lm(f, tokens))]
        loops += [(f"ours, {n} blocks", lambda f=folders[fmt], n=int(n): ours(f, n, tokens))
                  for n in args.num_blocks.split(",")]
        first = int(args.num_blocks.split(",")[0])
        for flag, option, label in (("FUSE", "unfused", "unfused"),
                                    ("NORM_ROPE", "separate_norm_rope", "separate norm and rope"),
                                    ("ADD_NORM", "separate_add_norm", "separate add and norm"),
                                    ("CARRY", "uncarried", "uncarried")):
            if getattr(args, option):
                loops.append((f"ours, {first} blocks, {label}", lambda f=folders[fmt], flag=flag: switched_off(flag, f, first, tokens)))
        for label, build in loops:
            step, finish = build()
            wall, events = record(step, args.steps)
            finish()
            r = summarize(wall, events, args.steps, args.top, args.by_grid)
            show(f"{fmt}, {label}", r)
            results.append(dict(format=fmt, loop=label, **r))
            del step, finish
            gc.collect()
            mx.clear_cache()
        if args.json:
            args.json.write_text(json.dumps(dict(device=gpu_serving.device_info(), rows=results), indent=2))


def switched_off(flag: str, folder: Path, num_blocks: int, tokens: int):
    """`ours` loaded with one of model/fuse.py's switches (FUSE, NORM_ROPE, ADD_NORM, CARRY) off."""
    setting = getattr(fuse, flag)
    setattr(fuse, flag, False)
    try:
        return ours(folder, num_blocks, tokens)
    finally:
        setattr(fuse, flag, setting)


if __name__ == "__main__":
    main()
