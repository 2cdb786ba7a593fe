"""The tiny-model fixture builder: loads everywhere, decodes greedily and well-conditioned."""

import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only; never reach for the hub

import mlx.core as mx
import pytest
from mlx_lm.generate import generate, stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load
from tiny_models import FAMILIES, build_tiny_model, build_tokenizer
from transformers import AutoConfig, AutoTokenizer

GREEDY = make_sampler(temp=0.0)
PROMPT = "<|im_start|>user\nWhat is the weather like in Paris today?<|im_end|>\n<|im_start|>assistant\n"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One default build per family, shared by the read-only tests."""
    root = tmp_path_factory.mktemp("tiny")
    return {f: build_tiny_model(f, root / f) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_build_is_fast_and_deterministic(family, tmp_path):
    t0 = time.perf_counter()
    a = build_tiny_model(family, tmp_path / "a", seed=0)
    assert time.perf_counter() - t0 < 2.0
    b = build_tiny_model(family, tmp_path / "b", seed=0)
    c = build_tiny_model(family, tmp_path / "c", seed=1)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()

    texts = []
    for path in (a, b):
        model, tokenizer = load(path)
        texts.append(generate(model, tokenizer, PROMPT, max_tokens=16, sampler=GREEDY))
    assert texts[0] != ""
    assert texts[0] == texts[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_is_well_conditioned(family, built):
    # Guards the init scale: near-ties would let float noise flip greedy tokens between two
    # correct implementations, and a collapsed model would hide cache/position bugs.
    model, tokenizer = load(built[family])
    gaps, tokens = [], []
    for r in stream_generate(model, tokenizer, PROMPT, max_tokens=16, sampler=GREEDY):
        top2 = mx.sort(r.logprobs)[-2:]  # logprob gaps equal logit gaps
        gaps.append((top2[1] - top2[0]).item())
        tokens.append(r.token)
    assert len(tokens) == 16, "stopped early on EOS; pick another prompt"
    assert min(gaps) > 1e-3, gaps
    assert len(set(tokens)) >= 6, tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_config_and_tokenizer_load_with_transformers(family, built):
    path = built[family]
    cfg = AutoConfig.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    assert cfg.model_type == family
    assert raw["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                     "qwen3": "Qwen3ForCausalLM"}[family]]
    assert cfg.tie_word_embeddings == (family != "llama")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (64, 4, 16)
    assert cfg.max_position_embeddings == 2048
    assert cfg.vocab_size == len(tok) and 512 <= len(tok) <= 1024
    assert tok.eos_token == "<|im_end|>" and cfg.eos_token_id == tok.eos_token_id
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_round_trip(family, built):
    # transformers rebuilds qwen2 tokenizers with its own pre-tokenizer; all loaders must agree.
    raw = build_tokenizer()
    hf = AutoTokenizer.from_pretrained(built[family])
    _, wrapped = load(built[family])
    for text in ["Hello, world!  Two  spaces\n\nand 12345 digits.", "héllo 🙂 café",
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                 "<|im_start|>user\nhi<|im_end|>"]:
        ids = raw.encode(text).ids
        assert hf.encode(text) == ids == wrapped.encode(text)
        assert hf.decode(ids) == text
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        assert len(hf.encode(t)) == 1, t
    # The tool tags must survive skip_special_tokens: vLLM's hermes parser reads the text.
    assert "<tool_call>" in hf.decode(hf.encode("<tool_call>{}</tool_call>"), skip_special_tokens=True)


def test_chat_template_without_tools(built):
    tok = AutoTokenizer.from_pretrained(built["qwen3"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_with_tools(built):
    tok = AutoTokenizer.from_pretrained(built["llama"])
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "21 C, sunny"},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert "<tool_call></tool_call> XML tags" in text
    assert ("<|im_start|>assistant\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n') in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n21 C, sunny\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")


def test_sliding_window_llama(tmp_path):
    path = build_tiny_model("llama", tmp_path / "m", sliding_window=8)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
    model, _ = load(path)
    assert [type(c).__name__ for c in model.make_cache()] == ["RotatingKVCache", "KVCache"] * 2
    with pytest.raises(ValueError):
        build_tiny_model("qwen3", tmp_path / "q", sliding_window=8)


def test_larger_variant(tmp_path):
    t0 = time.perf_counter()
    path = build_tiny_model("qwen3", tmp_path / "big", num_layers=8, hidden_size=512,
                            intermediate_size=2048, num_heads=8, num_kv_heads=4)
    assert time.perf_counter() - t0 < 10.0
    model, tokenizer = load(path)
    text = generate(model, tokenizer, PROMPT, max_tokens=4, sampler=GREEDY)
    assert text != ""
