"""A flood against `serve`: many concurrent streaming clients, half of them hanging up mid-stream.

Measures the server's memory (RSS of its whole process tree, sampled through the run), how many
requests got 503 + Retry-After past the queue limit, that every admitted one completed or was
hung up on, and how long after the last client the KV blocks were free again (vLLM's own pool; a single hang-up's
blocks are timed by tests/test_serve.py).

  .venv/bin/python bench/overload.py [--clients 200] [--max-num-seqs 32] [--max-waiting 32]
"""

import argparse
import concurrent.futures as cf
import os
import platform
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import tiny_models  # noqa: E402
from server_process import running_server, tree_rss  # noqa: E402


def kv_usage(url) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:kv_cache_usage_perc"):
                return float(line.split()[-1])
    return -1.0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-waiting", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="overload-"))
    model = tiny_models.build_tiny_model("llama", work / "model")
    flags = ["--gpu-memory-utilization", "0.05", "--max-model-len", "512", "--max-num-batched-tokens", "256",
             "--max-num-seqs", str(args.max_num_seqs), "--max-waiting-requests", str(args.max_waiting),
             "--served-model-name", "tiny"]
    with running_server(model, *flags, log_path=work / "server.log") as url:
        idle_rss = tree_rss(url)
        peak = [idle_rss]
        stop = threading.Event()

        def sample():
            while not stop.wait(0.2):
                peak[0] = max(peak[0], tree_rss(url))

        threading.Thread(target=sample, daemon=True).start()
        http = httpx.Client(timeout=300, limits=httpx.Limits(max_connections=args.clients,
                                                             max_keepalive_connections=0))
        barrier = threading.Barrier(args.clients)
        hung_up_at = []

        def one(i):
            barrier.wait(60)
            body = {"model": "tiny", "prompt": f"client {i}", "max_tokens": args.max_tokens, "temperature": 0,
                    "stream": True, "ignore_eos": True}
            try:
                with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        return f"{r.status_code} retry-after={r.headers.get('retry-after')}"
                    for n, line in enumerate(r.iter_lines()):
                        if i % 2 and n == 8:  # odd clients hang up after a few chunks
                            hung_up_at.append(time.monotonic())
                            return "hung up"
                        if line == "data: [DONE]":
                            return "completed"
                    return "ended without [DONE]"
            except httpx.HTTPError as e:
                return f"error {type(e).__name__}"

        started = time.monotonic()
        with cf.ThreadPoolExecutor(args.clients) as pool:
            outcomes = list(pool.map(one, range(args.clients)))
        elapsed = time.monotonic() - started
        http.close()
        done = time.monotonic()
        while kv_usage(url) > 0 and time.monotonic() - done < 30:
            time.sleep(0.02)
        freed_after = time.monotonic() - done
        stop.set()
    counts = {o: outcomes.count(o) for o in sorted(set(outcomes))}
    print(f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores; {args.clients} streaming clients, "
          f"--max-num-seqs {args.max_num_seqs} --max-waiting-requests {args.max_waiting}, max_tokens "
          f"{args.max_tokens}; run {elapsed:.1f}s")
    print(f"outcomes: {counts}")
    print(f"server RSS (process tree): idle {idle_rss / 2**20:.0f} MiB, peak {peak[0] / 2**20:.0f} MiB")
    print(f"KV free {freed_after:.2f}s after the last client finished ({len(hung_up_at)} hung up mid-stream)")


if __name__ == "__main__":
    main()
