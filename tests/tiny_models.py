"""Tiny random-weight model folders for tests (llama, qwen2, qwen3, and the MoE / sliding-window
families of MORE_FAMILIES).

`build_tiny_model(family, out_dir)` writes, in about a second, a folder that loads with
`mlx_lm.utils.load` and with transformers' AutoConfig/AutoTokenizer offline (so vLLM can
serve it): config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, special_tokens_map.json. Builds are deterministic in `seed`.

The weights are random but scaled so that greedy decoding is well-conditioned: clear gaps
between the top-1 and top-2 logits (so two correct implementations agree on every token,
and float noise cannot flip a choice) and varied output (so a bug that repeats one token or
drops the KV cache shows up as a different text).

`dtype="bfloat16"` (or "float16") stores the same values rounded to that dtype, with config.json's
torch_dtype saying so, as a real half-precision checkpoint does; the default is float32.
"""

from __future__ import annotations

import importlib
import json
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                        processors, trainers)

FAMILIES = ("llama", "qwen2", "qwen3")
# Held to the same checks by their own suite (tests/test_families.py), not by every FAMILIES test.
MORE_FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe", "gpt_oss", "gemma3_text", "deepseek_v3")
# Gated DeltaNet layers with a state per request (tests/test_hybrid.py).
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
# Checkpoints that may carry multi-token-prediction layers (build_tiny_model's mtp_layers).
MTP_FAMILIES = ("deepseek_v3", "glm4_moe")
# Vision-language checkpoints: the text model's config under text_config, its tensors under
# model.language_model, beside a vision tower and an MTP head that no stage reads.
NESTED_FAMILIES = ("qwen3_5", "qwen3_5_moe")

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Not special (as in Qwen2.5): they must survive skip_special_tokens, because vLLM's hermes
# parser looks for them in the decoded text.
TOOL_TOKENS = ("<tool_call>", "</tool_call>")
TOKENIZER_VOCAB_TARGET = 768  # reached: the trainer may merge pairs seen once
# Std of Linear weights is LINEAR_GAIN / sqrt(fan_in); see _init_weights. Measured over 3 seeds
# x 6 prompts x 20 greedy tokens per family: 1.5 and 2.0 let qwen3 (tied head, q/k norms) fall
# into one-token loops; 2.5 gives varied text, median top-1/top-2 logit gap ~1.5-2, smallest
# ~0.003.
LINEAR_GAIN = 2.5

QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
         "gpt_oss": "GptOssForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
         "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration",
         "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
# Llama is untied, the Qwens tied, so both lm_head paths are exercised by default.
_TIED = {"llama": False, "qwen2": True, "qwen3": True, "qwen3_moe": False, "mixtral": False, "glm4_moe": True,
         "gpt_oss": False, "gemma3_text": True, "deepseek_v3": False, "qwen3_next": False, "qwen3_5": True,
         "qwen3_5_moe": False}
# Checkpoint dtypes: config.json's torch_dtype name -> the MLX dtype the safetensors hold.
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
_ROPE_THETA = {"llama": 10000.0, "qwen2": 1000000.0, "qwen3": 1000000.0, "qwen3_moe": 1000000.0,
               "mixtral": 1000000.0, "glm4_moe": 1000000.0, "gpt_oss": 150000.0, "gemma3_text": 1000000.0,
               "deepseek_v3": 10000.0, "qwen3_next": 1000000.0, "qwen3_5": 1000000.0, "qwen3_5_moe": 1000000.0}
# A window a few tokens long, so the tests' prompts reach past it.
TINY_WINDOW = 8


def _family_config(family: str, num_layers: int, sliding_window: int | None) -> dict:
    """What each of MORE_FAMILIES adds to the common config: experts, routing, windows. The first two
    layers of qwen3_moe and glm4_moe are dense, so stage boundaries can cut between dense and MoE."""
    window = sliding_window or TINY_WINDOW
    if family == "qwen3_moe":
        return dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                    mlp_only_layers=[0, 1], norm_topk_prob=True, attention_bias=False,
                    use_sliding_window=False, sliding_window=None)
    if family == "mixtral":
        return dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    if family == "glm4_moe":
        return dict(n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                    n_group=2, topk_group=1, routed_scaling_factor=1.5, first_k_dense_replace=2,
                    norm_topk_prob=True, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5)
    if family == "gpt_oss":
        return dict(num_local_experts=4, num_experts_per_tok=2, experts_per_token=2, sliding_window=window,
                    attention_bias=True, swiglu_limit=7.0,
                    layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
                    rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "original_max_position_embeddings": 512, "truncate": False})
    if family == "gemma3_text":
        pattern = 3  # Gemma 3 has 5 sliding : 1 global; 2 : 1 keeps the model tiny
        return dict(sliding_window=window, sliding_window_pattern=pattern, query_pre_attn_scalar=16,
                    rope_local_base_freq=10000.0, hidden_activation="gelu_pytorch_tanh",
                    final_logit_softcapping=None, attn_logit_softcapping=None,
                    layer_types=["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                 for i in range(num_layers)])
    if family == "qwen3_next":
        # Gated DeltaNet layers with one gated full-attention layer in three (2 and 5 of six);
        # layer 0 dense, the rest MoE with a shared expert.
        return dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=3,
                    num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0],
                    moe_intermediate_size=32, shared_expert_intermediate_size=32, norm_topk_prob=True,
                    partial_rotary_factor=0.5, attention_bias=False)
    if family in NESTED_FAMILIES:
        # Qwen3-Next's layer pattern (attention at 2 and 5 of six) and sizes; RoPE from
        # rope_parameters with Qwen3.5's M-RoPE fields (8 rotary dims: 4 frequencies over 3 axes).
        # qwen3_5 is dense; qwen3_5_moe's layers are all MoE (mlx-lm has no dense layers there).
        linear = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                      linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=3,
                      layer_types=["full_attention" if (i + 1) % 3 == 0 else "linear_attention"
                                   for i in range(num_layers)],
                      attention_bias=False, attn_output_gate=True, mamba_ssm_dtype="float32",
                      rope_parameters={"rope_type": "default", "rope_theta": _ROPE_THETA[family],
                                       "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                       "mrope_interleaved": True})
        if family == "qwen3_5_moe":
            linear.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32, norm_topk_prob=True)
        return linear
    if family == "deepseek_v3":
        # MLA with a low-rank query (q_lora_rank, as V3 and Kimi K2 have) and V3's YaRN scaling
        # (mscale_all_dim changes the softmax scale); transformers sets head_dim to the rope part.
        return dict(kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                    head_dim=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                    moe_intermediate_size=32, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                    first_k_dense_replace=1, moe_layer_freq=1, norm_topk_prob=True, topk_method="noaux_tc",
                    scoring_func="sigmoid", attention_bias=False,
                    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    return {}


_QWEN3_NEXT_OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                            ".q_norm.weight", ".k_norm.weight")


def _mtp_weights(arch, config: dict, weights: dict, seed: int, n: int) -> dict:
    """MTP layers as DeepSeek V3's and GLM-4.5's checkpoints name them, `model.layers.{N + i}.*`
    after the N decoder layers: enorm and hnorm (of the next token's embedding and of the target's
    hidden state), eh_proj [hidden, 2 * hidden] mixing the two, one decoder layer (MoE, as past
    first_k_dense_replace), and shared_head (norm, head) with a copy of the embedding, as V3 has."""
    layer_class = getattr(arch, "DeepseekV3DecoderLayer", None) or arch.DecoderLayer
    args = arch.ModelArgs.from_dict(config)
    first, hidden = config["num_hidden_layers"], config["hidden_size"]
    # Norm gains away from one, the target's final norm's too: an MTP layer reads the target's
    # hidden state after that norm, and with gains of one a norm of a norm is the norm alone.
    gains = np.random.default_rng([seed, 8])
    out = {"model.norm.weight": mx.array(gains.uniform(0.5, 1.5, hidden).astype(np.float32))}
    for i in range(first, first + n):
        prefix = f"model.layers.{i}."
        block = _init_weights(layer_class(args, i), seed + 1000 + i)
        out.update({prefix + name: w for name, w in block.items()})
        rng = np.random.default_rng([seed, i, 7])
        out[prefix + "eh_proj.weight"] = mx.array(
            (LINEAR_GAIN / np.sqrt(2 * hidden)) * rng.standard_normal((hidden, 2 * hidden), np.float32))
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            out[prefix + norm + ".weight"] = mx.array(gains.uniform(0.5, 1.5, hidden).astype(np.float32))
        out[prefix + "embed_tokens.weight"] = weights["model.embed_tokens.weight"]
        out[prefix + "shared_head.head.weight"] = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    return out


def _hf_expert_names(family: str, weights: dict) -> dict:
    """mlx-lm stacks experts ([E, out, in]); a Hugging Face checkpoint stores one tensor per expert.
    The tiny MoE folders use the Hugging Face layout, so loading goes through mlx-lm's sanitize."""
    if family in NESTED_FAMILIES:
        return _hf_qwen3_5_names(weights)
    out = {}
    for name, w in weights.items():
        if family == "deepseek_v3" and name.endswith(".embed_q.weight"):
            # MLA: Hugging Face keeps one kv_b_proj [H * (nope + v), kv_lora_rank]; mlx-lm's sanitize
            # splits it into embed_q [H, kv_lora_rank, nope] and unembed_out [H, v, kv_lora_rank].
            prefix = name.removesuffix(".embed_q.weight")
            wv = weights[f"{prefix}.unembed_out.weight"]
            out[f"{prefix}.kv_b_proj.weight"] = mx.concatenate([w.swapaxes(-1, -2), wv], axis=1).reshape(-1, w.shape[1])
            continue
        if family == "deepseek_v3" and name.endswith(".unembed_out.weight"):
            continue
        if family == "qwen3_next" and name.endswith("conv1d.weight"):
            out[name] = w.swapaxes(1, 2)  # Hugging Face's Conv1d layout [channels, 1, kernel]
            continue
        if family == "qwen3_next" and name.endswith(_QWEN3_NEXT_OFFSET_NORMS):
            out[name] = w - 1.0  # stored as offsets from one; mlx-lm's sanitize adds the one back
            continue
        if ".switch_mlp." not in name or family not in ("qwen3_moe", "glm4_moe", "mixtral", "deepseek_v3",
                                                         "qwen3_next"):
            out[name] = w
            continue
        prefix, proj_param = name.split(".switch_mlp.")
        proj, param = proj_param.split(".")
        if family == "mixtral":
            proj = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}[proj]
        for e in range(w.shape[0]):
            out[f"{prefix}.experts.{e}.{proj}.{param}"] = w[e]
    return out

def _hf_qwen3_5_names(weights: dict) -> dict:
    """Qwen3.5's Hugging Face layout: the text model under model.language_model, the head at the top,
    conv1d and norms as for Qwen3-Next, each MoE layer's experts fused (experts.gate_up_proj
    [E, 2 * inter, hidden], experts.down_proj), and a vision tower and an MTP head beside them."""
    out = {}
    for name, w in weights.items():
        name = name.replace("language_model.model.", "model.language_model.", 1).replace("language_model.lm_head.", "lm_head.", 1)
        if name.endswith("conv1d.weight"):
            w = w.swapaxes(1, 2)
        elif name.endswith(_QWEN3_NEXT_OFFSET_NORMS):
            w = w - 1.0
        if ".switch_mlp." not in name:
            out[name] = w
        elif name.endswith(".gate_proj.weight"):
            prefix = name.split(".switch_mlp.")[0]
            up = weights["language_model." + name.replace("model.language_model.", "model.").replace("gate_proj", "up_proj")]
            out[f"{prefix}.experts.gate_up_proj"] = mx.concatenate([w, up], axis=1)
        elif name.endswith(".down_proj.weight"):
            out[f"{name.split('.switch_mlp.')[0]}.experts.down_proj"] = w
    rng = np.random.default_rng(1)
    for name, shape in (("model.visual.patch_embed.proj.weight", (32, 3, 2, 4, 4)), ("mtp.fc.weight", (64, 128)),
                        ("mtp.layers.0.mlp.down_proj.weight", (64, 32))):
        out[name] = mx.array(rng.standard_normal(shape, np.float32))
    return out


def _nest_text_config(family: str, flat: dict) -> dict:
    """config.json of a Qwen3.5 checkpoint: the text model's under text_config (RoPE from its
    rope_parameters alone), a small vision_config, and what the top level repeats."""
    # Qwen3.5-MoE's text config has no dense intermediate_size (all its layers are MoE).
    dropped = ("architectures", "rope_theta", "rope_scaling") + (("intermediate_size",) if "num_experts" in flat else ())
    text = {k: v for k, v in flat.items() if k not in dropped}
    text["model_type"] = f"{family}_text"
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
              "temporal_patch_size": 2, "out_hidden_size": flat["hidden_size"], "num_position_embeddings": 64}
    return {"architectures": flat["architectures"], "model_type": family, "text_config": text,
            "vision_config": vision, "tie_word_embeddings": flat["tie_word_embeddings"],
            "torch_dtype": flat["torch_dtype"], "bos_token_id": flat["bos_token_id"],
            "eos_token_id": flat["eos_token_id"]}


# Deterministic training text for the tokenizer. Mixed prose, numbers, code and JSON so the
# merges cover what the tests send (chat turns, tool calls).
CORPUS = """\
The quick brown fox jumps over the lazy dog. A small cluster of computers can serve a large
language model when each machine runs a few of its layers and passes the hidden state to the
next one. The scheduler decides which requests run in each step, and the cache keeps the keys
and values of every token that was already processed.

Once upon a time there was a little town by the sea. Every morning the fishermen went out in
their boats, and every evening they came back with baskets full of fish. The children ran along
the beach, the old people sat in the sun, and the baker sold warm bread to anyone who asked.

What is the weather like today? It is sunny in Paris, cloudy in London and raining in Berlin.
The temperature is 21 degrees in the afternoon and 14 degrees at night. Tomorrow will be warmer,
with a light wind from the south and a few clouds in the evening.

Hello! How can I help you today? I can answer questions, write short stories, explain how a
program works, or call a tool when you need live information such as the time or the weather.
Please tell me what you would like to do, and I will do my best to help.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, 1))

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"name": "get_time", "arguments": {"timezone": "Europe/Berlin"}}
{"type": "function", "function": {"name": "search", "parameters": {"type": "object",
"properties": {"query": {"type": "string", "description": "The text to search for."}}}}}

One, two, three, four, five, six, seven, eight, nine, ten. 0 1 2 3 4 5 6 7 8 9 10 100 1000.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday are the days of the week.
January, February, March, April, May, June, July, August, September, October, November and
December are the months of the year. Red, green, blue, yellow, black and white are colours.
"""

# ChatML with Hermes / Qwen2.5-style tools. Every output goes through `{{- ... }}` and every
# tag trims whitespace, so the layout of this source does not leak into the rendered text.
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is string -%}{{- content -}}
    {%- elif content -%}{%- for part in content if part.type == 'text' -%}{{- part.text -}}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- render_content(messages[0].content) + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and '
        'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
        '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and tools and loop.first %}
        {#- already rendered inside the tools system block #}
    {%- elif message.role == 'tool' %}
        {#- consecutive tool results share one user turn #}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) }}
        {%- if message.role == 'assistant' and message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
                {%- if loop.first and not message.content %}
                    {{- '<tool_call>\\n' }}
                {%- else %}
                    {{- '\\n<tool_call>\\n' }}
                {%- endif %}
                {{- '{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on CORPUS; specials first (ids 0-2), tool tags last."""
    tok = Tokenizer(models.BPE())
    # Qwen2.5's exact normalizer and pre-tokenizer: transformers 5 rebuilds model_type "qwen2"
    # tokenizers with them whatever tokenizer.json says, so using them everywhere keeps the raw
    # `tokenizers` file, AutoTokenizer, mlx-lm and vLLM producing identical ids.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()  # mlx-lm picks its BPE streaming detokenizer from this
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_TARGET,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte encodes
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tok


def _hf_config(family, *, num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads,
               head_dim, tie, sliding_window, vocab_size, bos_id, eos_id, dtype="float32") -> dict:
    cfg = {
        "architectures": [_ARCH[family]],
        "model_type": family,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        # Top-level rope_theta: mlx-lm's llama/qwen2 read only this; transformers 5 folds it
        # into rope_parameters.
        "rope_theta": _ROPE_THETA[family],
        "rope_scaling": None,
        "max_position_embeddings": 2048,
        "vocab_size": vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "tie_word_embeddings": tie,
        "torch_dtype": dtype,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if family in MORE_FAMILIES + HYBRID_FAMILIES:
        pass
    elif family == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
        if sliding_window is not None:
            # Even layers sliding, odd layers full: mlx-lm's llama and vLLM's llama both read
            # layer_types, and mlx-lm needs at least one full-attention layer.
            cfg["layer_types"] = [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
            ]
            cfg["sliding_window"] = sliding_window
    else:
        # Written out explicitly so no loader falls back to Qwen's 4096/32768-token defaults.
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
    if family == "qwen3":
        cfg["attention_bias"] = False
    cfg.update(_family_config(family, num_layers, sliding_window))
    return cfg


def _init_weights(model, seed: int, gain_of_one: float = 1.0) -> dict[str, mx.array]:
    """Seeded random values for every parameter of the (lazily initialised) mlx-lm model.
    `gain_of_one`: the norm weight that scales by one (Gemma's norms scale by 1 + w)."""
    weights = {}
    for name, p in tree_flatten(model.parameters()):
        # One generator per tensor, keyed by name: values don't depend on iteration order, and
        # layer i is the same whatever num_layers is.
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if name.endswith("norm.weight"):  # RMSNorm gains (layer norms, final norm, q/k norms)
            w = np.full(p.shape, gain_of_one, np.float32)
        elif name.endswith(".bias"):  # qwen2 q/k/v biases: small, so they matter but don't dominate
            w = 0.1 * rng.standard_normal(p.shape, np.float32)
        elif "embed_tokens" in name or name.endswith("lm_head.weight"):
            # std 1: each token's embedding is a clear direction in the residual stream, and the
            # logits (normed hidden . row) get std ~sqrt(hidden): top-1/top-2 gaps ~0.1-1 or more.
            # The untied head uses the same scale as the tied one.
            w = rng.standard_normal(p.shape, np.float32)
        else:
            # Linear [out, in]: std gain/sqrt(fan_in) keeps each sublayer's output at rms ~gain
            # (its input is RMS-normed). gain > 1 makes the layers outweigh the input embedding,
            # so a tied head does not just echo the current token, and it sharpens attention.
            w = (LINEAR_GAIN / np.sqrt(p.shape[-1])) * rng.standard_normal(p.shape, np.float32)
        weights[name] = mx.array(w)
    return weights


def build_tiny_model(family: str, out_dir: Path, *, num_layers: int = 4, hidden_size: int = 64,
                     intermediate_size: int = 128, num_heads: int = 4, num_kv_heads: int = 2,
                     head_dim: int | None = None, tie_word_embeddings: bool | None = None,
                     sliding_window: int | None = None, seed: int = 0, dtype: str = "float32",
                     config_overrides: dict | None = None, mtp_layers: int = 0) -> Path:
    """Write a tiny random model of `family` into `out_dir` (created) and return it.

    `dtype` is the checkpoint's dtype name (a key of DTYPES): the float32 draws rounded to it.
    `config_overrides` replace config.json keys (e.g. which layers are dense).
    `mtp_layers` (deepseek_v3, glm4_moe): multi-token-prediction layers after the decoder layers, as
    DeepSeek V3 and GLM-4.5 ship them (`num_nextn_predict_layers`; `_mtp_weights`).
    """
    if family not in FAMILIES + MORE_FAMILIES + HYBRID_FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES + MORE_FAMILIES + HYBRID_FAMILIES}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {tuple(DTYPES)}")
    if head_dim is None:
        head_dim = hidden_size // num_heads
    if family == "qwen2" and head_dim != hidden_size // num_heads:
        # mlx-lm's qwen2 ignores head_dim and uses hidden_size // num_heads.
        raise ValueError("qwen2 needs head_dim == hidden_size // num_heads")
    if sliding_window is not None and family not in ("llama", "gpt_oss", "gemma3_text"):
        # mlx-lm's qwen2/qwen3 ignore sliding windows, so they would disagree with vLLM.
        raise ValueError("sliding_window is only supported for family 'llama'")
    tie = _TIED[family] if tie_word_embeddings is None else tie_word_embeddings
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer()
    bos_id, eos_id = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    config = _hf_config(
        family, num_layers=num_layers, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, tie=tie, sliding_window=sliding_window,
        vocab_size=tok.get_vocab_size(with_added_tokens=True), bos_id=bos_id, eos_id=eos_id, dtype=dtype,
    )
    config.update(config_overrides or {})
    if mtp_layers:
        if family not in MTP_FAMILIES:
            raise ValueError(f"mtp_layers: only {MTP_FAMILIES} fixtures carry multi-token-prediction layers")
        config["num_nextn_predict_layers"] = mtp_layers
    if family in NESTED_FAMILIES:
        config = _nest_text_config(family, config)

    # Parameter names and shapes come from mlx-lm's own model class, so they are exactly what
    # mlx_lm.utils.load expects (and, for these families, the Hugging Face names too).
    # mlx initialises lazily: building the module allocates nothing until evaluated.
    arch = importlib.import_module(f"mlx_lm.models.{family}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    weights = _init_weights(model, seed, gain_of_one=0.0 if family == "gemma3_text" else 1.0)
    if mtp_layers:
        weights.update(_mtp_weights(arch, config, weights, seed, mtp_layers))
    weights = {name: w.astype(DTYPES[dtype]) for name, w in _hf_expert_names(family, weights).items()}
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})

    tok.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
               "pad_token": "<|endoftext|>", "unk_token": None}
    files = {
        "config.json": config,
        "generation_config.json": {"bos_token_id": bos_id, "eos_token_id": eos_id,
                                   "pad_token_id": bos_id, "do_sample": False},
        "special_tokens_map.json": {k: v for k, v in special.items() if v is not None},
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 2048,
            "chat_template": CHAT_TEMPLATE,
        },
    }
    for name, content in files.items():
        (out_dir / name).write_text(json.dumps(content, indent=2) + "\n")
    return out_dir


def build_tiny_classifier(family: str, out_dir: Path, *, num_labels: int = 1, seed: int = 0, **kwargs) -> Path:
    """A tiny random sequence classifier (`<Family>ForSequenceClassification`, as Hugging Face saves
    one): the causal LM of `build_tiny_model` with its lm_head replaced by a `score` head
    [num_labels, hidden] and config.json naming its labels. vLLM serves it with its classify task."""
    out_dir = build_tiny_model(family, out_dir, seed=seed, **kwargs)
    weights = {k: v for k, v in mx.load(str(out_dir / "model.safetensors")).items() if not k.startswith("lm_head.")}
    config = json.loads((out_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    rng = np.random.default_rng(zlib.crc32(f"score-{seed}".encode()))
    dtype = weights["model.embed_tokens.weight"].dtype
    score = rng.normal(0, 1 / np.sqrt(hidden), (num_labels, hidden)).astype(np.float32)
    weights["score.weight"] = mx.array(score).astype(dtype)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    config["architectures"] = [_ARCH[family].replace("ForCausalLM", "ForSequenceClassification")]
    config["id2label"] = {str(i): f"LABEL_{i}" for i in range(num_labels)}
    config["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
