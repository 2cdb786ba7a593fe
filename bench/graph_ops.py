"""Ops per decode step: how many MLX primitives the host builds and MLX encodes for one step.

At batch 1 on a GPU a decode step is host-bound (bench/README.md, "Where batch-1 time goes"): its
cost is per op, in Python building the lazy graph and in MLX encoding each primitive. So the count
of primitives in one step's graph, and of the separate mx.compile calls that make them, track that
cost on any machine; this module counts both, for a StageHost and for mlx-lm's own decode loop.

A graph is counted with `mx.export_to_dot`: every primitive node (a fused `Compiled...` kernel
counts as one) reachable from the step's outputs and not evaluated yet. Each step is evaluated as soon as
it is queued (its tokens still read back a step later, as `serve` runs one stage), so each step
counts its own ops only.

Columns: the step's nodes; its compiled calls and the nodes they made (what MLX replays from a
trace, no Python); the nodes inside the kernels' calls (paged attention, the Gated DeltaNet
recurrence); the others, built op by op in Python (the nodes less those two). On MLX's CPU backend
the kernels' calls are their references' ops (gathers and SDPA, mlx-lm's recurrence ops), and the
fast ops (RMSNorm, RoPE, SDPA) are their fallbacks' several primitives; on a GPU each kernel call
is one node (two with a split-KV reduce), so `nodes - kernel nodes + kernel calls` is nearer what
the same step is on a GPU. MLX builds a node in about the same host time whether a trace replays
it or Python calls it (about 0.4 us for a matmul here), so the node count, not the number of
compiled calls, is the proxy; compiling pays where it fuses elementwise ops into one node and
where it skips Python modules' own overhead.

  python3 bench/graph_ops.py FOLDER [FOLDER ...] [--steps 4] [--as-gpu] [--mlx-lm] [--compile on|off|both]
"""

import argparse
import contextlib
import io
import json
import re
import sys
from collections import Counter
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from scheduler_double import SchedulerDouble  # noqa: E402

from metal_cluster.proto import PROTO_VERSION, pb  # noqa: E402

BLOCK_SIZE = 16
PROMPT = list(range(1000, 1040))
_NODE = re.compile(r'\[label ="([^"]*)", shape=rectangle\]')


def graph_ops(arrays) -> Counter:
    """Primitive nodes of the unevaluated graph behind `arrays`, by primitive name."""
    arrays = [a for a in _flat(arrays) if isinstance(a, mx.array)]
    if not arrays:
        return Counter()
    out = io.StringIO()
    mx.export_to_dot(out, *arrays)
    return Counter(_NODE.findall(out.getvalue()))


def _flat(tree):
    if isinstance(tree, (list, tuple)):
        for t in tree:
            yield from _flat(t)
    elif isinstance(tree, dict):
        for t in tree.values():
            yield from _flat(t)
    else:
        yield tree


@contextlib.contextmanager
def gpu_dtypes():
    """Build the shard as on a GPU (the model's dtype, quantized weights kept quantized) on any
    backend: the ops a GPU step builds, but for attention, which the CPU serves by the reference."""
    from metal_cluster.stage_worker.model import dtypes

    original = dtypes.on_gpu
    dtypes.on_gpu = lambda: True
    try:
        yield
    finally:
        dtypes.on_gpu = original


def _nodes(arrays) -> int:
    return sum(graph_ops(arrays).values())


class Counts:
    """What one step built: compiled calls and the nodes they made, attention's calls and nodes."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.compiled_calls = self.traced = self.attention_calls = self.attention = 0


@contextlib.contextmanager
def counting(counts: Counts):
    """Count compiled calls (every `compiled.Traced` call that takes its trace) and the nodes they
    make, and the nodes of the kernels' calls (paged attention, the Gated DeltaNet recurrence),
    while a step is built."""
    from metal_cluster.stage_worker.families import qwen3_next
    from metal_cluster.stage_worker.step import attention
    from metal_cluster.stage_worker.step.tracing import compiled

    real_call = compiled.Traced.__call__

    def counted_call(traced, *args):
        out = real_call(traced, *args)
        if traced.owner.switch.on:
            counts.compiled_calls += 1
            counts.traced += _nodes(out) - _nodes(list(args))
        return out

    real_attention = attention.paged_attention

    def counted_attention(q, k_pool, v_pool, *args, **kwargs):
        out = real_attention(q, k_pool, v_pool, *args, **kwargs)
        counts.attention_calls += 1
        inputs = [q, k_pool, v_pool] + [kwargs["sinks"]] * (kwargs.get("sinks") is not None)
        counts.attention += _nodes(out) - _nodes(inputs)
        return out

    real_recurrence = qwen3_next.gated_delta

    def counted_recurrence(*args):
        out = real_recurrence(*args)
        counts.attention_calls += 1
        counts.attention += _nodes(list(out)) - _nodes(list(args))
        return out

    compiled.Traced.__call__ = counted_call
    attention.paged_attention = counted_attention
    qwen3_next.gated_delta = counted_recurrence
    try:
        yield
    finally:
        compiled.Traced.__call__ = real_call
        attention.paged_attention = real_attention
        qwen3_next.gated_delta = real_recurrence


def build_host(folder: Path, num_blocks: int = 64, max_num_batched_tokens: int = 512):
    """A stage of all the folder's layers, built as `serve` builds one (assign, then start)."""
    from metal_cluster.stage_worker.host import StageHost

    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    host = StageHost()
    host.assign(pb.AssignRequest(version=PROTO_VERSION, model=str(folder), layer_start=0, layer_end=layers,
                                 block_size=BLOCK_SIZE, max_num_batched_tokens=max_num_batched_tokens,
                                 memory_utilization=0.5))
    host.start(pb.StartRequest(version=PROTO_VERSION, num_blocks=num_blocks, rank=0, world_size=1))
    return host


def stage_ops(host, steps: int = 4, warm: int = 2) -> dict:
    """Ops of one request's decode steps on a stage that keeps its tokens (what `serve` runs with
    one stage), the median step's: total nodes, compiled calls, attention's nodes, and by primitive."""
    from metal_cluster.stage_worker.step import runner as runner_module

    runner = host.runner
    counts = Counts()
    seen: list[tuple[Counter, int, int, int, int]] = []

    class _Mx:  # the runner's view of mx: async_eval counts the graph it is given first
        def __getattr__(self, name):
            return getattr(mx, name)

        @staticmethod
        def async_eval(*arrays):
            ops = graph_ops(list(arrays) + runner.pool.arrays)
            seen.append((ops, counts.compiled_calls, counts.traced, counts.attention, counts.attention_calls))
            # Evaluated here, so the next step counts only its own ops; its tokens are still read
            # back a step later, as under vLLM's async scheduling (the next step embeds them).
            mx.eval(*arrays, *runner.pool.arrays)

    next_id = [host.next_step]

    def step_fn(step):
        step.step_id = next_id[0]
        next_id[0] += 1
        counts.reset()
        answer = host.launch(step)
        return lambda: {s.req_id: s.token_id for s in answer().sampled}

    real_mx = runner_module.mx
    runner_module.mx = _Mx()
    try:
        with counting(counts):
            sched = SchedulerDouble(step_fn, runner.pool.num_blocks, BLOCK_SIZE, ahead=True)
            sched.add("r", PROMPT, warm + steps + 2)
            for _ in range(1 + warm):
                sched.step()
            seen.clear()
            for _ in range(steps):
                sched.step()
            sched.run()
    finally:
        runner_module.mx = real_mx
    seen = seen[:steps]
    ops, calls, traced, attn, attn_calls = sorted(seen, key=lambda s: sum(s[0].values()))[len(seen) // 2]
    total = sum(ops.values())
    return dict(nodes=total, compiled_calls=calls, traced=traced, outside=total - traced - attn, attention=attn,
                attention_calls=attn_calls, gpu_nodes=total - attn + attn_calls, by_primitive=dict(ops.most_common()))


def mlx_lm_ops(folder: Path, steps: int = 4, warm: int = 2, as_gpu: bool = False) -> dict:
    """mlx-lm's own decode loop (generate_step's pattern) on the same folder, counted the same way.
    `as_gpu`: the model's dtypes as loaded (mlx-lm's own choice on a GPU); else float32 and
    dequantized, as our CPU stage runs."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import dequantize_model, load

    model, _ = load(str(folder))
    if not as_gpu:
        model.set_dtype(mx.float32)
        dequantize_model(model)
    cache = make_prompt_cache(model)
    y = mx.argmax(model(mx.array([PROMPT]), cache=cache)[:, -1], axis=-1)
    mx.eval(y, _cache_arrays(cache))
    seen = []
    for i in range(warm + steps):
        nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        state = _cache_arrays(cache)
        ops = graph_ops([nxt] + state)
        mx.eval(nxt, state)
        if i >= warm:
            seen.append(ops)
        y = nxt
    ops = sorted(seen, key=lambda c: sum(c.values()))[len(seen) // 2]
    return dict(nodes=sum(ops.values()), by_primitive=dict(ops.most_common()))


def _cache_arrays(cache) -> list:
    # The arrays themselves: KVCache.state slices them, which would add nodes of its own.
    out = []
    for c in cache:
        out += [a for a in (getattr(c, "keys", None), getattr(c, "values", None)) if isinstance(a, mx.array)]
        out += [a for a in getattr(c, "cache", []) if isinstance(a, mx.array)]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--as-gpu", action="store_true",
                        help="build the stage in the model's dtype with quantized weights kept (as on a GPU)")
    parser.add_argument("--mlx-lm", action="store_true", help="also count mlx-lm's own decode step")
    parser.add_argument("--compile", choices=("on", "off", "both"), default="on")
    parser.add_argument("--by-primitive", action="store_true", help="print each row's primitives")
    args = parser.parse_args()
    from metal_cluster.stage_worker.step import runner as runner_module

    print(f"device: {mx.default_device()}; as on a GPU: {args.as_gpu}")
    print("| model | loop | nodes per step | compiled calls | nodes from them | kernel nodes (calls) | other nodes | "
          "nodes with 1-node kernels |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for folder in args.folders:
        rows = []
        if args.mlx_lm:
            r = mlx_lm_ops(folder, args.steps, as_gpu=args.as_gpu)
            rows.append(("mlx-lm", r))
            print(f"| {folder.name} | mlx-lm | {r['nodes']} | - | - | - | - | - |", flush=True)
        with gpu_dtypes() if args.as_gpu else contextlib.nullcontext():
            host = build_host(folder)
        for compiled in {"on": (True,), "off": (False,), "both": (False, True)}[args.compile]:
            runner_module.COMPILE = compiled
            r = stage_ops(host, args.steps)
            rows.append(("ours, " + ("compiled" if compiled else "not compiled"), r))
            print(f"| {folder.name} | {rows[-1][0]} | {r['nodes']} | {r['compiled_calls']} | {r['traced']} | "
                  f"{r['attention']} ({r['attention_calls']}) | {r['outside']} | {r['gpu_nodes']} |", flush=True)
        if args.by_primitive:
            for label, r in rows:
                print(f"  {folder.name}, {label}: {r['by_primitive']}")
        del host
        mx.clear_cache()


if __name__ == "__main__":
    main()
