#!/usr/bin/env python3
"""Serving on a GPU: this project's stages vs mlx-lm, same model folders, same run.

Random-weight folders of Qwen3-8B (or, with --shape qwen3-30b-a3b, the MoE Qwen3-30B-A3B, or with --shape
qwen3-next 12 layers of the hybrid Qwen3-Next-80B-A3B; bf16, and mlx-lm's 4-bit
into --work-dir. Then, per format, one after the other in this process:

- mlx-lm: `mlx_lm.utils.load(folder)`; `generate_step` at batch 1, `BatchGenerator` at batch 32;
- ours, one stage: a `StageHost` in this process, assigned and started through the proto
  messages exactly as `serve` does for one machine (the host picks dtypes, pool and budget), steps
  from the tests' scheduler stand-in (tests/scheduler_double.py), one step ahead as under vLLM's
  async scheduling, which `serve` uses with one stage (--sync: one step at a time);
- ours, two stages: two local worker processes as `serve -pp 2` starts them, driven through
  `RemoteStage` + `Pipeline` (gRPC for the steps, MLX's ring between the stages).

Measured: decode tok/s at batch 1 (128-token prompt; with both sides asked for, measured with both
loaded at once in alternating rounds), decode tok/s at batch 32 over prompts of
64..2048 tokens, time to first token of one 2048-token prompt, and the batch-1 bound: the copy
bandwidth of this device (a bf16 `a * 1` over 2 GiB) over the weight bytes one decode step reads.

On the GPU machine (MLX CUDA per shared/device-mlx-cuda.md; needs grpcio, protobuf, typer, psutil,
tokenizers, numpy; the project as `metal_cluster` on PYTHONPATH):
    python3 bench/gpu_serving.py --json out.json [--sections bandwidth,mlx-lm,ours,pipeline]
        [--formats bf16,4bit] [--measures b1,batch,ttft] [--work-dir /tmp/gpu-serving] [--sync]
Here, a smoke test of every path on a tiny shape (MLX's CPU backend, about 2 minutes):
    .venv/bin/python bench/gpu_serving.py --small
"""

import argparse
import contextlib
import datetime
import gc
import importlib
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from scheduler_double import SchedulerDouble  # noqa: E402
from tiny_models import build_tokenizer  # noqa: E402

from metal_cluster.coordinator import blas  # noqa: E402
from metal_cluster.proto import PROTO_VERSION, pb  # noqa: E402

BLOCK_SIZE = 16
FORMATS = ("bf16", "4bit")
SECTIONS = ("bandwidth", "mlx-lm", "ours", "pipeline")
MEASURES = ("b1", "batch", "ttft")
PIPELINE_STAGES = 2

QWEN3_8B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_hidden_layers=36, hidden_size=4096,
    intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16",
    max_position_embeddings=40960, hidden_act="silu", attention_bias=False, rope_scaling=None,
)
# Qwen3-30B-A3B: 128 experts, 8 per token, every layer MoE (served 4-bit: bf16 would be 61 GB).
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=48, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, torch_dtype="bfloat16", max_position_embeddings=40960, hidden_act="silu",
    attention_bias=False, rope_scaling=None,
)
# Qwen3-Next-80B-A3B's layers (Gated DeltaNet : attention 3 : 1, 512 experts, 10 per token), 12 of
# its 48 (3 attention layers): per-layer costs are the model's, and 4-bit random weights fit the
# device's disk twice over (mlx-lm's folder and ours are one).
QWEN3_NEXT = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", num_hidden_layers=12, hidden_size=2048,
    intermediate_size=5120, moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=512,
    num_experts_per_tok=10, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_value_heads=32,
    linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    full_attention_interval=4, partial_rotary_factor=0.25, vocab_size=151936, rope_theta=10000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16", max_position_embeddings=262144,
    hidden_act="silu", attention_bias=False, rope_scaling=None,
)
# Same family and code paths, small enough for MLX's CPU backend; head_dim stays a multiple of 32
# and every matrix's input a multiple of 64, so the paged kernel and 4-bit group-64 both apply.
SMALL = {**QWEN3_8B, "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 768,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096}
SMALL_MOE = {**QWEN3_30B_A3B, "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 768,
             "moe_intermediate_size": 128, "num_experts": 16, "num_experts_per_tok": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096}
SMALL_NEXT = {**QWEN3_NEXT, "num_hidden_layers": 4, "hidden_size": 256, "moe_intermediate_size": 128,
              "shared_expert_intermediate_size": 128, "num_experts": 16, "num_experts_per_tok": 4,
              "num_attention_heads": 4, "head_dim": 64, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
              "linear_key_head_dim": 64, "linear_value_head_dim": 64, "vocab_size": 4096}
SHAPES = {"qwen3-8b": (QWEN3_8B, SMALL), "qwen3-30b-a3b": (QWEN3_30B_A3B, SMALL_MOE),
          "qwen3-next": (QWEN3_NEXT, SMALL_NEXT)}


@dataclass
class Workload:
    decode_prompt: int = 128  # batch-1 decode
    warm: int = 4  # decode steps before timing (kernel compiles, allocator)
    steps: int = 64  # timed decode steps
    batch: int = 32
    mixed_min: int = 64  # batch prompts spread evenly over [mixed_min, mixed_max]
    mixed_max: int = 2048
    ttft_prompt: int = 2048
    ttft_repeats: int = 3  # after one untimed warm-up
    b1_rounds: int = 9  # batch 1, both sides loaded at once: alternating rounds of `steps` each
    max_batched_tokens: int = 2048  # what `serve` passes as --max-num-batched-tokens
    copy_bytes: int = 2 << 30
    copy_iters: int = 10


# MLX's CPU quantized matmul runs at well under 1 GFLOP/s: short prompts keep mlx-lm's 4-bit side
# to seconds. The batch's prompts still take several chunked-prefill steps on our side.
SMALL_WORKLOAD = Workload(warm=2, steps=8, batch=4, mixed_min=32, mixed_max=128, ttft_prompt=128, ttft_repeats=1,
                          b1_rounds=2,
                          max_batched_tokens=128, copy_bytes=64 << 20, copy_iters=5)


def dtype_str(dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def use_openblas() -> None:
    """On MLX's CPU backend, the same BLAS for this process (mlx-lm and the in-process stage) as
    `serve` gives its worker processes: re-executed once with OpenBLAS preloaded where there is one."""
    lib = blas.find_openblas()
    if lib and lib not in os.environ.get("LD_PRELOAD", ""):
        os.execve(sys.executable, [sys.executable, *sys.argv], blas.openblas_env())


def free() -> None:
    """Give back what the last section held, so the next one starts with the device's memory."""
    gc.collect()
    mx.clear_cache()


# --- model folders --------------------------------------------------------------------------

def folder_names(work_dir: Path, config: dict, small: bool) -> dict[str, Path]:
    tag = config["model_type"].replace("_", "-") + ("-small" if small else f"-{config['num_hidden_layers']}l")
    return {fmt: work_dir / f"{tag}-{fmt}" for fmt in FORMATS}


def complete(folder: Path, config: dict) -> bool:
    """A folder counts only when its marker says it was fully written for this very shape."""
    marker = folder / ".bench-complete"
    return marker.is_file() and json.loads(marker.read_text()) == config


def ensure_folders(work_dir: Path, config: dict, formats, small: bool) -> dict[str, Path]:
    folders = folder_names(work_dir, config, small)
    missing = [f for f in formats if not complete(folders[f], config)]
    if not missing:
        print(f"model folders: reusing {', '.join(str(folders[f]) for f in formats)}", flush=True)
        return folders
    from mlx_lm.utils import quantize_model

    started = time.perf_counter()
    model = random_model(config)
    if "bf16" in missing:
        write_folder(folders["bf16"], model, config, small)
    if "4bit" in missing:
        # mlx-lm's own conversion: nn.quantize over every Linear/Embedding whose input is a multiple
        # of the group, and the config gains "quantization" (and "quantization_config").
        model, qconfig = quantize_model(model, dict(config), group_size=64, bits=4)
        write_folder(folders["4bit"], model, qconfig, small)
    del model
    free()
    print(f"model folders: wrote {', '.join(missing)} in {time.perf_counter() - started:.0f}s", flush=True)
    return folders


def random_model(config: dict):
    """mlx-lm's model class with random bf16 weights drawn on the device (std 0.02, norms 1).

    One key per tensor, derived from its name: the same weights whichever folders are missing."""
    from mlx.utils import tree_flatten

    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))  # lazy: its own init is never evaluated
    weights = []
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            w = mx.ones(p.shape, dtype=mx.bfloat16)
        else:
            w = mx.random.normal(p.shape, dtype=mx.bfloat16, scale=0.02, key=mx.random.key(zlib.crc32(name.encode())))
        mx.eval(w)  # one tensor at a time: no float32 copy of the whole model at once
        weights.append((name, w))
    model.load_weights(weights)  # strict: names and shapes are mlx-lm's
    return model


def write_folder(folder: Path, model, config: dict, small: bool) -> None:
    """What a served folder holds (see stage_worker/model/model_source.py): config.json, a tokenizer and
    model*.safetensors with their index, as mlx_lm.utils.save_model shards them."""
    from mlx_lm import utils as mlx_lm_utils

    if folder.exists():
        shutil.rmtree(folder)
    with small_shards(mlx_lm_utils, small):
        mlx_lm_utils.save_model(folder, model)
    mlx_lm_utils.save_config(dict(config), folder / "config.json")
    # The stage never tokenizes; mlx_lm.load wants a tokenizer it can build (the vocab mismatch is fine).
    tok = build_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"}))
    # Written last, keyed by the shape before quantization: see `complete`.
    base = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    (folder / ".bench-complete").write_text(json.dumps(base))


@contextlib.contextmanager
def small_shards(mlx_lm_utils, small: bool):
    """save_model shards at 5 GB, so the tiny model would be one file: split it in about three, so that
    --small loads a sharded folder (model-0000x-of-0000y + index) like the real one."""
    if not small:
        yield
        return
    original = mlx_lm_utils.make_shards

    def three(weights):
        limit = sum(v.nbytes for v in weights.values()) // 3 + 1
        shards, size = [], 0
        for k, v in weights.items():
            if not shards or size + v.nbytes > limit:
                shards.append({})
                size = 0
            shards[-1][k] = v
            size += v.nbytes
        return shards

    mlx_lm_utils.make_shards = three
    try:
        yield
    finally:
        mlx_lm_utils.make_shards = original


def tensor_bytes(folder: Path) -> dict[str, int]:
    """Bytes of every tensor in the folder's safetensors, from their headers (nothing is loaded)."""
    from metal_cluster.stage_worker.model.checkpoint_sizes import read_headers

    return {name: t["data_offsets"][1] - t["data_offsets"][0] for name, t in read_headers(folder).items()}


def weight_bytes(folder: Path, config: dict) -> dict:
    """All weight bytes, and those one decode step reads: everything but the input embedding's
    table when the head is untied (a step reads one row of it per token). KV reads at these short
    contexts are under 1 % of the weights and left out."""
    sizes = tensor_bytes(folder)
    total = sum(sizes.values())
    embed = sum(v for k, v in sizes.items() if k.startswith("model.embed_tokens."))
    per_token = total - embed if not config.get("tie_word_embeddings") else total
    if config.get("num_experts"):  # a batch-1 step reads only its token's experts
        experts = sum(v for k, v in sizes.items() if ".switch_mlp." in k)
        per_token -= experts * (1 - config["num_experts_per_tok"] / config["num_experts"])
    return dict(weight_bytes=total, weight_bytes_per_token=per_token, shards=len(list(folder.glob("model*.safetensors"))))


# --- workload ---------------------------------------------------------------------------------

def prompt(length: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(length)]


def mixed_lengths(wl: Workload) -> list[int]:
    n = wl.batch
    return [round(wl.mixed_min + (wl.mixed_max - wl.mixed_min) * i / max(1, n - 1)) for i in range(n)]


def batch_prompts(wl: Workload, vocab: int) -> list[list[int]]:
    return [prompt(n, vocab, seed=1000 + i) for i, n in enumerate(mixed_lengths(wl))]


def blocks_needed(wl: Workload) -> int:
    """KV blocks the largest measurement holds at once (the batch: its prompts, the tokens decoded
    while the later prompts are still prefilling, warm-up and timed steps), plus the null block."""
    lengths = mixed_lengths(wl)
    prefill_steps = -(-sum(lengths) // wl.max_batched_tokens) + len(lengths)
    gen = prefill_steps + wl.warm + wl.steps + 2
    batch = sum(-(-(n + gen) // BLOCK_SIZE) for n in lengths)
    single = -(-max(wl.ttft_prompt, wl.decode_prompt + wl.warm + wl.steps + 2) // BLOCK_SIZE)
    return 1 + max(batch, single) + 8


# --- copy bandwidth ---------------------------------------------------------------------------

def copy_bandwidth(nbytes: int, iters: int) -> dict:
    """(bytes read + bytes written) / time of a bf16 `a * 1`, each evaluated on its own."""
    a = mx.random.normal((nbytes // 2,), dtype=mx.bfloat16)
    mx.eval(a)
    for _ in range(3):
        mx.eval(a * 1)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        mx.eval(a * 1)
        times.append(time.perf_counter() - t0)
    moved = 2 * a.nbytes
    del a
    free()
    return dict(array_bytes=nbytes, iters=iters, median_bytes_per_s=moved / statistics.median(times),
                best_bytes_per_s=moved / min(times))


# --- mlx-lm -----------------------------------------------------------------------------------

def mlx_lm_side(folder: Path, config: dict, wl: Workload, measures) -> dict:
    from mlx_lm.utils import load

    t0 = time.perf_counter()
    model, _ = load(str(folder))
    out = dict(load_s=time.perf_counter() - t0)
    vocab = config["vocab_size"]
    try:
        if "b1" in measures:
            out["decode_b1"] = mlx_lm_batch1(model, prompt(wl.decode_prompt, vocab, 1), wl.warm, wl.steps)
            print(f"  mlx-lm decode b1: {out['decode_b1']['tok_s']:.1f} tok/s", flush=True)
        if "batch" in measures:
            out["decode_batch"] = mlx_lm_batched(model, batch_prompts(wl, vocab), wl.warm, wl.steps)
            print(f"  mlx-lm decode batch {wl.batch}: {out['decode_batch']['tok_s']:.1f} tok/s", flush=True)
        if "ttft" in measures:
            out["ttft"] = mlx_lm_ttft(model, prompt(wl.ttft_prompt, vocab, 2), wl.ttft_repeats)
            print(f"  mlx-lm TTFT {wl.ttft_prompt}: {1000 * out['ttft']['seconds']:.1f} ms", flush=True)
    finally:
        del model
        free()
    return out


def mlx_lm_batch1(model, tokens: list[int], warm: int, steps: int) -> dict:
    from mlx_lm.generate import generate_step

    t0 = None
    for i, _ in enumerate(generate_step(mx.array(tokens), model, max_tokens=warm + steps)):
        if i == warm - 1:
            t0 = time.perf_counter()
    dt = time.perf_counter() - t0
    return dict(tok_s=steps / dt, tokens=steps, seconds=dt)


def mlx_lm_batched(model, prompts: list[list[int]], warm: int, steps: int) -> dict:
    """BatchGenerator as mlx-lm ships it (prefill batches of 8, right-padded), all rows decoding
    together before timing starts; no row may finish inside the timed steps."""
    from mlx_lm.generate import BatchGenerator

    n = len(prompts)
    gen = BatchGenerator(model, max_tokens=warm + steps + 4 * n + 16, completion_batch_size=n)
    try:
        gen.insert(prompts)
        full = 0
        while full < warm:  # prefills (with the first rows already decoding), then full-batch steps
            if len(gen.next_generated()) == n:
                full += 1
        t0 = time.perf_counter()
        tokens = sum(len(gen.next_generated()) for _ in range(steps))
        dt = time.perf_counter() - t0
    finally:
        gen.close()
    return dict(tok_s=tokens / dt, tokens=tokens, seconds=dt, prompt_lengths=[len(p) for p in prompts])


def mlx_lm_ttft(model, tokens: list[int], repeats: int) -> dict:
    """From the call to the first token in hand: the prompt's prefill (2048-token chunks) and the
    first sample; the first run is an untimed warm-up."""
    from mlx_lm.generate import generate_step, generation_stream

    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        gen = generate_step(mx.array(tokens), model, max_tokens=1)
        next(gen)
        dt = time.perf_counter() - t0
        gen.close()
        mx.synchronize(generation_stream)  # the step it queued behind the first token, outside the timing
        if i:
            times.append(dt)
    return dict(seconds=statistics.median(times), all_s=times)


# --- ours: steps from the scheduler stand-in ---------------------------------------------------

class Driver:
    """The tests' scheduler stand-in feeding one stage or a pipeline, with vLLM's chunked prefill
    (`max_batched_tokens` per step).

    `send(step)` queues a step and returns the function that waits for its StepResponse. With
    `ahead` the stand-in runs like vLLM's async scheduler (what `serve` does with one stage): each
    step is launched before the previous one's tokens are read back, and the stage keeps its tokens.
    """

    def __init__(self, send, num_blocks: int, max_batched_tokens: int, ahead: bool):
        self.next_id = 0
        self.send = send
        self.last_step, self.last_sent = None, 0.0  # the last StepRequest sent and when; each step's round trip
        self.round_trips: list[float] = []

        def step_fn(step):
            # A stage runs step ids strictly in order, and the stand-in's ahead mode skips the ids of
            # the empty steps it does not send: number what is actually sent.
            step.step_id = self.next_id
            self.next_id += 1
            self.last_step = step
            self.last_sent = sent = time.perf_counter()
            answer = send(step)

            def tokens():
                sampled = answer().sampled
                self.round_trips.append(time.perf_counter() - sent)
                return {s.req_id: s.token_id for s in sampled}

            return tokens if ahead else tokens()

        self.sched = SchedulerDouble(step_fn, num_blocks, BLOCK_SIZE, max_batch_tokens=max_batched_tokens, ahead=ahead)
        self.count = 0

    def add(self, prompts: list[list[int]], max_tokens: int) -> list[str]:
        ids = []
        for p in prompts:
            ids.append(f"r{self.count}")
            self.sched.add(ids[-1], p, max_tokens)
            self.count += 1
        return ids

    def step(self) -> dict:
        """One call of the stand-in: the tokens of the step read back by it (ahead: the previous one)."""
        return self.sched.step()[1]

    def finish_all(self) -> None:
        """End every running request with the tokens it has (and the one in flight), and tell the
        stage, so the next measurement starts with an empty table, all blocks free, nothing in flight."""
        sched = self.sched
        for req in sched.reqs.values():
            if req.done:
                continue
            req.max_tokens = len(req.output) + req.placeholders
            if not req.placeholders:  # no token in flight would end it: end it here
                sched.finished.append(req.req_id)
                sched.free.extend(req.block_ids)
        while sched.in_flight is not None or sched.finished:
            self.step()


def ours_decode(driver: Driver, prompts: list[list[int]], warm: int, steps: int) -> dict:
    ids = driver.add(prompts, max_tokens=1 << 20)
    reqs = [driver.sched.reqs[i] for i in ids]
    prefill_steps = 0
    while not all(r.output for r in reqs):  # prompt chunks (early requests decode alongside)
        driver.step()
        prefill_steps += 1
    for _ in range(warm):
        driver.step()
    t0 = time.perf_counter()
    tokens = sum(len(driver.step()) for _ in range(steps))
    dt = time.perf_counter() - t0
    driver.finish_all()
    return dict(tok_s=tokens / dt, tokens=tokens, seconds=dt, prefill_steps=prefill_steps,
                prompt_lengths=[len(p) for p in prompts])


def ours_ttft(driver: Driver, tokens: list[int], repeats: int) -> dict:
    """From scheduling the prompt to its first token in hand: one step schedules the whole prompt
    (max_batched_tokens >= its length) and samples; ahead, the next call reads the token back.
    The first run is an untimed warm-up."""
    times = []
    for i in range(repeats + 1):
        (req_id,) = driver.add([tokens], max_tokens=1)
        req = driver.sched.reqs[req_id]
        t0 = time.perf_counter()
        while not req.output:
            driver.step()
        dt = time.perf_counter() - t0
        driver.finish_all()  # tells the stage the request finished (untimed)
        if i:
            times.append(dt)
    return dict(seconds=statistics.median(times), all_s=times)


def run_measures(driver: Driver, config: dict, wl: Workload, measures, label: str) -> dict:
    out = {}
    vocab = config["vocab_size"]
    if "b1" in measures:
        out["decode_b1"] = ours_decode(driver, [prompt(wl.decode_prompt, vocab, 1)], wl.warm, wl.steps)
        print(f"  {label} decode b1: {out['decode_b1']['tok_s']:.1f} tok/s", flush=True)
    if "batch" in measures:
        out["decode_batch"] = ours_decode(driver, batch_prompts(wl, vocab), wl.warm, wl.steps)
        print(f"  {label} decode batch {wl.batch}: {out['decode_batch']['tok_s']:.1f} tok/s", flush=True)
    if "ttft" in measures:
        # Nothing else runs then, so the stand-in schedules the whole prompt in its first step.
        assert wl.max_batched_tokens >= wl.ttft_prompt, "the TTFT prompt must fit one step"
        out["ttft"] = ours_ttft(driver, prompt(wl.ttft_prompt, vocab, 2), wl.ttft_repeats)
        print(f"  {label} TTFT {wl.ttft_prompt}: {1000 * out['ttft']['seconds']:.1f} ms", flush=True)
    return out


def pick_blocks(assigned: list, wl: Workload) -> dict:
    """The block count `serve` would start with (the smallest stage budget), capped at what this
    benchmark uses: the pool's size does not change a step's work, only its allocation time."""
    budget = min(r.kv_budget_bytes // r.bytes_per_block for r in assigned)
    need = blocks_needed(wl)
    if budget < need:
        raise RuntimeError(f"the stages' KV budget holds {budget} blocks, this benchmark needs {need}: "
                           "raise --memory-utilization")
    return dict(num_blocks=need, budget_blocks=budget)


def assign_info(r) -> dict:
    return dict(weights_bytes=r.weights_bytes, activation_bytes=r.activation_bytes, bytes_per_block=r.bytes_per_block,
                kv_budget_bytes=r.kv_budget_bytes, host_memory_bytes=r.host_memory_bytes,
                dtype=getattr(r, "dtype", ""))


@contextlib.contextmanager
def our_stage(folder: Path, config: dict, wl: Workload, utilization: float, ahead: bool):
    """One stage in this process, the way `serve` runs a single machine (executor -> LocalStage ->
    StageHost): assign, start, then steps, by default one ahead as under vLLM's async scheduling
    (LocalStage.submit -> StageHost.launch, answered when the engine asks for the tokens).
    Yields (what the stage was built with, the Driver that steps it)."""
    from metal_cluster.kernels import gpu_backend
    from metal_cluster.stage_worker.host import StageHost

    layers = config["num_hidden_layers"]
    host = StageHost()
    t0 = time.perf_counter()
    assigned = host.assign(pb.AssignRequest(
        version=PROTO_VERSION, model=str(folder), layer_start=0, layer_end=layers, block_size=BLOCK_SIZE,
        max_num_batched_tokens=wl.max_batched_tokens, memory_utilization=utilization))
    out = dict(assign_s=time.perf_counter() - t0, assign=assign_info(assigned), **pick_blocks([assigned], wl))
    host.start(pb.StartRequest(version=PROTO_VERSION, num_blocks=out["num_blocks"], rank=0, world_size=1))
    pool = host.runner.pool
    activation = host.shard.embed(mx.array([0])).dtype
    out.update(
        pool_dtype=dtype_str(pool.keys[0].dtype), activation_dtype=dtype_str(activation), pool_bytes=pool.nbytes,
        # kernels/gpu.py `supports`: the paged kernel takes only a pool of the queries' dtype.
        attention=("kernel" if gpu_backend() and pool.keys[0].dtype == activation else "reference"),
        # 1.0 when the block size the budget was divided by is the pool's real one.
        bytes_per_block_vs_pool=assigned.bytes_per_block * pool.num_blocks / pool.nbytes,
    )
    print(f"  ours: pool {out['pool_dtype']} x {out['num_blocks']} blocks (budget {out['budget_blocks']}), "
          f"activations {out['activation_dtype']}, attention {out['attention']}", flush=True)
    out["ahead"] = ahead
    out["stage"] = host  # for the caller's switches; not saved
    driver = Driver(host.launch, out["num_blocks"], wl.max_batched_tokens, ahead)
    try:
        yield out, driver
    finally:
        out.pop("stage", None)
        print(f"  ours: decode steps as one trace (whole_step.py): {host.runner.chain.whole.usable}", flush=True)
        del driver, host, pool
        free()


def ours_in_process(folder: Path, config: dict, wl: Workload, measures, utilization: float, ahead: bool) -> dict:
    with our_stage(folder, config, wl, utilization, ahead) as (out, driver):
        out.update(run_measures(driver, config, wl, measures, "ours"))
    return out


# Batch-1 A/B contenders beside the stage as `serve` builds it: name -> what is switched off.
B1_VARIANTS = {
    "unfused": "q/k/v and gate/up as separate matmuls (METAL_CLUSTER_FUSE=0, stage_worker/model/fuse.py)",
    "chain": "every decode step on the per-layer chain (METAL_CLUSTER_WHOLE_STEP=0, stage_worker/step/tracing/whole_step.py)",
    "separate_norm_rope": "q/k norms and RoPE as MLX's four ops a layer (METAL_CLUSTER_NORM_ROPE=0, kernels/norm_rope.py)",
    "separate_add_norm": "the attention's residual add and the post-attention RMSNorm as MLX's two ops a layer "
                         "(METAL_CLUSTER_ADD_NORM=0, kernels/add_norm.py)",
    "uncarried": "each block's last residual add as its own op, not in the next block's input-norm kernel "
                 "(METAL_CLUSTER_CARRY=0, stage_worker/model/fuse.py run_layers)",
    "eager_submit": "each step handed to the device whole as soon as it is built, not once the last one is "
                    "halfway (runner.pace_submits off, stage_worker/step/runner.py)",
    "halfway_only": "a step's second half handed to the device right after its first, without waiting for the "
                    "last step's last layer (runner.pace_second_half off, stage_worker/step/runner.py)",
    "four_warps": "decode attention with 4 warps a threadgroup whatever its grid (kernels/gpu.py decode_warps)",
    "sync": "one step at a time, without async scheduling (what pipeline stages and speculative decoding get; "
            "serve with METAL_CLUSTER_NO_OVERLAP=1)",
    "sync_waited_layers": "one step at a time, its layers waited for before the sampling is built (the sync step "
                          "before runner.sample_while_layers_run)",
}


def four_warps(launch):
    """`launch` with the decode kernel's warps per threadgroup at gpu.WARPS: kernels are chosen
    as a step's graph is built, within the call."""
    from metal_cluster.kernels import gpu

    def send(step):
        chosen = gpu.decode_warps
        gpu.decode_warps = lambda *_: gpu.WARPS
        try:
            return launch(step)
        finally:
            gpu.decode_warps = chosen

    return send


def variant_stage(stack, variant: str, folder: Path, config: dict, wl: Workload, utilization: float, ahead: bool):
    """The driver of our stage with one B1_VARIANTS switch off, entered on `stack`."""
    from metal_cluster.stage_worker.model import fuse

    if variant == "chain":
        built, driver = stack.enter_context(our_stage(folder, config, wl, utilization, ahead))
        built["stage"].runner.chain.whole.usable = False
        return driver
    if variant == "eager_submit":
        built, driver = stack.enter_context(our_stage(folder, config, wl, utilization, ahead))
        built["stage"].runner.pace_submits = False
        return driver
    if variant == "halfway_only":
        built, driver = stack.enter_context(our_stage(folder, config, wl, utilization, ahead))
        built["stage"].runner.pace_second_half = False
        return driver
    if variant in ("sync", "sync_waited_layers"):
        built, driver = stack.enter_context(our_stage(folder, config, wl, utilization, ahead=False))
        built["stage"].runner.sample_while_layers_run = variant == "sync"
        return driver
    if variant == "four_warps":
        built, _ = stack.enter_context(our_stage(folder, config, wl, utilization, ahead))
        return Driver(four_warps(built["stage"].launch), built["num_blocks"], wl.max_batched_tokens, ahead)
    flag = {"unfused": "FUSE", "separate_norm_rope": "NORM_ROPE", "separate_add_norm": "ADD_NORM",
            "uncarried": "CARRY"}[variant]
    setting = getattr(fuse, flag)
    setattr(fuse, flag, False)  # read as the stage loads its layers
    try:
        return stack.enter_context(our_stage(folder, config, wl, utilization, ahead))[1]
    finally:
        setattr(fuse, flag, setting)


def b1_side_by_side(folder: Path, config: dict, wl: Workload, utilization: float, ahead: bool,
                    variants: tuple[str, ...] = ()) -> dict:
    """Batch-1 decode of mlx-lm and of our stage, both loaded at once, measured in alternating
    rounds: a host-bound step moves with the machine by tens of percent within minutes (see
    bench/README.md), so each round's ratio compares two measurements seconds apart. `variants`
    (B1_VARIANTS): more contenders, our stage with one switch off each, in the same rounds."""
    from mlx_lm.utils import load

    tokens = prompt(wl.decode_prompt, config["vocab_size"], 1)
    model, _ = load(str(folder))
    rounds = []
    try:
        with contextlib.ExitStack() as stack:
            built, driver = stack.enter_context(our_stage(folder, config, wl, utilization, ahead))
            others = {v: variant_stage(stack, v, folder, config, wl, utilization, ahead) for v in variants}
            for i in range(wl.b1_rounds):
                theirs = mlx_lm_batch1(model, tokens, wl.warm, wl.steps)
                ours = ours_decode(driver, [tokens], wl.warm, wl.steps)
                rounds.append(dict(mlx_lm=theirs["tok_s"], ours=ours["tok_s"]))
                line = (f"  b1 round {i + 1}: mlx-lm {theirs['tok_s']:.1f}, ours {ours['tok_s']:.1f} tok/s "
                        f"({ours['tok_s'] / theirs['tok_s']:.2f}x)")
                for v, other in others.items():
                    rounds[-1][f"ours_{v}"] = ours_decode(other, [tokens], wl.warm, wl.steps)["tok_s"]
                    line += f", ours {v.replace('_', ' ')} {rounds[-1][f'ours_{v}']:.1f}"
                print(line, flush=True)
            whole = built["stage"].runner.chain.whole.usable
            phases = {"ours": built["stage"].phases.medians()}
            for v, other in others.items():
                host = getattr(other.send, "__self__", None)
                if host is not None and hasattr(host, "phases"):
                    phases[v] = host.phases.medians()
            for name, parts in phases.items():
                print(f"  b1 {name} step parts (median ms): " + ", ".join(f"{p} {1000 * x:.2f}" for p, x in parts.items()),
                      flush=True)
    finally:
        del model
        free()

    def side(key):
        values = [r[key] for r in rounds]
        return dict(tok_s=statistics.median(values), rounds=values, tokens=wl.steps)

    ratios = [r["ours"] / r["mlx_lm"] for r in rounds]
    out = dict(mlx_lm=side("mlx_lm"), ours=side("ours"), ratio_median=statistics.median(ratios),
               ratios=ratios, built=built)
    for v in variants:
        out[f"ours_{v}"] = side(f"ours_{v}")
        out[f"{v}_ratio_median"] = statistics.median(r[f"ours_{v}"] / r["mlx_lm"] for r in rounds)
    out["whole_step"] = whole
    out["phases_s"] = phases
    return out


def ours_pipeline(folder: Path, config: dict, wl: Workload, measures, utilization: float, step_timeout: float) -> dict:
    """Two stage-worker processes on this machine, as `serve -pp 2` starts and plans them
    (coordinator/engine/executor.py): health, per-host memory shares, even layer split, assign, the smallest
    budget, start with the ring hosts from the health answers; then every step through the Pipeline."""
    from metal_cluster.coordinator.cluster import local_workers, replan
    from metal_cluster.coordinator.cluster import stages as stages_mod

    ranges = stages_mod.even_split(config["num_hidden_layers"], PIPELINE_STAGES)
    out = dict(stages=PIPELINE_STAGES, ranges=ranges)
    with local_workers.started(PIPELINE_STAGES) as workers:
        # A bounded step timeout: a stage stuck on the ring fails this section instead of the run.
        pipeline = stages_mod.Pipeline([stages_mod.RemoteStage(w.address, step_timeout_s=step_timeout) for w in workers])
        try:
            healths = [s.health() for s in pipeline.stages]
            shares = replan.shares_per_host([h.host_id for h in healths], utilization)
            t0 = time.perf_counter()
            assigned = pipeline.assign(str(folder), ranges, BLOCK_SIZE, wl.max_batched_tokens, shares)
            out.update(assign_s=time.perf_counter() - t0, assign=[assign_info(r) for r in assigned],
                       **pick_blocks(assigned, wl))
            start_args = [out["num_blocks"], replan.ring_hosts(pipeline.stages, healths), 60]
            if hasattr(stages_mod, "wire_dtype"):  # hidden states' dtype on the ring, as the executor picks it
                out["wire_dtype"] = stages_mod.wire_dtype([getattr(r, "dtype", "") for r in assigned])
                start_args.append(out["wire_dtype"])
            pipeline.start(*start_args)
            out["kv_dtypes"] = [getattr(s.health(), "kv_dtype", "") for s in pipeline.stages]
            print(f"  pipeline: layers {ranges}, {out['num_blocks']} blocks (budget {out['budget_blocks']}), "
                  f"KV {out['kv_dtypes']}, wire {out.get('wire_dtype', '?')}", flush=True)
            # vLLM runs a pipeline without async scheduling (vllm_platform.py): each step answered
            # before the next; `serve` may keep one step per stage in flight over other requests,
            # which one stream of steps from the stand-in does not do.
            driver = Driver(lambda step: pipeline.submit(step).result, out["num_blocks"], wl.max_batched_tokens,
                            ahead=False)
            if "b1" in measures:
                out.update(run_measures(driver, config, wl, ["b1"], f"pipeline x{PIPELINE_STAGES}"))
                out["hop"] = hop_timeline(driver, pipeline.stages, config, wl)
                print_hop(out["hop"])
            out.update(run_measures(driver, config, wl, [m for m in measures if m != "b1"],
                                    f"pipeline x{PIPELINE_STAGES}"))
        finally:
            pipeline.close()
    return out


def hop_timeline(driver: "Driver", stages: list, config: dict, wl: Workload, steps: int = 16) -> dict:
    """Where a batch-1 token's time goes in the pipeline: decode steps one at a time, each followed by
    the stages' marks of it (Health's step_marks: when the step arrived and when each of its parts
    ended, on this host's monotonic clock), as offsets from the coordinator's send; the medians over
    `steps`, with the stages' own medians of each part (step_phases) beside them. `serialize`: one
    decode StepRequest's encode + decode here."""
    (req_id,) = driver.add([prompt(wl.decode_prompt, config["vocab_size"], 3)], max_tokens=1 << 20)
    req = driver.sched.reqs[req_id]
    while not req.output:
        driver.step()
    for _ in range(wl.warm):
        driver.step()
    offsets: list[list[dict]] = [[] for _ in stages]
    trips = []
    for _ in range(steps):
        driver.step()
        sent, trips = driver.last_sent, trips + [driver.round_trips[-1]]
        for k, s in enumerate(stages):
            offsets[k].append({part: at - sent for part, at in s.health().step_marks.items()})
    phases = [dict(s.health().step_phases) for s in stages]
    driver.finish_all()
    step = driver.last_step
    t0 = time.perf_counter()
    for _ in range(100):
        pb.StepRequest.FromString(step.SerializeToString())
    median = lambda rows: {p: statistics.median(r[p] for r in rows if p in r) for p in rows[-1]}  # noqa: E731
    return dict(round_trip_s=statistics.median(trips), marks_s=[median(rows) for rows in offsets], phases_s=phases,
                serialize_s=(time.perf_counter() - t0) / 100, step_bytes=step.ByteSize(), steps=steps)


def print_hop(hop: dict) -> None:
    for k, marks in enumerate(hop["marks_s"]):
        print(f"  hop: stage {k} ends (ms after the send): "
              + ", ".join(f"{p} {1000 * v:.2f}" for p, v in sorted(marks.items(), key=lambda kv: kv[1])), flush=True)
        print(f"  hop: stage {k} parts (median ms): "
              + ", ".join(f"{p} {1000 * v:.2f}" for p, v in hop["phases_s"][k].items()), flush=True)
    print(f"  hop: round trip {1000 * hop['round_trip_s']:.2f} ms; a StepRequest of {hop['step_bytes']} bytes "
          f"encoded + decoded in {1e6 * hop['serialize_s']:.0f} us", flush=True)


# --- report -----------------------------------------------------------------------------------

def device_info() -> dict:
    info = dict(mlx_device=str(mx.default_device()), machine=platform.machine())
    with contextlib.suppress(Exception):
        info.update({f"mlx_{k}": v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))})
    with contextlib.suppress(Exception):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if smi.returncode == 0:
            info["nvidia_smi"] = smi.stdout.strip()
    return info


def versions() -> dict:
    import mlx_lm

    out = dict(mlx=mx.__version__, mlx_lm=mlx_lm.__version__, python=platform.python_version())
    with contextlib.suppress(Exception):
        out["metal_cluster_commit"] = _git("rev-parse", "--short", "HEAD")
        # The GPU machine's copy has this checkout's files under an older HEAD: say so, rather than
        # name a commit whose code did not run.
        if _git("status", "--porcelain", "--untracked-files=no"):
            out["metal_cluster_commit"] += " (working tree differs)"
    return out


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=5).stdout.strip()


def _get(d: dict, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _fmt(x, kind: str) -> str:
    if x is None:
        return "—"
    if kind == "ms":
        return f"{1000 * x:.1f}"
    if kind == "frac":
        return f"{x:.2f}"
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


def table(results: dict, wl: Workload) -> str:
    """Rows of measurements; ratio > 1 means ours is better (tok/s: ours / mlx-lm, TTFT: mlx-lm / ours)."""
    lines = ["| measurement | mlx-lm | ours | ratio (>1: ours better) |", "|---|---:|---:|---:|"]

    def row(name, a, b, kind, lower_better=False):
        if a is None and b is None:
            return  # not measured in this run
        ratio = None if a is None or b is None or not a or not b else (a / b if lower_better else b / a)
        lines.append(f"| {name} | {_fmt(a, kind)} | {_fmt(b, kind)} | {_fmt(ratio, 'frac')} |")

    lo, hi = wl.mixed_min, wl.mixed_max
    for fmt, r in results["formats"].items():
        m, o, p = r.get("mlx_lm", {}), r.get("ours", {}), r.get("pipeline", {})
        bound = r.get("bound_tok_s")
        row(f"{fmt}: decode batch 1, {wl.decode_prompt}-token prompt (tok/s)",
            _get(m, "decode_b1", "tok_s"), _get(o, "decode_b1", "tok_s"), "tok")
        if bound:
            row(f"{fmt}: decode batch 1 / bound ({bound:.0f} tok/s)", _frac(_get(m, "decode_b1", "tok_s"), bound),
                _frac(_get(o, "decode_b1", "tok_s"), bound), "frac")
        row(f"{fmt}: decode batch {wl.batch}, prompts {lo}..{hi} (tok/s)",
            _get(m, "decode_batch", "tok_s"), _get(o, "decode_batch", "tok_s"), "tok")
        row(f"{fmt}: time to first token, {wl.ttft_prompt}-token prompt (ms)",
            _get(m, "ttft", "seconds"), _get(o, "ttft", "seconds"), "ms", lower_better=True)
        if p:
            n = p.get("stages", PIPELINE_STAGES)
            row(f"{fmt}: {n} stages, decode batch 1 (tok/s)",
                _get(m, "decode_b1", "tok_s"), _get(p, "decode_b1", "tok_s"), "tok")
            row(f"{fmt}: {n} stages, decode batch {wl.batch} (tok/s)",
                _get(m, "decode_batch", "tok_s"), _get(p, "decode_batch", "tok_s"), "tok")
            row(f"{fmt}: {n} stages, time to first token (ms)",
                _get(m, "ttft", "seconds"), _get(p, "ttft", "seconds"), "ms", lower_better=True)
    return "\n".join(lines)


def _frac(x, bound):
    return None if x is None else x / bound


def notes(results: dict) -> list[str]:
    out = []
    bw = results.get("copy_bandwidth")
    if bw:
        out.append(f"copy bandwidth {bw['median_bytes_per_s'] / 1e12:.3f} TB/s median "
                   f"({bw['best_bytes_per_s'] / 1e12:.3f} best) over a {bw['array_bytes'] / 2**30:.2f} GiB bf16 array")
    for fmt, r in results["formats"].items():
        if "error" in r.get("b1_side_by_side", {}):
            out.append(f"{fmt}: batch 1 side by side failed: {r['b1_side_by_side']['error']}")
        if "weight_bytes_per_token" in r:
            bound = f", bound {r['bound_tok_s']:.0f} tok/s" if r.get("bound_tok_s") else ""
            out.append(f"{fmt}: {r['weight_bytes'] / 1e9:.2f} GB of weights in {r['shards']} shard(s), "
                       f"{r['weight_bytes_per_token'] / 1e9:.2f} GB read per decode step{bound}")
        pair = r.get("b1_side_by_side", {})
        if "ratios" in pair:
            out.append(f"{fmt}: batch 1, both loaded at once, {len(pair['ratios'])} alternating rounds: ours / mlx-lm "
                       f"{', '.join(f'{x:.2f}' for x in pair['ratios'])} (median {pair['ratio_median']:.2f})")
        for v, what in B1_VARIANTS.items():
            if v in pair:
                out.append(f"{fmt}: batch 1, ours with {what.split(' (')[0]}: {pair[v]['tok_s']:.1f} tok/s "
                           f"(median of the rounds; / mlx-lm {pair[f'{v}_ratio_median']:.2f})")
        o = r.get("ours", {})
        if "pool_dtype" in o:
            mode = "one step ahead (async scheduling)" if o.get("ahead") else "one step at a time"
            out.append(f"{fmt}: ours ran {mode} with a {o['pool_dtype']} KV pool, {o['activation_dtype']} activations, "
                       f"attention: {o['attention']}, {o['assign']['weights_bytes'] / 1e9:.2f} GB of weights on the stage")
        p = r.get("pipeline", {})
        if "kv_dtypes" in p:
            out.append(f"{fmt}: pipeline stages' KV {p['kv_dtypes']}, ring wire dtype {p.get('wire_dtype', '?')}")
        versus = []
        for name, key, field, lower_better in (("decode b1", "decode_b1", "tok_s", False),
                                                ("batch", "decode_batch", "tok_s", False),
                                                ("TTFT", "ttft", "seconds", True)):
            one, two = _get(o, key, field), _get(p, key, field)
            if one and two:
                versus.append(f"{name} {(one / two if lower_better else two / one):.2f}x")
        if versus:
            out.append(f"{fmt}: {p.get('stages', PIPELINE_STAGES)} stages vs our 1 stage (>1: pipeline better): "
                       + ", ".join(versus))
        for side in ("mlx_lm", "ours", "pipeline"):
            if "error" in r.get(side, {}):
                out.append(f"{fmt}: {side} failed: {r[side]['error']}")
    return out


# --- main -------------------------------------------------------------------------------------

def parse_list(text: str, allowed) -> list[str]:
    items = [x for x in text.split(",") if x]
    bad = [x for x in items if x not in allowed]
    if bad:
        sys.exit(f"unknown {bad}; choose from {','.join(allowed)}")
    return items


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write every raw number here (rewritten after each section)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated subset of {','.join(FORMATS)}")
    ap.add_argument("--measures", default=",".join(MEASURES),
                    help="b1: decode batch 1; batch: decode batch 32, mixed prompts; ttft: time to first token")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/gpu-serving"), help="model folders (reused)")
    ap.add_argument("--shape", default="qwen3-8b", choices=tuple(SHAPES), help="the model shape (random weights)")
    ap.add_argument("--small", action="store_true", help="a tiny shape and workload: a smoke test for the CPU")
    ap.add_argument("--memory-utilization", type=float, default=0.5, help="as serve's --gpu-memory-utilization")
    ap.add_argument("--step-timeout", type=float, default=60.0, help="seconds a pipeline step may take")
    for v, what in B1_VARIANTS.items():
        ap.add_argument(f"--b1-{v.replace('_', '-')}", action="store_true", help=f"batch 1 side by side: also our stage with {what}")
    ap.add_argument("--b1-rounds", type=int, help="batch 1 side by side: alternating rounds (default: the workload's)")
    ap.add_argument("--sync", action="store_true",
                    help="one stage without async scheduling (as serve with METAL_CLUSTER_NO_OVERLAP=1)")
    args = ap.parse_args()
    if mx.default_device().type == mx.DeviceType.cpu:
        use_openblas()
    sections = parse_list(args.sections, SECTIONS)
    formats = parse_list(args.formats, FORMATS)
    measures = parse_list(args.measures, MEASURES)
    config = SHAPES[args.shape][1 if args.small else 0]
    wl = SMALL_WORKLOAD if args.small else Workload()
    if args.b1_rounds:
        wl = replace(wl, b1_rounds=args.b1_rounds)

    results = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   device=device_info(), versions=versions(), args={k: str(v) for k, v in vars(args).items()},
                   config=config, workload=asdict(wl), batch_prompt_lengths=mixed_lengths(wl), formats={})
    print(f"device {results['device']} mlx {results['versions']['mlx']} mlx-lm {results['versions']['mlx_lm']}",
          flush=True)

    def save():
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))

    if "bandwidth" in sections:
        results["copy_bandwidth"] = copy_bandwidth(wl.copy_bytes, wl.copy_iters)
        print(f"copy bandwidth: {results['copy_bandwidth']['median_bytes_per_s'] / 1e9:.0f} GB/s", flush=True)
        save()
    folders = ensure_folders(args.work_dir, config, formats, args.small)
    for fmt in formats:
        folder = folders[fmt]
        r = results["formats"][fmt] = dict(folder=str(folder), **weight_bytes(folder, config))
        if "copy_bandwidth" in results:
            r["bound_tok_s"] = results["copy_bandwidth"]["median_bytes_per_s"] / r["weight_bytes_per_token"]
        print(f"{fmt}: {folder}", flush=True)
        side_measures = measures
        if "b1" in measures and {"mlx-lm", "ours"} <= set(sections):
            started = time.perf_counter()
            try:
                variants = tuple(v for v in B1_VARIANTS if getattr(args, f"b1_{v}"))
                pair = b1_side_by_side(folder, config, wl, args.memory_utilization, not args.sync, variants)
                r["b1_side_by_side"] = dict(ratio_median=pair["ratio_median"], ratios=pair["ratios"])
                for v in variants:
                    r["b1_side_by_side"].update({v: pair[f"ours_{v}"], f"{v}_ratio_median": pair[f"{v}_ratio_median"]})
                r["b1_side_by_side"]["whole_step"] = pair["whole_step"]
                r["b1_side_by_side"]["phases_s"] = pair["phases_s"]
                r["mlx_lm"], r["ours"] = dict(decode_b1=pair["mlx_lm"]), dict(decode_b1=pair["ours"], **pair["built"])
            except Exception as e:
                traceback.print_exc()
                r["b1_side_by_side"] = dict(error=f"{type(e).__name__}: {e}")
            free()
            r["b1_side_by_side"]["section_s"] = time.perf_counter() - started
            save()
            side_measures = [m for m in measures if m != "b1"]
        sides = [("mlx-lm", "mlx_lm", lambda: mlx_lm_side(folder, config, wl, side_measures)),
                 ("ours", "ours",
                  lambda: ours_in_process(folder, config, wl, side_measures, args.memory_utilization, not args.sync)),
                 ("pipeline", "pipeline",
                  lambda: ours_pipeline(folder, config, wl, measures, args.memory_utilization, args.step_timeout))]
        for section, key, fn in sides:
            if section not in sections or (key != "pipeline" and not side_measures):
                continue  # not asked for, or its only measure was taken side by side
            started = time.perf_counter()
            try:
                r[key] = {**r.get(key, {}), **fn()}
            except Exception as e:  # keep the other sections' numbers
                traceback.print_exc()
                r[key] = {**r.get(key, {}), "error": f"{type(e).__name__}: {e}"}
            free()
            r[key]["section_s"] = time.perf_counter() - started  # for planning device time
            print(f"  ({section}: {r[key]['section_s']:.0f}s)", flush=True)
            save()

    print()
    print(table(results, wl))
    print()
    for line in notes(results):
        print(f"- {line}")
    if mx.default_device().type == mx.DeviceType.cpu:
        print("- CPU: a smoke test only; the stage computes in float32 there by design (DESIGN.md), "
              "mlx-lm in the checkpoint's dtype")
    save()
    if args.json:
        print(f"\nraw numbers: {args.json}")


if __name__ == "__main__":
    main()
