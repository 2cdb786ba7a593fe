"""metal-cluster serve vs mlx_lm.server: same weights, same machine, same client, one run.

Workloads (OpenAI chat API, streaming, greedy):
  agent  multi-turn conversations over a long shared system prompt (tool descriptions), each turn
         re-sending the whole history, as coding agents do: prefix reuse decides TTFT;
  short  one-line prompts.
For each server and concurrency: TTFT p50/p90 and aggregate output tokens/s.

  .venv/bin/python bench/serve_vs_mlx_lm.py [--concurrency 1 4 16] [--turns 3] [--max-tokens 32]

Both servers get OpenBLAS when the host has it. SmolLM2's GGUF is dequantized to float32 for
mlx_lm.server (it cannot read GGUF); metal-cluster reads the GGUF and dequantizes the same way.
"""

import argparse
import concurrent.futures as cf
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from server_process import free_port, running_server  # noqa: E402

from metal_cluster.coordinator.blas import openblas_env  # noqa: E402
from metal_cluster.stage_worker.model import gguf  # noqa: E402
from metal_cluster.stage_worker.model.model_source import resolve_model  # noqa: E402

TOOLS_TEXT = "\n".join(
    f"- tool_{i}(path: str, pattern: str, limit: int): searches file {i} for a pattern and returns at most "
    f"limit matching lines with their line numbers; use it before editing module {i}."
    for i in range(24)
)
SYSTEM = "You are a coding agent working in a repository. You can call these tools:\n" + TOOLS_TEXT
TASKS = ["Fix the failing test in the parser.", "Rename the config loader.", "Add logging to the scheduler.",
         "Explain the cache module.", "Find the memory leak.", "Speed up the tokenizer.",
         "Write a README section.", "Review the last change."]
SHORT = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?", "Say hello in Spanish.",
         "What day comes after Monday?", "Give me a fruit.", "What is water made of?", "Count to three."]


def mlx_lm_folder(source, cache: Path) -> Path:
    """SmolLM2 as a float32 safetensors folder mlx_lm.server can load (same weights as ours)."""
    import mlx.core as mx

    folder = cache / "smollm2-f32"
    if (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tensors, _ = gguf.read_gguf(source.gguf)
    mx.save_safetensors(str(folder / "model.safetensors"), gguf.gguf_weights(tensors, source.config),
                        metadata={"format": "mlx"})
    for f in source.folder.iterdir():
        if f.suffix == ".json" and f.name != "gguf_source.json":
            (folder / f.name).write_text(f.read_text())
    return folder


def run_one(client, model, messages, max_tokens):
    start = time.perf_counter()
    ttft, text = None, []
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True)
    chunks = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - start
            chunks += 1
            text.append(chunk.choices[0].delta.content)
    return ttft if ttft is not None else time.perf_counter() - start, chunks, "".join(text)


def agent_workload(client, model, concurrency, turns, max_tokens):
    def conversation(i):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASKS[i % len(TASKS)]}]
        results = []
        for _ in range(turns):
            ttft, n, text = run_one(client, model, messages, max_tokens)
            results.append((ttft, n))
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Continue."}]
        return results
    return _measure(conversation, concurrency)


def short_workload(client, model, concurrency, requests_each, max_tokens):
    def user(i):
        return [run_one(client, model, [{"role": "user", "content": SHORT[(i + k) % len(SHORT)]}], max_tokens)[:2]
                for k in range(requests_each)]
    return _measure(user, concurrency)


def _measure(fn, concurrency):
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        per_user = list(pool.map(fn, range(concurrency)))
    wall = time.perf_counter() - start
    rows = [r for user in per_user for r in user]
    ttfts = sorted(t for t, _ in rows)
    tokens = sum(n for _, n in rows)
    return {"ttft_p50": statistics.median(ttfts), "ttft_p90": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
            "tok_s": tokens / wall, "requests": len(rows)}


def start_mlx_lm(folder, log_path, forward_gemv: bool = False):
    """mlx_lm.server on OpenBLAS; with `forward_gemv` also behind our one-row forwarding
    (coordinator/gemv_forward.c), which `serve` has and mlx-lm does not."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(folder), "--port", str(port),
           "--temp", "0", "--decode-concurrency", "32", "--prompt-concurrency", "8"]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=openblas_env(forward_gemv=forward_gemv),
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return proc, url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"mlx_lm.server exited; see {log_path}")
            time.sleep(1)
    raise TimeoutError("mlx_lm.server did not start")


def bench_server(name, url, model, args):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
    run_one(client, model, [{"role": "user", "content": "warm up"}], 4)
    results = {}
    for c in args.concurrency:
        results[("agent", c)] = agent_workload(client, model, c, args.turns, args.max_tokens)
        results[("short", c)] = short_workload(client, model, c, args.short_requests, args.max_tokens)
        for w in ("agent", "short"):
            r = results[(w, c)]
            print(f"{name:14s} {w:5s} c={c:<3d} TTFT p50 {r['ttft_p50']:.2f}s p90 {r['ttft_p90']:.2f}s  "
                  f"{r['tok_s']:.1f} tok/s ({r['requests']} requests)", flush=True)
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--short-requests", type=int, default=2, help="short prompts per concurrent user")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()

    source = resolve_model(None)
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    folder = mlx_lm_folder(source, work)
    all_results = {}
    with running_server(None, "--max-model-len", "4096", "--max-num-seqs", "32", log_path=work / "ours.log",
                        timeout=600) as url:
        all_results["metal-cluster"] = bench_server("metal-cluster", url, "SmolLM2-135M-Instruct", args)
    proc, url = start_mlx_lm(folder, work / "mlx_lm.log")
    try:
        all_results["mlx_lm.server"] = bench_server("mlx_lm.server", url, str(folder), args)
    finally:
        os.killpg(proc.pid, 9)
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}")
    for (w, c), ours in all_results["metal-cluster"].items():
        theirs = all_results["mlx_lm.server"][(w, c)]
        print(f"{w:5s} c={c:<3d} TTFT p50 ratio (mlx_lm/ours) {theirs['ttft_p50'] / ours['ttft_p50']:.2f}x   "
              f"tok/s ratio (ours/mlx_lm) {ours['tok_s'] / theirs['tok_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({k: {f"{w}/c{c}": v for (w, c), v in r.items()} for k, r in all_results.items()}, indent=2))


if __name__ == "__main__":
    main()
