#!/usr/bin/env python3
"""Speculative decoding's draft-model and MTP paths on the GPU machine: plain vs speculating `serve`,
side by side in one run (bench/speculative.py's `side_by_side`), at the acceptance each reaches.

Random weights, so acceptance is what the drafts happen to reach, and the drafters bracket it:
  draft-layers  the target's own first 4 of 36 layers with its embedding, final norm and head
                (gpu_serving's weights are drawn per tensor name, so a 4-layer Qwen3-8B folder holds
                exactly those): a cheap draft (layer-skip drafting); random layers all change the
                prediction, so it is seldom right (measured 2026-12-03: 0.1 %);
  draft-agree   the same draft against a target whose layers past the fourth add LATE_SCALE of
                what they would (their o_proj and down_proj scaled): a target the draft often
                agrees with, so speed is measured at an acceptance between the bounds;
  draft-small   a random Qwen3-0.6B-shaped model of the same vocab: a real draft's cost, and
                nearly every draft rejected (the lower bound);
  mtp           a random DeepSeek-V3-style MoE with MLA and one multi-token-prediction layer.
The draft models' target: gpu_serving's Qwen3-8B-shaped bf16 folder (with gpu_e2e's tokenizer), or
for draft-agree its copy with the late layers scaled.
Every answer is greedy and runs to --max-tokens (ignore_eos); per method, tokens per second per stream
and the time per target step (tokens per draft step / spec tok/s at concurrency 1) let one read off
the speed at another acceptance rate.

On the GPU machine (bench/gpu_machine.sh a, b and c: MLX CUDA and vLLM):
    python3 bench/gpu_speculative.py [--methods draft-agree,draft-layers,mtp,draft-small] [--json $OUT/gpu_speculative.json]
Here, the whole path on tiny shapes (MLX's CPU backend):
    .venv/bin/python bench/gpu_speculative.py --tiny --methods draft-layers --concurrency 1 --repeats 1
"""

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_e2e  # noqa: E402  (the Qwen3-8B folder and its tokenizer; puts tests/ on the path)
import gpu_serving  # noqa: E402
import speculative  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

DRAFT_TOKENS = 4
MTP_TOKENS = 2
DRAFT_LAYERS = 4
LATE_SCALE = 0.1  # draft-agree: how much the target's layers past the draft's still add
# Qwen3-0.6B's shape (tied embedding), on Qwen3-8B's vocab.
QWEN3_06B = {**gpu_serving.QWEN3_8B, "num_hidden_layers": 28, "hidden_size": 1024, "intermediate_size": 3072,
             "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True}
# DeepSeek-V3's attention and MoE at a size a random draw writes in seconds: MLA at V3's ranks and
# head sizes, 32 routed experts (4 per token) and a shared one, one MTP layer after 8 layers.
MTP_SHAPE = dict(num_layers=8, hidden_size=2048, intermediate_size=8192, num_heads=16, num_kv_heads=16,
                 config_overrides=dict(kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                       v_head_dim=128, head_dim=64, n_routed_experts=32, num_experts_per_tok=4,
                                       moe_intermediate_size=1024, n_group=4, topk_group=2, vocab_size=32000,
                                       max_position_embeddings=8192))
TINY_MTP_SHAPE = dict(num_layers=4, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=4,
                      config_overrides=dict(vocab_size=1024))


def qwen3_folder(work_dir: Path, config: dict, tiny: bool) -> Path:
    folder = gpu_serving.ensure_folders(work_dir, config, ["bf16"], tiny)["bf16"]
    gpu_e2e.write_tokenizer(folder, config["vocab_size"])
    return folder


def agreeing_target(work_dir: Path, config: dict, layers: int, tiny: bool) -> Path:
    """The Qwen3-8B-shaped folder with the output projections of every layer past `layers` scaled by
    LATE_SCALE: the first layers, embedding and head are the plain folder's, the rest perturb less."""
    marked = {**config, "bench_late_layer_scale": LATE_SCALE, "bench_late_layer_start": layers}
    folder = work_dir / (gpu_serving.folder_names(work_dir, config, tiny)["bf16"].name + f"-late{LATE_SCALE}")
    if not gpu_serving.complete(folder, marked):
        model = gpu_serving.random_model(config)
        for layer in model.model.layers[layers:]:
            layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * LATE_SCALE
            layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * LATE_SCALE
        gpu_serving.write_folder(folder, model, marked, tiny)
        del model
        gpu_serving.free()
    gpu_e2e.write_tokenizer(folder, config["vocab_size"])
    return folder


def mtp_folder(work_dir: Path, tiny: bool) -> Path:
    shape = TINY_MTP_SHAPE if tiny else MTP_SHAPE
    folder = work_dir / ("deepseek-v3-mtp-small" if tiny else "deepseek-v3-mtp-8l")
    if not (folder / ".bench-complete").is_file():
        build_tiny_model("deepseek_v3", folder, dtype="bfloat16", mtp_layers=1, **shape)
        (folder / ".bench-complete").write_text("{}")
    gpu_e2e.write_tokenizer(folder, shape["config_overrides"]["vocab_size"])
    return folder


def plan(method: str, work_dir: Path, tiny: bool) -> tuple[Path, dict]:
    """(target folder, speculative config) of a method."""
    target_config = gpu_serving.SHAPES["qwen3-8b"][1 if tiny else 0]
    if method == "mtp":
        return mtp_folder(work_dir, tiny), {"method": "mtp", "num_speculative_tokens": MTP_TOKENS}
    if method in ("draft-layers", "draft-agree"):
        layers = min(DRAFT_LAYERS, target_config["num_hidden_layers"] - 1)
        draft_config = {**target_config, "num_hidden_layers": layers}
    else:
        draft_config = {**QWEN3_06B, "vocab_size": target_config["vocab_size"]}
        if tiny:
            draft_config.update(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=64)
    draft = qwen3_folder(work_dir, draft_config, tiny)
    target = (agreeing_target(work_dir, target_config, layers, tiny) if method == "draft-agree"
              else qwen3_folder(work_dir, target_config, tiny))
    return target, {"method": "draft_model", "model": str(draft), "num_speculative_tokens": DRAFT_TOKENS}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", default="draft-agree,draft-layers,mtp,draft-small")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/gpu-serving"))
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, for MLX's CPU backend")
    parser.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu_speculative.json")
    args = parser.parse_args()
    speculative.IGNORE_EOS = True
    levels = [int(c) for c in args.concurrency.split(",")]
    server_args = ["--max-model-len", "2048", "--max-num-batched-tokens", "2048", "--max-num-seqs", "16",
                   "--gpu-memory-utilization", "0.3"]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
               "machine": f"{platform.machine()} {os.cpu_count()} cores", "device": gpu_serving.device_info(),
               "versions": gpu_serving.versions(), "max_tokens": args.max_tokens, "methods": {}}
    tables = []
    for method in args.methods.split(","):
        target, config = plan(method, args.work_dir, args.tiny)
        gpu_serving.free()  # the servers get the device's memory
        speculative.SERVED = target.name
        print(f"{method}: target {target}, {json.dumps(config)}", flush=True)
        with tempfile.TemporaryDirectory() as logs:
            try:
                rows = speculative.side_by_side(str(target), config, 1, levels, args.repeats, args.max_tokens,
                                                Path(logs), server_args)
            except Exception as e:  # one method's failure (a log tail) must not lose the others' numbers
                print(f"{method}: failed: {e}", flush=True)
                results["methods"][method] = {"config": config, "error": str(e)[-4000:]}
                continue
        for r in rows:  # ms per target step of one stream: what a step costs, whatever the acceptance
            r["ms_per_step"] = 1000 * r["tokens_per_step"] / (r["spec"] / r["concurrency"])
        results["methods"][method] = {"target": target.name, "config": config, "rows": rows}
        tables.append(f"{method} ({target.name}):\n" + speculative.table(rows, method))
        args.json.write_text(json.dumps(results, indent=1))
        print(tables[-1], flush=True)
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
