"""Multi-LoRA throughput: 4 adapters mixed in one batch vs the base model alone, on one server.

One `metal-cluster serve` of SmolLM2-135M (the embedded default) with --enable-lora and four random
PEFT adapters (rank 16 on every linear module of every layer: the most work an adapter adds).
The same greedy workload runs twice: every request on the base model, then the requests spread
round-robin over the four adapters (--max-loras 4, so each step mixes them). Aggregate output
tokens/s of each, and the ratio.

  .venv/bin/python bench/lora.py [--concurrency 16] [--requests 48] [--max-tokens 64] [--rank 16]
"""

import argparse
import concurrent.futures as cf
import platform
import sys
import tempfile
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from lora_fixtures import ATTENTION, MLP, random_pairs, write_peft  # noqa: E402
from server_process import running_server  # noqa: E402

from metal_cluster.stage_worker.model.model_source import resolve_model  # noqa: E402

PROMPTS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?", "Say hello in Spanish.",
           "What day comes after Monday?", "Give me a fruit.", "What is water made of?", "Count to three."]


def workload(client, models, concurrency, requests, max_tokens) -> float:
    def one(i):
        r = client.completions.create(model=models[i % len(models)], prompt=PROMPTS[i % len(PROMPTS)],
                                      max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    began = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(requests)))
    return tokens / (time.perf_counter() - began)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    folder = resolve_model(None).folder
    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    names = [f"adapter{i}" for i in range(4)]
    modules = ATTENTION + MLP
    for i, name in enumerate(names):
        pairs = {k: (a, b / 8) for k, (a, b) in random_pairs(folder, modules, args.rank, seed=i).items()}
        write_peft(work / name, pairs, args.rank, 2.0 * args.rank, modules)
    lora = ["--enable-lora", "--max-loras", "4", "--max-lora-rank", str(args.rank),
            "--lora-modules", *(f"{n}={work / n}" for n in names)]
    with running_server(None, "--max-model-len", "1024", "--max-num-seqs", "32", *lora,
                        log_path=work / "server.log", timeout=600) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
        base_model = client.models.list().data[0].id
        workload(client, [base_model], args.concurrency, args.concurrency, 8)  # warm-up
        results = {"base": [], "4 adapters": []}
        for _ in range(args.rounds):  # interleaved, so drifting load on the machine hits both alike
            results["base"].append(workload(client, [base_model], args.concurrency, args.requests, args.max_tokens))
            results["4 adapters"].append(workload(client, names, args.concurrency, args.requests, args.max_tokens))
    base, mixed = max(results["base"]), max(results["4 adapters"])
    print(f"machine: {platform.machine()} {platform.system()}; {args.requests} requests x {args.max_tokens} tokens, "
          f"concurrency {args.concurrency}, adapters rank {args.rank} on {len(modules)} modules x every layer")
    print(f"| workload | output tok/s (best of {args.rounds}) | all rounds |")
    print("|---|---:|---|")
    for name, runs in results.items():
        print(f"| {name} | {max(runs):.1f} | {', '.join(f'{r:.1f}' for r in runs)} |")
    print(f"ratio 4 adapters / base: {mixed / base:.2f}x")


if __name__ == "__main__":
    main()
