"""Pipeline stages on one machine (loopback gRPC + MLX ring), SmolLM2, through the OpenAI API.

(a) decode latency: one stream, time per output token, 1 vs 2 vs 3 stages;
(b) prefill-heavy throughput: concurrent long prompts, 2 stages with overlapping steps (vLLM's
    batch queue, one step in flight per stage) vs one step at a time (METAL_CLUSTER_NO_OVERLAP=1).

  .venv/bin/python bench/pipeline.py [--threads-per-stage 1]

On a machine with fewer cores than stages x threads the stages compete for cores, so overlap
cannot show its gain there; the script prints the core count next to the numbers.
"""

import argparse
import concurrent.futures as cf
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from server_process import running_server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
LONG = " ".join(f"Line {i}: the scheduler assigns blocks to request {i % 7} and the stage runs its layers." for i in range(60))


def server(stages, work: Path, overlap=True):
    os.environ["METAL_CLUSTER_NO_OVERLAP"] = "0" if overlap else "1"
    args = ["--max-model-len", "2048", "--max-num-batched-tokens", "512", "--max-num-seqs", "16"]
    if stages > 1:
        args += ["-pp", str(stages)]
    return running_server(None, *args, log_path=work / f"pp{stages}-{overlap}.log", timeout=600)


def decode_ms_per_token(client, n=48):
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=n, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    stamps = [time.perf_counter() for c in stream if c.choices and c.choices[0].text is not None]
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # skip prefill
    return 1000 * statistics.median(gaps)


def prefill_tokens_per_s(client, requests=8):
    # A fresh nonce in front of every prompt: no run may hit the prefix cache of an earlier one.
    nonce = time.time_ns()
    prompts = [f"Request {nonce}-{i}. {LONG}" for i in range(requests)]

    def one(p):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=1, temperature=0)
        return r.usage.prompt_tokens

    start = time.perf_counter()
    with cf.ThreadPoolExecutor(requests) as pool:
        tokens = sum(pool.map(one, prompts))
    return tokens / (time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads-per-stage", type=int, default=1, help="OPENBLAS_NUM_THREADS for every stage")
    args = p.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads_per_stage)
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    decode = {}
    for stages in (1, 2, 3):
        with server(stages, work) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
            decode_ms_per_token(client, 8)  # warm
            decode[stages] = statistics.median(decode_ms_per_token(client) for _ in range(3))
            print(f"decode, {stages} stage(s): {decode[stages]:.1f} ms/token", flush=True)
    prefill = {}
    for overlap in (False, True):
        with server(2, work, overlap) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
            prefill_tokens_per_s(client, 2)  # warm
            prefill[overlap] = statistics.median(prefill_tokens_per_s(client) for _ in range(3))
            print(f"prefill-heavy, 2 stages, overlap={overlap}: {prefill[overlap]:.0f} prompt tokens/s", flush=True)
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores; OPENBLAS_NUM_THREADS={args.threads_per_stage}")
    for stages in (2, 3):
        extra = (decode[stages] / decode[1] - 1) / (stages - 1)
        print(f"decode: {stages} stages vs 1: {decode[stages] / decode[1]:.2f}x time per token "
              f"({100 * extra:+.1f}% per extra stage)")
    print(f"prefill-heavy: overlapping vs one step at a time: {prefill[True] / prefill[False]:.2f}x")


if __name__ == "__main__":
    main()
