"""The whole decode step as one trace (stage_worker/step/tracing/whole_step.py), on the CPU.

On a GPU the trace holds the paged decode kernels. Here MLX runs on its CPU backend, where
attention takes the reference, whose gathers are planned from host values a trace cannot hold;
so these tests stand a traceable decode attention in for the kernel (SDPA over each request's
block table, padded, masked by its device-side length: the kernel's contract) and check what the
trace adds around it: the pools in and out, the padded tables and their widths, the shadow batch,
and the fallback. Greedy tokens must equal mlx-lm's; the kernel itself is checked against the
reference on the GPU (tests/test_kernels.py)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load

import tiny_models
from metal_cluster import kernels
from metal_cluster.kernels import gpu as fast
from metal_cluster.stage_worker.kv.paged_kv import KVPool
from metal_cluster.stage_worker.model.model_source import resolve_model
from metal_cluster.stage_worker.model.shard import load_shard
from metal_cluster.stage_worker.step.tracing import whole_step
from metal_cluster.stage_worker.step.runner import StageRunner
from references import mlx_lm_greedy
from scheduler_double import SchedulerDouble

# On a GPU the real kernels run in the trace and tests/test_gpu_dtype.py checks them against mlx-lm
# within bf16's tolerance; float32 greedy equality is the CPU's contract.
ON_GPU = kernels.gpu_backend() is not None
cpu_only = pytest.mark.skipif(ON_GPU, reason="a GPU backend is active: the trace runs the real kernels there")

BLOCK_SIZE = 4  # 16 blocks = 64 tokens: the requests below cross table widths 16 -> 32
NUM_BLOCKS = 160


def traceable_decode(q, k_pool, v_pool, meta, scale, sliding_window=None, backend=None, sinks=None, v_dim=None):
    """Decode attention from device arrays only, as the kernel reads them: every slot of each
    request's block table, those at or past its length (or before its window) masked."""
    num_reqs, width = meta.block_tables.shape
    slots = (meta.block_tables[:, :, None] * meta.block_size + mx.arange(meta.block_size)).reshape(num_reqs, -1)
    k = k_pool[slots].transpose(0, 2, 1, 3)  # [B, kv_heads, L, D]
    v = (k_pool[..., :v_dim] if v_dim else v_pool)[slots].transpose(0, 2, 1, 3)
    position = mx.arange(slots.shape[1])[None, :]
    last = meta.seq_lens[:, None] - 1
    mask = position <= last
    if sliding_window:
        mask = mask & (position > last - sliding_window)
    out = mx.fast.scaled_dot_product_attention(q[:, :, None, :], k, v, scale=scale, mask=mask[:, None, None, :],
                                               sinks=sinks)
    return out[:, :, 0, :]


@pytest.fixture
def decode_kernel_standin(monkeypatch):
    """The kernel route taken for decodes, with the traceable stand-in as the kernel."""
    monkeypatch.setattr(kernels, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(fast, "supports", lambda q, k_pool, meta, v_pool=None, **kw: fast.is_decode(q, meta))
    monkeypatch.setattr(fast, "paged_attention_kernel", traceable_decode)


def make_runner(folder, num_blocks=NUM_BLOCKS) -> StageRunner:
    shard = load_shard(resolve_model(folder))
    return StageRunner(shard, KVPool.allocate(shard.caches, num_blocks, BLOCK_SIZE, shard.dtype))


def greedy(runner: StageRunner, num_blocks=NUM_BLOCKS) -> SchedulerDouble:
    """The tests' scheduler stand-in stepping `runner`, each step waited for."""
    return SchedulerDouble(lambda step: {r: s.token_id for r, s in runner.step(step).sampled.items()},
                           num_blocks, BLOCK_SIZE)


def run_requests(folder, prompts, max_tokens):
    """Greedy tokens of every prompt through one stage's runner, and the whole-step calls that ran."""
    runner = make_runner(folder)
    whole = runner.chain.whole
    ran, widths, original = [], set(), whole.run

    def counted(h, batch, pool):
        out = original(h, batch, pool)
        ran.append(out is not None)
        widths.update(whole_step.table_width(-(-max(t.attn.seq_lens_host) // BLOCK_SIZE)) for t in batch.groups)
        return out

    whole.run = counted
    sched = greedy(runner)
    for i, p in enumerate(prompts):
        sched.add(f"r{i}", p, max_tokens)
    out = sched.run()
    return [out[f"r{i}"] for i in range(len(prompts))], ran, widths, whole


@cpu_only
@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_decode_steps_as_one_trace_equal_mlx_lm(family, tmp_path, decode_kernel_standin):
    """Three requests of different lengths decoding together, past a table width: every decode step
    ran as the trace, and each request's tokens are mlx-lm's. gpt_oss: sinks, and its sliding-window
    layers in a KV cache group of their own."""
    overrides = {"sliding_window": 8} if family == "gpt_oss" else {}
    folder = tiny_models.build_tiny_model(family, tmp_path / family, config_overrides=overrides)
    ref_model, tokenizer = load(str(folder))
    prompts = [tokenizer.encode(t) for t in ("Hello world, this is a test", "Short",
                                             "The quick brown fox jumps over the lazy dog again and again")]
    got, ran, widths, whole = run_requests(folder, prompts, 56)
    for tokens, prompt in zip(got, prompts):
        assert tokens == mlx_lm_greedy(ref_model, prompt, 56)
    assert ran and all(ran) and whole.usable
    assert widths >= {16, 32}


@cpu_only
def test_a_trace_whose_attention_is_not_the_kernel_is_dropped(llama_model, monkeypatch, decode_kernel_standin):
    """Where the kernel does not take the step (here: supports says no), the trace would freeze the
    reference's host-planned gathers: it is dropped, and the chain serves every step, exactly."""
    monkeypatch.setattr(fast, "supports", lambda *a, **kw: False)
    ref_model, tokenizer = load(str(llama_model))
    prompts = [tokenizer.encode("Tea or coffee?"), tokenizer.encode("Numbers 12345 and 67890")]
    got, ran, _, whole = run_requests(llama_model, prompts, 12)
    for tokens, prompt in zip(got, prompts):
        assert tokens == mlx_lm_greedy(ref_model, prompt, 12)
    assert ran[0] is False and whole.usable is False
    assert len(ran) == 1  # not tried again


def test_table_widths_are_powers_of_two_from_16():
    assert [whole_step.table_width(n) for n in (1, 16, 17, 33, 100)] == [16, 16, 32, 64, 128]


@cpu_only
def test_the_trace_writes_the_pool_in_place(llama_model, decode_kernel_standin):
    """The pool goes into the trace and comes back out: with nothing else holding it, MLX writes its
    K/V rows in place, so a step never copies the pool (the address of its buffer stays)."""
    runner = make_runner(llama_model, 64)
    addresses = []

    def step(request):
        out = {r: s.token_id for r, s in runner.step(request).sampled.items()}
        mx.eval(runner.pool.arrays)
        view = np.array(runner.pool.keys[1], copy=False)  # MLX's own buffer, not a copy
        addresses.append(view.__array_interface__["data"][0])
        del view  # a reference held into the next step would make MLX copy
        return out

    sched = SchedulerDouble(step, 64, BLOCK_SIZE)
    sched.add("a", list(range(5, 30)), 12)
    sched.run()
    assert runner.chain.whole.usable and len(addresses) > 10
    assert len(set(addresses)) == 1


def test_latent_attention_stays_on_the_chain(tmp_path):
    """MLA's attention (deepseek_v3) re-plans its decodes from host values, which a trace would
    freeze: its stages never take the whole step; plain paged attention's may."""
    def whole(family):
        return make_runner(tiny_models.build_tiny_model(family, tmp_path / family), 8).chain.whole

    assert whole("deepseek_v3").usable is False
    assert whole("qwen3").usable is None  # not decided until its first trace


def test_the_trace_equals_the_chain_past_several_partitions(tmp_path, request):
    """One long request decoding, through the trace and through the per-layer chain: the same
    tokens, and logits equal within float32 rounding. Its context (a 600-token prompt) makes the
    decode kernel split it; the trace plans for the 1024-token bucket, so its last partitions are
    empty. On a GPU the real kernels run (head dim 32: the kernels take multiples of 32, and the
    trace is dropped where attention is not theirs); on the CPU the stand-in."""
    if not ON_GPU:
        request.getfixturevalue("decode_kernel_standin")
    llama_model = tiny_models.build_tiny_model("llama", tmp_path / "llama-d32", hidden_size=128)
    prompt = [(11 * i) % 700 + 3 for i in range(600)]
    runs = {}
    for whole in (True, False):
        runner = make_runner(llama_model, NUM_BLOCKS + 40)
        shard = runner.shard
        if not whole:
            runner.chain.whole.usable = False
        logits, plain = [], shard.logits

        def caught(hidden, plain=plain, logits=logits):
            out = plain(hidden)
            logits.append(out)
            return out

        shard.logits = caught
        sched = greedy(runner, NUM_BLOCKS + 40)
        sched.add("long", prompt, 12)
        runs[whole] = (sched.run()["long"], [np.array(x.astype(mx.float32)) for x in logits], runner.chain.whole.usable)
    (tokens, logits, usable), (chain_tokens, chain_logits, _) = runs[True], runs[False]
    assert usable and tokens == chain_tokens
    for got, want in zip(logits, chain_logits):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


@cpu_only
def test_traces_past_the_limit_give_way_to_the_latest(llama_model, monkeypatch, decode_kernel_standin):
    """One trace per (batch size, table width), at most MAX_TRACES kept: with a limit of one, every
    change of shape makes a new trace in place of the last, and the tokens stay mlx-lm's."""
    monkeypatch.setattr(whole_step, "MAX_TRACES", 1)
    keys, original = [], whole_step.WholeStep._compiled

    def seen(self, key):
        keys.append(key)
        return original(self, key)

    monkeypatch.setattr(whole_step.WholeStep, "_compiled", seen)
    ref_model, tokenizer = load(str(llama_model))
    prompts = [tokenizer.encode("Tea or coffee?"), tokenizer.encode("Numbers 12345 and 67890, and more numbers")]
    runner = make_runner(llama_model)
    sched = greedy(runner)
    sched.add("short", prompts[0], 8)
    sched.add("long", prompts[1], 60)
    out = sched.run()
    assert out["short"] == mlx_lm_greedy(ref_model, prompts[0], 8)
    assert out["long"] == mlx_lm_greedy(ref_model, prompts[1], 60)
    assert len(set(keys)) >= 3 and len(runner.chain.whole.traces) == 1 and runner.chain.whole.usable
