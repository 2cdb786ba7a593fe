"""A stage computes in one dtype taken from the model: on MLX's GPU backends (Metal, CUDA) the
checkpoint's own (here bfloat16) for weights, activations, KV pool and ring hidden states; on MLX's
CPU backend always float32.

GPU tests (skip on the CPU): bf16 stages built as `serve` builds them (StageHost.assign + start
from the folder on disk) against mlx-lm's own bf16 generation of the same folder, within bf16's
rounding error (see `bf16_tolerance`), and a two-process pipeline whose hidden states travel in
bf16. CPU tests (skip on a GPU): a bf16 checkpoint computes in float32 there, so its greedy tokens
equal mlx-lm's on the same weights upcast to float32, exactly.
"""

import json
import secrets

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import load, load_tokenizer

import tiny_models
from metal_cluster.coordinator.cluster import local_workers
from metal_cluster.coordinator.cluster.replan import ring_hosts, shares_per_host
from metal_cluster.coordinator.cluster.stages import Pipeline, RemoteStage, even_split, wire_dtype
from metal_cluster.kernels import gpu_backend
from metal_cluster.proto import PROTO_VERSION, pb
from metal_cluster.stage_worker.net.auth import TOKEN_ENV
from metal_cluster.stage_worker.host import StageHost
from metal_cluster.stage_worker.families import Family
from metal_cluster.stage_worker.model import fuse
from metal_cluster.stage_worker.model.model_source import resolve_model
from references import mlx_lm_greedy
from scheduler_double import SchedulerDouble

BACKEND = gpu_backend()
requires_gpu = pytest.mark.skipif(
    BACKEND is None,
    reason="no Metal or CUDA GPU: MLX runs on its CPU backend here, where a stage computes in float32 "
           "whatever the checkpoint's dtype (the CPU tests in this file cover that)",
)
requires_cpu = pytest.mark.skipif(
    BACKEND is not None,
    reason=f"MLX runs on a GPU here ({BACKEND}), where a bf16 checkpoint computes in bf16 (the GPU tests cover it)",
)

BLOCK_SIZE = 8
NUM_BLOCKS = 128
WARMUP_TOKENS = 64  # AssignRequest.max_num_batched_tokens: the warm-up prefill's size
PROMPTS = [
    "Hello world, this is a test",
    "Another prompt that is quite a bit longer than the first one, with commas, and more words",
    "Numbers 12345 and 67890",
    "Tea or coffee?",
    "<|im_start|>user\nWhat is the weather like in Paris today?<|im_end|>\n<|im_start|>assistant\n",
]
CHUNK = 16  # the longer prompts are prefilled in chunks beside the others' decodes: mixed batches


# --- building and driving stages as production does --------------------------------------------------

def num_layers(folder) -> int:
    return resolve_model(folder).config["num_hidden_layers"]  # the text model's (Qwen3.5: text_config)


def expected_bytes_per_block(folder, layers: int, itemsize: int) -> int:
    config = resolve_model(folder).config
    if config.get("kv_lora_rank"):  # MLA: one latent entry per token and layer
        return layers * BLOCK_SIZE * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * itemsize
    kv_heads, head_dim = Family.kv_geometry(config)
    attention = 2 * BLOCK_SIZE * kv_heads * head_dim * itemsize  # K and V
    if not config.get("linear_num_value_heads"):
        return layers * attention
    # Gated DeltaNet layers (all but every full_attention_interval-th): one state per block id, its
    # convolution window in the compute dtype and its recurrent state in float32.
    recurrent = sum((i + 1) % config["full_attention_interval"] != 0 for i in range(layers))
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    conv = (config["linear_conv_kernel_dim"] - 1) * (2 * key_dim + value_dim) * itemsize
    state = value_dim * config["linear_key_head_dim"] * 4
    return (layers - recurrent) * attention + recurrent * (conv + state)


def start_stage(folder) -> tuple[StageHost, pb.AssignResponse]:
    """One whole-model stage, the way serve builds its in-process stage: assign, then start."""
    host = StageHost()
    assigned = host.assign(pb.AssignRequest(
        version=PROTO_VERSION, model=str(folder), layer_start=0, layer_end=num_layers(folder),
        block_size=BLOCK_SIZE, max_num_batched_tokens=WARMUP_TOKENS, memory_utilization=0.05))
    host.start(pb.StartRequest(version=PROTO_VERSION, num_blocks=NUM_BLOCKS, world_size=1))
    return host, assigned


def greedy_through(step_fn, prompts: dict[str, list[int]], max_tokens: int) -> tuple[dict[str, list[int]], int]:
    """Free-running greedy decode of every prompt, batched, driven by SchedulerDouble:
    ({req_id: tokens}, tokens computed over all steps)."""
    computed = [0]

    def counting(step):
        computed[0] += sum(s.num_tokens for s in step.scheduled)
        return {t.req_id: t.token_id for t in step_fn(step).sampled}

    sched = SchedulerDouble(counting, NUM_BLOCKS, BLOCK_SIZE, chunk_size=CHUNK)
    for req_id, ids in prompts.items():
        sched.add(req_id, ids, max_tokens)
    return sched.run(), computed[0]


# --- mlx-lm's side -------------------------------------------------------------------------------------

def mlx_lm_greedy_logits(model, prompt: list[int], max_tokens: int) -> tuple[list[int], np.ndarray]:
    """mlx-lm's own greedy generation (generate_step, its argmax sampler) and the logits each token
    was chosen from ([max_tokens, vocab], float32 copies of the model's dtype), caught by a logits
    processor that changes nothing."""
    caught = []

    def catch(_tokens, logits):
        caught.append(logits)
        return logits

    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, logits_processors=[catch])
    tokens = [int(t) for t, _ in steps]
    return tokens, np.stack([np.array(z[0].astype(mx.float32)) for z in caught[:max_tokens]])


def forced_logits(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The logits each of `tokens` was chosen from, with the history given: one forward pass."""
    logits = model(mx.array(prompt + tokens)[None])[0].astype(mx.float32)
    return np.array(logits)[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def max_abs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a - b).max(axis=-1)


def top2_margin(logits: np.ndarray) -> np.ndarray:
    top = np.sort(logits, axis=-1)
    return top[..., -1] - top[..., -2]


def bf16_tolerance(bf16_error: np.ndarray) -> float:
    """How far apart two correct bf16 implementations of one model may put a logit.

    bf16 keeps 8 significant bits: one rounding moves a value by up to 2^-9 of it, so "a few ulps
    of the logit magnitude" (|z| ~ 30 here, an ulp 0.125) would be ~0.5. But rounding errors made
    in early layers are amplified by the later ones, and these random tiny models amplify a lot:
    measured (mlx 0.32.4, CPU, 5-6 prompts x 32 tokens, default 4-layer builds), mlx-lm's own bf16
    logits differ from the same weights computed in float32 by a median 1.2 / 1.3 / 0.4 and up
    to 5.0 / 7.3 / 1.2 (llama / qwen2 / qwen3), i.e. up to ~60 ulps, while the median top-1/top-2
    gap is ~1.5. A fixed ulp count would fail correct code or have to be so wide it means
    nothing; so the tolerance is measured on this model and device instead:

    eps = the largest error mlx-lm's own bf16 forward makes against float32 over all positions
    compared (`bf16_error`). A correct bf16 stage makes the same roundings in another order (its
    paged attention kernel, packed batches), so its error is of the same size: within eps of
    exact, hence within 2 * eps of mlx-lm (triangle inequality)."""
    return 2.0 * float(bf16_error.max())


# --- GPU: a bf16 checkpoint computes in bf16 -------------------------------------------------------------

GPU_TOKENS = 32


# The families' tiny models have 16-wide heads, which the paged decode kernel and the q/k
# norm/RoPE kernel do not take (their layers then run MLX's own ops). These variants have 64-wide
# heads, so a GPU runs them as `serve` runs real models: fused q/k/v, the norm/RoPE kernel, the
# paged kernels and the whole decode step as one trace.
WIDE_HEADS = {"qwen3_wide": "qwen3", "llama_wide": "llama"}
WIDE_SHAPE = dict(hidden_size=256, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=64)


@pytest.fixture(scope="module",
                params=tiny_models.FAMILIES + tiny_models.MORE_FAMILIES + tiny_models.HYBRID_FAMILIES + tuple(WIDE_HEADS))
def bf16_run(request, tmp_path_factory):
    """One family in bf16: mlx-lm's greedy tokens and logits per prompt (bf16, and float32 on the same
    history), and the stage's logits and tokens along mlx-lm's history.

    The stage decodes through SchedulerDouble and host.step, but the scheduler feeds back mlx-lm's
    token, not the stage's (teacher forcing): both then always condition on one history, so every
    position can be compared. Left free-running, the two legitimately part ways at the first
    near-tie, which these models reach within a few tokens in bf16 (see bf16_tolerance); up to that
    point the free-running stage would have produced exactly the history fed here."""
    family = WIDE_HEADS.get(request.param, request.param)
    shape = WIDE_SHAPE if request.param in WIDE_HEADS else {}
    folder = tiny_models.build_tiny_model(family, tmp_path_factory.mktemp(f"{request.param}-bf16"), dtype="bfloat16",
                                          **shape)
    ref_bf16, tokenizer = load(str(folder))
    ref_f32, _ = load(str(folder))
    ref_f32.set_dtype(mx.float32)  # the bf16 values exactly, computed in float32: "exact" for bf16's purposes
    prompts = {f"r{i}": tokenizer.encode(p) for i, p in enumerate(PROMPTS)}
    ref = {}
    for req_id, ids in prompts.items():
        tokens, logits = mlx_lm_greedy_logits(ref_bf16, ids, GPU_TOKENS)
        ref[req_id] = dict(tokens=tokens, logits=logits, exact=forced_logits(ref_f32, ids, tokens))

    host, assigned = start_stage(folder)
    caught = []  # what the last stage's lm_head returned, once per step that samples
    lm_head = host.shard.logits
    host.shard.logits = lambda hidden: caught.append(lm_head(hidden)) or caught[-1]
    got = {r: dict(tokens=[], logits=[]) for r in prompts}
    logits_dtypes = set()

    def step_fn(step):
        caught.clear()
        response = host.step(step)
        logits_dtypes.update(z.dtype for z in caught)
        forced = {}
        for row, s in enumerate(response.sampled):  # rows of the logits in the order tokens come back
            mine = got[s.req_id]
            mine["tokens"].append(s.token_id)
            mine["logits"].append(np.array(caught[-1][row].astype(mx.float32)))
            forced[s.req_id] = ref[s.req_id]["tokens"][len(mine["tokens"]) - 1]
        return forced

    sched = SchedulerDouble(step_fn, NUM_BLOCKS, BLOCK_SIZE, chunk_size=CHUNK)
    for req_id, ids in prompts.items():
        sched.add(req_id, ids, GPU_TOKENS)
    sched.run()
    return dict(variant=request.param, folder=folder, host=host, assigned=assigned, ref=ref, logits_dtypes=logits_dtypes,
                got={r: dict(tokens=g["tokens"], logits=np.stack(g["logits"])) for r, g in got.items()})


def assert_stage_computes_in(host, assigned, folder, dtype):
    """Weights, KV pool, the block size vLLM is told and what health reports: all in `dtype`."""
    name = str(dtype).removeprefix("mlx.core.")
    assert assigned.dtype == name and host.dtype == dtype
    assert {str(v.dtype) for _, v in tree_flatten(host.shard.model.parameters())} == {str(dtype)}
    pool = host.runner.pool
    # A recurrent layer's state is float32, as mlx-lm keeps it; its convolution window and all K/V
    # are in the compute dtype.
    computed = [k for k in pool.keys] + [v for v, state in zip(pool.values, pool.is_state) if v is not None and not state]
    assert {a.dtype for a in computed} == {dtype}
    assert {v.dtype for v, state in zip(pool.values, pool.is_state) if state} <= {mx.float32}
    assert assigned.bytes_per_block == expected_bytes_per_block(folder, num_layers(folder), dtype.size)
    assert host.health().kv_dtype == name


@requires_gpu
def test_bf16_checkpoint_computes_in_bf16(bf16_run):
    assert_stage_computes_in(bf16_run["host"], bf16_run["assigned"], bf16_run["folder"], mx.bfloat16)
    # The lm_head's output is bf16: the activations stayed bf16 all the way (nothing promoted them).
    assert bf16_run["logits_dtypes"] == {mx.bfloat16}
    # On a GPU the dense families load with q/k/v and gate/up fused (model/fuse.py); the logit
    # comparison below then covers the fused layers.
    shard = bf16_run["host"].shard
    assert [fuse.is_fused(layer) for layer in shard.layers] == [shard.family.fuses_projections] * len(shard.layers)
    if bf16_run["variant"] in WIDE_HEADS:
        # What a real model's layers take on a GPU: the norm/RoPE kernel, the residual add + norm
        # kernel and the one-trace decode step.
        assert all(layer.self_attn.norm_rope is not None for layer in shard.layers)
        assert all(isinstance(layer, fuse.AddNormBlock) for layer in shard.layers)
        assert bf16_run["host"].runner.chain.whole.usable is True


@requires_gpu
def test_bf16_stage_matches_mlx_lm_within_bf16_rounding(bf16_run):
    ref, got = bf16_run["ref"], bf16_run["got"]
    bf16_error = np.concatenate([max_abs(r["logits"], r["exact"]) for r in ref.values()])
    tol = bf16_tolerance(bf16_error)
    for req_id, r in ref.items():
        mine = got[req_id]
        assert len(mine["tokens"]) == GPU_TOKENS
        diff = max_abs(mine["logits"], r["logits"])
        margin = top2_margin(r["logits"])
        for i in range(GPU_TOKENS):
            assert diff[i] <= tol, (f"{req_id} token {i}: logits differ from mlx-lm's by up to {diff[i]:.3f}, "
                                    f"more than bf16's {tol:.3f}")
            # Beyond 2 * tol no logit error within tol can swap mlx-lm's top two: the choice must agree.
            if margin[i] > 2 * tol:
                assert mine["tokens"][i] == r["tokens"][i], (
                    f"{req_id} token {i}: stage chose {mine['tokens'][i]}, mlx-lm {r['tokens'][i]} "
                    f"with a top-2 margin of {margin[i]:.3f} (tolerance {tol:.3f})")
    # Statistically, the stage is as accurate as mlx-lm's own bf16 forward against float32 (medians of
    # 160 positions). Measured on the CPU with other correct bf16 attentions in the stage (float32
    # math, or probabilities rounded to bf16 before P @ V as FlashAttention does): ratio 0.87-0.96,
    # largest logit difference under half the bound above; a KV pool keeping 5 of bf16's 7 mantissa
    # bits passes that bound but gives 1.4-1.6 here, 4 bits fails both.
    stage_median = float(np.median(np.concatenate([max_abs(got[r]["logits"], ref[r]["exact"]) for r in ref])))
    mlx_lm_median = float(np.median(bf16_error))
    assert stage_median <= 1.5 * mlx_lm_median, (
        f"median logit error against float32: the stage's {stage_median:.3f}, mlx-lm's bf16 {mlx_lm_median:.3f}")


PIPELINE_TOKENS = 16


@requires_gpu
def test_two_stage_pipeline_sends_bf16_and_matches_one_stage(tmp_path_factory):
    folder = tiny_models.build_tiny_model("llama", tmp_path_factory.mktemp("llama-bf16-pp"), dtype="bfloat16")
    tokenizer = load_tokenizer(folder)
    prompts = {f"r{i}": tokenizer.encode(p) for i, p in enumerate(PROMPTS)}
    host, _ = start_stage(folder)
    single, _ = greedy_through(host.step, prompts, PIPELINE_TOKENS)
    assert host.dtype == mx.bfloat16

    layers = num_layers(folder)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(TOKEN_ENV, secrets.token_urlsafe(24))  # the workers' secret, gone after the test
        with local_workers.started(2) as workers:
            stages = [RemoteStage(w.address) for w in workers]
            pipeline = Pipeline(stages)
            try:
                # As the executor builds a plan: healths, assign, the plan's wire dtype, start.
                healths = [s.health() for s in stages]
                ranges = even_split(layers, len(stages))
                assigned = pipeline.assign(str(folder), ranges, BLOCK_SIZE, WARMUP_TOKENS,
                                           shares_per_host([h.host_id for h in healths], 0.05))
                wire = wire_dtype([r.dtype for r in assigned])
                pipeline.start(NUM_BLOCKS, ring_hosts(stages, healths), 60, wire)
                piped, computed = greedy_through(lambda step: pipeline.submit(step).result(timeout=120), prompts,
                                                 PIPELINE_TOKENS)
                after = [s.health() for s in stages]
            finally:
                pipeline.close()

    assert [r.dtype for r in assigned] == ["bfloat16", "bfloat16"] and wire == "bfloat16"
    for (a, b), r in zip(ranges, assigned):
        assert r.bytes_per_block == expected_bytes_per_block(folder, b - a, 2)
    assert [h.kv_dtype for h in after] == ["bfloat16", "bfloat16"]
    # Same layers, same dtype, the hidden states handed over bit for bit: the same tokens.
    assert piped == single
    hidden_size = resolve_model(folder).config["hidden_size"]
    assert after[0].ring_bytes_sent == computed * hidden_size * 2  # every computed token's hidden state, 2 bytes each
    assert after[1].ring_bytes_sent == 0  # the last stage sends nothing on


# --- CPU: a bf16 checkpoint computes in float32 ---------------------------------------------------------

CPU_TOKENS = 16


@pytest.fixture(scope="module")
def bf16_on_cpu(tmp_path_factory):
    # llama: the family whose greedy tokens bf16 rounding changes within 16 tokens (qwen3's q/k norms
    # keep it close to float32), so the token test below also tells a float32 stage from a bf16 one.
    folder = tiny_models.build_tiny_model("llama", tmp_path_factory.mktemp("llama-bf16"), dtype="bfloat16")
    host, assigned = start_stage(folder)
    return folder, host, assigned


@requires_cpu
def test_bf16_checkpoint_computes_in_float32_on_the_cpu(bf16_on_cpu):
    folder, host, assigned = bf16_on_cpu
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert_stage_computes_in(host, assigned, folder, mx.float32)


@requires_cpu
def test_bf16_checkpoint_on_the_cpu_matches_mlx_lm_in_float32(bf16_on_cpu):
    folder, host, _ = bf16_on_cpu
    ref, tokenizer = load(str(folder))
    assert ref.model.embed_tokens.weight.dtype == mx.bfloat16  # mlx-lm keeps the checkpoint's dtype...
    ref.set_dtype(mx.float32)  # ...so upcast it as the stage does (exact: every bf16 value is a float32)
    prompts = {f"r{i}": tokenizer.encode(p) for i, p in enumerate(PROMPTS[:3])}
    out, _ = greedy_through(host.step, prompts, CPU_TOKENS)
    for req_id, ids in prompts.items():
        assert out[req_id] == mlx_lm_greedy(ref, ids, CPU_TOKENS), req_id
