"""Speculative decoding vs none, side by side in one run: output tokens/s on a workload whose
answers repeat the prompt (edit / proofread a given text), the embedded SmolLM2 over 1 and 3 stages.

  .venv/bin/python bench/speculative.py [--stages 1,3] [--concurrency 1,8] [--max-tokens 96] [--workload repeat|free]
      [--method ngram|draft-self|draft-random|mtp] [--model FOLDER]

For each stage count a plain server and a speculating one (`--speculative-config`) run side by
side, and the measurements alternate between them (plain c=1, spec c=1, plain c=8, ...; `--repeats`
times; medians), so a change in the machine's load hits both alike. Every request is greedy and
streams; the answers must be the same on both sides (checked).

Methods: `ngram` (prompt lookup), or a draft model (`draft_model`) on the last stage: SmolLM2's own
GGUF as its draft (`draft-self`: every draft accepted, at the price of running the model k more
times a step: the upper bound of acceptance) or a random 2-layer llama of SmolLM2's vocabulary
(`draft-random`: nearly every draft rejected, the draft costs next to nothing: the lower bound).
No small sibling of SmolLM2-135M is available offline.

`mtp`: the checkpoint's own multi-token-prediction layers on the last stage (`--model`, a folder of
a checkpoint that carries them, e.g. DeepSeek V3's `num_nextn_predict_layers`; served with
`num_speculative_tokens` MTP_TOKENS). Without `--model`, a random DeepSeek V3 (hidden 512, 8 layers
and one MTP layer) is built: its drafts are seldom right, so that run is the MTP pass's cost, the
lower bound; the acceptance a real checkpoint reaches is in its row.
"""

import argparse
import concurrent.futures as cf
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from server_process import running_servers  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
DRAFT_TOKENS = 4
MTP_TOKENS = 2  # DeepSeek V3 has one MTP layer; vLLM applies it again for each further draft
TEXTS = [
    "The meeting is moved from Tuesday to Thursday at ten o'clock in the small room on the second floor. "
    "Please bring the budget figures for the third quarter and the draft of the new travel policy.",
    "Our cluster turns several Macs on one network into a single server: each one runs a range of the "
    "model's layers and keeps its own cache, and the hidden states travel from one machine to the next.",
    "To reset the router, hold the small button on the back for ten seconds until the light blinks "
    "orange, then wait two minutes and connect again with the password printed on the label.",
    "The library opens at nine on weekdays and at eleven on Sundays. Books can be returned at the desk "
    "or in the box by the door, and late returns cost twenty cents a day.",
]


FREE = ["Write a short story about a lighthouse keeper.", "Explain how bread rises, for a child.",
        "Invent a recipe with apples and cheese.", "Describe a walk through a forest in autumn."]
WORKLOAD = "repeat"
SERVED = MODEL  # the name both servers serve the model under
IGNORE_EOS = False  # random weights: every answer runs to max_tokens (bench/gpu_speculative.py)


def messages(i: int) -> list[dict]:
    if WORKLOAD == "free":  # answers that do not repeat the prompt: drafts are seldom right
        return [{"role": "user", "content": FREE[i % len(FREE)]}]
    text = TEXTS[i % len(TEXTS)]
    return [{"role": "user", "content": f"Repeat this text exactly, word for word, then stop:\n\n{text}"}]


def one(client, i: int, max_tokens: int) -> tuple[list[int], float]:
    """(token ids, seconds from the first output token to the last)."""
    stream = client.chat.completions.create(model=SERVED, messages=messages(i), max_tokens=max_tokens,
                                            temperature=0, stream=True,
                                            extra_body={"return_token_ids": True, "ignore_eos": IGNORE_EOS})
    tokens, first = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].model_extra.get("token_ids"):
            first = first or time.perf_counter()
            tokens += chunk.choices[0].model_extra["token_ids"]
    return tokens, time.perf_counter() - first


def workload(client, concurrency: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    """Output tokens/s over all streams (wall clock), and the answers in request order."""
    n = max(2, concurrency)
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda i: one(client, i, max_tokens), range(n)))
    wall = time.perf_counter() - start
    return sum(len(t) for t, _ in results) / wall, [t for t, _ in results]


def acceptance(url: str) -> tuple[float, float]:
    """(accepted / drafted tokens, mean tokens per draft step incl. the bonus) from /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            if line.startswith(f"vllm:spec_decode_{name}_total"):
                values[name] = values.get(name, 0) + float(line.split()[-1])
    drafted, accepted, drafts = (values.get(k, 0) for k in ("num_draft_tokens", "num_accepted_tokens", "num_drafts"))
    return (accepted / drafted if drafted else 0.0), (1 + accepted / drafts if drafts else 1.0)


def random_mtp_model(work: Path) -> Path:
    """A random DeepSeek V3 with one MTP layer, big enough that its passes cost something."""
    from tiny_models import build_tiny_model

    return build_tiny_model("deepseek_v3", work / "random-mtp", num_layers=8, hidden_size=512, intermediate_size=1024,
                            num_heads=8, num_kv_heads=8, mtp_layers=1, dtype="bfloat16")


def speculative_config(method: str, work: Path) -> dict:
    if method == "ngram":
        return NGRAM
    if method == "mtp":
        return {"method": "mtp", "num_speculative_tokens": MTP_TOKENS}
    from metal_cluster.stage_worker.model.model_source import resolve_model

    target = resolve_model(None)
    if method == "draft-self":
        draft = target.gguf
    else:
        from tiny_models import build_tiny_model

        vocab = target.config["vocab_size"]
        draft = build_tiny_model("llama", work / "random-draft", num_layers=2, config_overrides={"vocab_size": vocab})
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": DRAFT_TOKENS}


def side_by_side(model: str | None, spec_config: dict, stages: int, levels: list[int], repeats: int,
                 max_tokens: int, work: Path, server_args: list[str]) -> list[dict]:
    """A plain and a speculating server on `model` (None: the embedded SmolLM2), both up at once and
    measured alternately; one dict per concurrency level."""
    specs = {}
    for mode in ("plain", "spec"):
        extra = list(server_args) + (["--served-model-name", SERVED] if model else [])
        extra += ["-pp", str(stages)] if stages > 1 else []
        extra += ["--speculative-config", json.dumps(spec_config)] if mode == "spec" else []
        specs[mode] = (model, extra, work / f"{mode}-{stages}.log")
    with running_servers(specs, timeout=900) as urls:  # started together: about the time of one
        clients = {mode: openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
                   for mode, url in urls.items()}
        for client in clients.values():
            one(client, 0, 8)  # warm
        results = {}
        for _ in range(repeats):
            for c in levels:
                for mode in ("plain", "spec"):
                    rate, answers = workload(clients[mode], c, max_tokens)
                    results.setdefault((mode, c), []).append(rate)
                    results[mode, c, "answers"] = answers
                    print(f"{stages} stage(s) {mode} c={c}: {rate:.1f} tok/s (load {os.getloadavg()[0]:.1f})", flush=True)
        rate, mean = acceptance(urls["spec"])
    rows = []
    for c in levels:
        plain, spec = (statistics.median(results[m, c]) for m in ("plain", "spec"))
        a, b = results["plain", c, "answers"], results["spec", c, "answers"]
        rows.append(dict(stages=stages, concurrency=c, plain=plain, spec=spec, ratio=spec / plain, acceptance=rate,
                         tokens_per_step=mean, differ=sum(x != y for x, y in zip(a, b)), answers=len(a)))
    return rows


def table(rows: list[dict], method: str) -> str:
    lines = [f"| stages | concurrency | plain tok/s | {method} tok/s | ratio | draft acceptance | tokens per draft step | same tokens |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        same = "yes" if not r["differ"] else f"no ({r['differ']} of {r['answers']} differ)"
        lines.append(f"| {r['stages']} | {r['concurrency']} | {r['plain']:.1f} | {r['spec']:.1f} | {r['ratio']:.2f}x "
                     f"| {r['acceptance']:.0%} | {r['tokens_per_step']:.2f} | {same} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", default="1,3")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workload", choices=("repeat", "free"), default="repeat")
    parser.add_argument("--method", choices=("ngram", "draft-self", "draft-random", "mtp"), default="ngram")
    parser.add_argument("--model", help="the model folder (default: the embedded SmolLM2; for mtp a random DeepSeek V3)")
    args = parser.parse_args()
    global WORKLOAD, SERVED
    WORKLOAD = args.workload
    levels = [int(c) for c in args.concurrency.split(",")]
    print(f"machine: {platform.machine()} {platform.system()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        spec_config = speculative_config(args.method, Path(work))
        model = args.model or (random_mtp_model(Path(work)) if args.method == "mtp" else None)
        SERVED = Path(model).name if model else MODEL
        print(f"model: {model or MODEL}; speculative config: {json.dumps(spec_config)}")
        server_args = ["--max-model-len", "2048", "--max-num-batched-tokens", "512", "--max-num-seqs", "16"]
        for stages in (int(s) for s in args.stages.split(",")):
            rows += side_by_side(model and str(model), spec_config, stages, levels, args.repeats, args.max_tokens,
                                 Path(work), server_args)
    print("\n" + table(rows, args.method))
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
