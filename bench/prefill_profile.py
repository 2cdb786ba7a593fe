"""What a new request's prompt costs one stage, beside mlx-lm's own prefill of the same tokens.

The stage is built as `serve` builds it (StageHost assign + start from a model folder: the
default model as float32 safetensors unless one is given, so that mlx-lm loads the same weights). Timed, median of --repeats:
- `alone`: one step that prefills a --prompt-len prompt in one chunk (what a quiet server does);
- `with N decodes`: the same prompt in a step that also decodes N running requests (what vLLM's
  chunked prefill schedules when a request arrives at concurrency N + 1);
- `N decodes`: those decodes alone (the part of the mixed step a prefill does not cause);
- `mlx-lm`: mlx-lm's model (the same folder) over the same prompt into its own KV cache, then the argmax (what
  mlx_lm.server's prefill runs).

  .venv/bin/python bench/prefill_profile.py [FOLDER] [--prompt-len 1024] [--decodes 7] [--repeats 5]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx  # noqa: E402 (imported again after the re-exec below; cheap)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import graph_ops  # noqa: E402
from scheduler_double import SchedulerDouble  # noqa: E402

BLOCK = graph_ops.BLOCK_SIZE


def stage_times(folder: Path, prompt_len: int, decodes: int, repeats: int) -> dict[str, float]:
    blocks_per_prompt = -(-(prompt_len + 8) // BLOCK) + 1
    host = graph_ops.build_host(folder, num_blocks=decodes * 8 + 2 * blocks_per_prompt + 16,
                                max_num_batched_tokens=prompt_len + decodes)
    last = {"s": 0.0}
    next_id = [host.next_step]  # a stage runs step ids strictly in order

    def step_fn(step):
        step.step_id = next_id[0]
        next_id[0] += 1
        t0 = time.perf_counter()
        response = host.launch(step)()
        last["s"] = time.perf_counter() - t0
        return {s.req_id: s.token_id for s in response.sampled}

    sched = SchedulerDouble(step_fn, host.runner.pool.num_blocks, BLOCK)
    prompt = [1000 + (i * 7) % 4000 for i in range(prompt_len)]
    mixed, alone, decoding = [], [], []
    for r in range(repeats + 1):  # the first round warms up (compiles) and is dropped
        sched.add(f"a{r}", prompt, 1)  # alone: nothing else runs
        sched.step()
        alone.append(last["s"])
        sched.step()  # tells the stage it finished
        for k in range(decodes):
            sched.add(f"d{r}.{k}", prompt[:32], 1 << 20)
        for _ in range(3):
            sched.step()  # their prompts, then decodes
        sched.add(f"m{r}", prompt, 1)
        sched.step()
        mixed.append(last["s"])
        sched.step()
        decoding.append(last["s"])
        for k in range(decodes):
            req = sched.reqs[f"d{r}.{k}"]
            req.max_tokens = 0  # done: the next step tells the stage
            sched.finished.append(req.req_id)
            sched.free.extend(req.block_ids)
        sched.step()
        sched.reqs = {}
    return {"alone": 1000 * statistics.median(alone[1:]),
            f"with {decodes} decodes": 1000 * statistics.median(mixed[1:]),
            f"{decodes} decodes": 1000 * statistics.median(decoding[1:])}


def mlx_lm_time(folder: Path, prompt_len: int, repeats: int) -> float:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    model, _ = load(str(folder))
    prompt = mx.array([[1000 + (i * 7) % 4000 for i in range(prompt_len)]])
    times = []
    for r in range(repeats + 1):
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        mx.eval(mx.argmax(model(prompt, cache=cache)[:, -1], axis=-1))
        if r:
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main():
    import os

    from metal_cluster.coordinator.blas import openblas_env

    env = openblas_env()
    if env.get("LD_PRELOAD") != os.environ.get("LD_PRELOAD"):  # as `serve` runs: OpenBLAS preloaded
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", nargs="?", type=Path)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--decodes", type=int, default=7)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    folder = args.folder
    if folder is None:  # the default model's GGUF as float32 safetensors, which mlx-lm loads too
        import tempfile

        from serve_vs_mlx_lm import mlx_lm_folder

        from metal_cluster.stage_worker.model.model_source import resolve_model

        folder = mlx_lm_folder(resolve_model(None), Path(tempfile.gettempdir()) / "bench-prefill")
    print(f"device: {mx.default_device()}; {folder.name}; prompt {args.prompt_len} tokens; median of {args.repeats}")
    ours = stage_times(folder, args.prompt_len, args.decodes, args.repeats)
    mx.clear_cache()
    theirs = mlx_lm_time(folder, args.prompt_len, args.repeats)
    print("| step | ms |\n|---|---:|")
    for name, ms in ours.items():
        print(f"| ours, {name} | {ms:.1f} |")
    print(f"| mlx-lm prefill | {theirs:.1f} |")
    print(f"ours alone / mlx-lm: {ours['alone'] / theirs:.2f}x")


if __name__ == "__main__":
    main()
