"""Fused projections (stage_worker/model/fuse.py): q/k/v as one matmul and a SwiGLU MLP's gate/up as
one, as a GPU stage loads a dense family. The CPU backend never fuses at load (its float32 path is
token-exact against mlx-lm, and OpenBLAS rounds a fused prompt's product differently); these tests
fuse a CPU stage by hand, where MLX's own BLAS gives the same sums, so every check is exact."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.utils import load

import tiny_models
from lora_fixtures import fused_model
from metal_cluster.coordinator.engine.lora_adapters import read_adapter
from metal_cluster.kernels import gpu_backend
from metal_cluster.stage_worker.families import REGISTRY, LayerCache
from metal_cluster.stage_worker.families.dense import Llama
from metal_cluster.stage_worker.kv.paged_kv import KVPool
from metal_cluster.stage_worker.model import fuse
from metal_cluster.stage_worker.model.model_source import resolve_model
from metal_cluster.stage_worker.model.shard import load_shard
from metal_cluster.stage_worker.step.runner import StageRunner
from references import mlx_lm_greedy
from scheduler_double import SchedulerDouble

# On a GPU the dense families load fused already, in bf16: tests/test_gpu_dtype.py checks them there.
pytestmark = pytest.mark.skipif(gpu_backend() is not None, reason="a GPU stage loads fused; test_gpu_dtype covers it")

BLOCK_SIZE, NUM_BLOCKS = 8, 64
PROMPTS = ["Hello world, this is a test", "The quick brown fox jumps over the lazy dog", "Tea or coffee?"]


def fused_runner(folder) -> StageRunner:
    shard = load_shard(resolve_model(folder))
    assert not any(fuse.is_fused(layer) for layer in shard.layers)  # the CPU backend loads them as they are
    for layer in shard.layers:
        fuse.fuse_layer(layer)
    return StageRunner(shard, KVPool.allocate(shard.caches, NUM_BLOCKS, BLOCK_SIZE, shard.dtype))


def greedy(runner, prompts: dict[str, list[int]], max_tokens: int, lora: int = 0) -> dict[str, list[int]]:
    def step_fn(step):
        for new in step.new_requests:
            new.lora_id = lora
        return {r: s.token_id for r, s in runner.step(step).sampled.items()}

    sched = SchedulerDouble(step_fn, NUM_BLOCKS, BLOCK_SIZE, chunk_size=6)
    for req_id, ids in prompts.items():
        sched.add(req_id, ids, max_tokens)
    return sched.run()


@pytest.fixture(scope="module", params=[f for f in tiny_models.FAMILIES + tiny_models.MORE_FAMILIES
                                        if REGISTRY[f].fuses_projections])
def fusing_model(request, tmp_path_factory):
    return tiny_models.build_tiny_model(request.param, tmp_path_factory.mktemp(f"{request.param}-fused"))


def test_a_fused_stage_decodes_as_mlx_lm(fusing_model):
    """llama, qwen2 (q/k/v biases), qwen3 (q/k norms after the split), and the attention of
    qwen3_moe and mixtral (whose experts stay as they are): packed prompts, chunked beside decodes,
    then compiled decode steps, all through the fused layers."""
    ref, tokenizer = load(str(fusing_model))
    runner = fused_runner(fusing_model)
    moe = runner.shard.config["model_type"] in ("qwen3_moe", "mixtral")
    for layer in runner.shard.layers:
        assert "qkv" in layer.self_attn and not any(n in layer.self_attn.inner for n in fuse.ATTENTION_PARTS)
        if not moe:
            assert isinstance(layer.mlp, fuse.SwiGLU) and not any(n in layer.mlp.original for n in fuse.MLP_PARTS)
    prompts = {f"r{i}": tokenizer.encode(p) for i, p in enumerate(PROMPTS)}
    got = greedy(runner, prompts, 12)
    assert got == {r: mlx_lm_greedy(ref, ids, 12) for r, ids in prompts.items()}


def test_unfusing_gives_back_the_loaded_weights_bit_for_bit(llama_model):
    shard = load_shard(resolve_model(llama_model))
    loaded = dict(tree_flatten(shard.model.parameters()))
    for layer in shard.layers:
        fuse.fuse_layer(layer)
    fused = dict(tree_flatten(shard.model.parameters()))
    assert sum(v.nbytes for v in fused.values()) == sum(v.nbytes for v in loaded.values())  # moved, not copied
    assert all(fuse.unfuse_layer(layer) for layer in shard.layers)
    assert not any(fuse.unfuse_layer(layer) for layer in shard.layers)  # nothing left to undo
    back = dict(tree_flatten(shard.model.parameters()))
    assert back.keys() == loaded.keys()
    assert all(mx.array_equal(back[k], loaded[k]).item() for k in loaded)


def test_quantized_projections_fuse_with_their_scales():
    """4-bit q/k/v and gate/up (with biases, as qwen2 has) side by side: the same outputs, and
    unfused, the same quantized triples."""
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=1, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64,
                           attention_bias=True, mlp_bias=True)
    block = llama.TransformerBlock(args)
    nn.quantize(block, group_size=32, bits=4)
    block.self_attn = Llama().paged_attention(block.self_attn, LayerCache(2, 32))
    x, positions = mx.random.normal((1, 5, 128)), mx.arange(5)
    want = (*block.self_attn.before(x, positions), block.mlp(x))
    quantized = dict(tree_flatten(block.parameters()))

    fuse.fuse_layer(block)
    assert isinstance(block.self_attn.qkv, nn.QuantizedLinear) and isinstance(block.mlp.gate_up, nn.QuantizedLinear)
    got = (*block.self_attn.before(x, positions), block.mlp(x))
    assert all(mx.allclose(g, w, rtol=1e-5, atol=1e-5).item() for g, w in zip(got, want))

    fuse.unfuse_layer(block)
    back = dict(tree_flatten(block.parameters()))
    assert back.keys() == quantized.keys()
    assert all(mx.array_equal(back[k], quantized[k]).item() for k in quantized)


def test_a_lora_adapter_unfuses_the_layers_it_adapts(llama_model, llama_adapters):
    """An adapter wraps q_proj, v_proj, ...: the layers get them back before it is applied, and the
    text equals mlx-lm's with the adapter merged."""
    ref, tokenizer = load(str(llama_model))
    merged = fused_model(llama_model, llama_adapters["alpha"])
    runner = fused_runner(llama_model)
    layers = len(runner.shard.layers)
    runner.lora.add(read_adapter(llama_adapters["alpha"], "alpha", llama_model, 8).add_request(1, 1, 8, range(layers)))
    assert not any(fuse.is_fused(layer) for layer in runner.shard.layers)
    prompts = {"r0": tokenizer.encode(PROMPTS[0])}
    assert greedy(runner, prompts, 10, lora=1) == {"r0": mlx_lm_greedy(merged, prompts["r0"], 10)}
    assert greedy(runner, prompts, 10) == {"r0": mlx_lm_greedy(ref, prompts["r0"], 10)}


def test_a_stage_fuses_where_it_computes_on_a_gpu(llama_model, monkeypatch):
    """The load decides by the backend (`dtypes.on_gpu`, pretended here) and METAL_CLUSTER_FUSE."""
    from metal_cluster.stage_worker.model import dtypes

    source = resolve_model(llama_model)
    assert not any(fuse.is_fused(layer) for layer in load_shard(source).layers)
    monkeypatch.setattr(dtypes, "on_gpu", lambda: True)
    assert all(fuse.is_fused(layer) for layer in load_shard(source).layers)
    monkeypatch.setattr(fuse, "FUSE", False)  # what METAL_CLUSTER_FUSE=0 sets
    assert not any(fuse.is_fused(layer) for layer in load_shard(source).layers)


def test_a_layer_without_attention_has_nothing_to_unfuse(tmp_path):
    """A LoRA adapter unfuses every layer it names; a hybrid model's Gated DeltaNet layers have no
    self_attn, and are left as they are."""
    shard = load_shard(resolve_model(tiny_models.build_tiny_model("qwen3_next", tmp_path / "next")))
    recurrent = [layer for layer in shard.layers if "self_attn" not in layer]
    assert recurrent
    assert not any(fuse.unfuse_layer(layer) or fuse.is_fused(layer) for layer in recurrent)
