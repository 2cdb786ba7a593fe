"""GGUF checkpoints, turned into what the rest of the project needs, with no torch on the path.

A GGUF file holds the weights, the model's hyper-parameters and the tokenizer in one file. The
rest of the project wants what a Hugging Face checkpoint has: a folder with config.json and the
tokenizer files (vLLM's front end and transformers read those), plus a dict of weights under the
names mlx-lm's model classes use. This module produces both:

- `read_gguf(path)`            tensors and metadata, or a one-line ModelLoadError;
- `hf_config(metadata, names)` the config.json dict;
- `tokenizer_files(metadata)`  tokenizer.json, tokenizer_config.json, ... as JSON texts;
- `prepare_gguf_folder(...)`   a cached folder holding all of the above;
- `gguf_weights(...)`          GGUF tensors renamed (and un-permuted, dequantized) for mlx-lm.

MLX reads GGUF natively: Q4_0/Q4_1/Q8_0 tensors come back as MLX affine-quantized triples
(`x.weight` packed uint32, `x.scales`, `x.biases`, group size 32), other quantized types (K-quants)
come back already dequantized to float16.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable

import mlx.core as mx
import numpy as np

from metal_cluster.stage_worker.errors import ModelLoadError

# GGUF `general.architecture` -> the Hugging Face class name that config.json announces.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM"}
# Where llama.cpp's architecture name is not mlx-lm's model_type.
_MODEL_TYPES = {"qwen3moe": "qwen3_moe"}

# GGUF token types (llama.cpp's llama_token_type); these two must never be split by BPE.
_CONTROL, _USER_DEFINED = 3, 4

# Every GGUF type MLX keeps quantized uses blocks of 32 values per scale/bias.
GROUP_SIZE = 32


def read_gguf(path: str | Path) -> tuple[dict[str, mx.array], dict]:
    """All tensors and metadata of a GGUF file; any problem is one ModelLoadError line."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"cannot read GGUF {path}: no such file")
    try:
        # format= so that a GGUF named without the .gguf suffix still loads.
        tensors, metadata = mx.load(str(path), format="gguf", return_metadata=True)
    except Exception as e:  # MLX raises RuntimeError or ValueError with a multi-word reason
        reason = " ".join(str(e).split())
        raise ModelLoadError(
            f"cannot read GGUF {path}: file is truncated or not a GGUF ({reason})"
        ) from None
    architecture(metadata, source=path)
    return tensors, metadata


def check_structure(path: Path) -> None:
    """Walk the file's header and tensor table with llama.cpp's own reader, bounds-checked.

    MLX's GGUF loader trusts the header: a corrupt one can crash the process instead of raising.
    This runs once per file (prepare_gguf_folder's result is cached), before MLX ever sees it.
    """
    from gguf import GGUFReader

    try:
        GGUFReader(path)
    except Exception as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise ModelLoadError(f"cannot read GGUF {path}: file is truncated or not a GGUF ({reason})") from None


def architecture(metadata: dict, source: str | Path = "GGUF") -> str:
    """`general.architecture`, checked against the ones this module can map."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: unsupported GGUF architecture {arch!r}; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    return arch


def _py(value):
    """Metadata value as plain Python: MLX hands scalars back as 0-d arrays, arrays as 1-d."""
    if not isinstance(value, mx.array):
        return value
    if value.dtype == mx.float32:
        # float32 through its shortest decimal, so config.json says 1e-05, not 9.99999974e-06.
        return float(str(np.float32(value.item()))) if value.ndim == 0 else value.tolist()
    return value.item() if value.ndim == 0 else value.tolist()


def _arch_value(metadata: dict, key: str, default=None):
    """A per-architecture key such as `llama.block_count`."""
    return _py(metadata.get(f"{metadata.get('general.architecture')}.{key}", default))


def hf_config(metadata: dict, tensor_names: Iterable[str]) -> dict:
    """A Hugging Face config.json dict for the GGUF model, as mlx-lm and transformers read it.

    tensor_names decides tie_word_embeddings: a GGUF without `output.weight` reuses the
    embedding matrix as the LM head.
    """
    arch = architecture(metadata)
    names = set(tensor_names)
    if "rope_freqs.weight" in names:
        # Llama 3.1-style RoPE scaling is stored as a tensor whose parameters the metadata lacks.
        raise ModelLoadError("GGUF with rope_freqs (Llama 3.1-style RoPE scaling) is not supported")
    get = lambda key, default=None: _arch_value(metadata, key, default)  # noqa: E731
    hidden, heads = get("embedding_length"), get("attention.head_count")
    config = {
        "model_type": _MODEL_TYPES.get(arch, arch),
        "architectures": [ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length"),
        # Older converters omit vocab_size; the token list always has it.
        "vocab_size": get("vocab_size") or len(metadata["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",  # MLX's CPU backend is fastest in float32 (DESIGN.md)
    }
    if get("expert_count"):
        # llama.cpp's qwen3moe: every layer sparse, top-k weights renormalised.
        config.update(num_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
                      moe_intermediate_size=get("expert_feed_forward_length"), decoder_sparse_step=1,
                      mlp_only_layers=[], norm_topk_prob=True)
        config["intermediate_size"] = config["intermediate_size"] or config["moe_intermediate_size"]
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        config["rope_scaling"] = {"rope_type": scaling, "factor": get("rope.scaling.factor")}
        original = get("rope.scaling.original_context_length")
        if original:
            config["rope_scaling"]["original_max_position_embeddings"] = original
    for name in ("bos", "eos"):
        if f"tokenizer.ggml.{name}_token_id" in metadata:
            config[f"{name}_token_id"] = _py(metadata[f"tokenizer.ggml.{name}_token_id"])
    return config


# ---------------------------------------------------------------------------------------------
# Tokenizer


# Pre-tokenizer regexes as the original Hugging Face tokenizer.json files spell them.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"\p{N}|", r"\p{N}{1,3}|", 1)


def _pre_tokenizer(pre: str):
    """The HF pre-tokenizer that llama.cpp's `tokenizer.ggml.pre` name stands for."""
    from tokenizers import Regex, pre_tokenizers as pt

    if pre == "smollm":  # SmolLM/SmolLM2: every digit on its own, then GPT-2's byte-level split
        return pt.Sequence(
            [pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    if pre == "gpt2":
        return pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("qwen2", "llama-bpe"):
        regex = Regex(_QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT)
        return pt.Sequence(
            [
                pt.Split(regex, behavior="isolated"),
                pt.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ModelLoadError(
        f"unsupported GGUF tokenizer pre-tokenizer {pre!r}; supported: smollm, gpt2, qwen2, llama-bpe"
    )


def _token(metadata: dict, name: str) -> str | None:
    """The text of a special token (`bos`, `eos`, `unknown`, `padding`), if the GGUF names one."""
    key = f"tokenizer.ggml.{name}_token_id"
    return metadata["tokenizer.ggml.tokens"][_py(metadata[key])] if key in metadata else None


def _tokenizer_json(metadata: dict) -> str:
    """tokenizer.json, built with the `tokenizers` library from the GGUF vocabulary and merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE)"
        )
    tokens = metadata["tokenizer.ggml.tokens"]
    # Merges are stored as "Ġ t" strings; the BPE model wants ("Ġ", "t") pairs.
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre = metadata.get("tokenizer.ggml.pre", "gpt2")
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    if pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    if _py(metadata.get("tokenizer.ggml.add_bos_token", False)) and _token(metadata, "bos"):
        # Models that want a BOS in front of every prompt (Llama 3) get it from a post-processor,
        # as in their HF tokenizer.json. SmolLM2 says false: its chat template adds <|im_start|>.
        bos, bos_id = _token(metadata, "bos"), _py(metadata["tokenizer.ggml.bos_token_id"])
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    # Control tokens (<|im_start|>, ...) and user-defined ones are added tokens: matched whole in
    # the raw text before BPE runs, so they always encode to their single id.
    types = _py(metadata.get("tokenizer.ggml.token_type", []))
    control = [tokens[i] for i, t in enumerate(types) if t == _CONTROL]
    user_defined = [tokens[i] for i, t in enumerate(types) if t == _USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
    return tokenizer.to_str(pretty=True)


# llama.cpp's sampling keys (GGUF `general.sampling.*`) -> Hugging Face generation_config names.
_SAMPLING_KEYS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "penalty_repeat": "repetition_penalty"}


def sampling_defaults(metadata: dict) -> dict:
    """The sampling defaults a GGUF file names for itself, as generation_config.json keys; vLLM
    applies them to requests that leave those fields out."""
    found = {hf: _py(metadata[f"general.sampling.{key}"]) for key, hf in _SAMPLING_KEYS.items()
             if f"general.sampling.{key}" in metadata}
    return {**found, "do_sample": True} if found else {}


def tokenizer_files(metadata: dict, sampling: dict | None = None) -> dict[str, str]:
    """File name -> JSON text for the tokenizer (and generation config) files of a Hugging Face
    folder; `sampling` (generation_config.json names) wins over the file's own sampling keys."""
    specials = {
        f"{role}_token": _token(metadata, name)
        for role, name in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
        if _token(metadata, name) is not None
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        # llama.cpp's own flag; SmolLM2's chat template writes every special token itself.
        "add_bos_token": bool(_py(metadata.get("tokenizer.ggml.add_bos_token", False))),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _arch_value(metadata, "context_length"),
    }
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    generation = {
        f"{name}_token_id": _py(metadata[f"tokenizer.ggml.{name}_token_id"])
        for name in ("bos", "eos")
        if f"tokenizer.ggml.{name}_token_id" in metadata
    }
    generation.update(sampling_defaults(metadata))
    if sampling:
        generation.update({**sampling, "do_sample": True})
    dump = lambda obj: json.dumps(obj, indent=2, ensure_ascii=False)  # noqa: E731
    return {
        "tokenizer.json": _tokenizer_json(metadata),
        "tokenizer_config.json": dump(config),
        "special_tokens_map.json": dump(specials),
        "generation_config.json": dump(generation),
    }


# ---------------------------------------------------------------------------------------------
# The cached Hugging Face style folder


# Bump when what prepare_gguf_folder writes changes, so old cached folders are not reused.
FOLDER_FORMAT = 2


def prepare_gguf_folder(gguf_path: str | Path, cache_root: str | Path, sampling: dict | None = None) -> Path:
    """A folder with config.json, the tokenizer files and gguf_source.json for a GGUF file.

    `sampling`: generation defaults (generation_config.json names, e.g. temperature) that win over
    any the file names itself; vLLM applies them to requests without those fields.
    The folder name carries a hash of (absolute path, size, mtime, sampling), so an edited or
    replaced file gets a fresh folder and an unchanged one reuses the old folder without reading the GGUF.
    """
    path = Path(gguf_path).resolve()
    if not path.is_file():
        raise ModelLoadError(f"cannot read GGUF {path}: no such file")
    stat = path.stat()
    sampling = dict(sampling or {})
    identity = f"{FOLDER_FORMAT}\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{json.dumps(sampling, sort_keys=True)}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:12]
    cache_root = Path(cache_root)
    folder = cache_root / f"{path.stem}-{key}"
    if folder.is_dir():  # it only ever appears by rename, so it is complete
        return folder

    check_structure(path)
    tensors, metadata = read_gguf(path)
    try:
        files = {
            "config.json": json.dumps(hf_config(metadata, tensors), indent=2),
            **tokenizer_files(metadata, sampling),
            "gguf_source.json": json.dumps({"gguf": str(path)}, indent=2),
        }
    except ModelLoadError as e:  # hf_config/tokenizer_files do not know the file: name it
        raise ModelLoadError(f"{path}: {e}") from None
    del tensors  # only the names were needed; free the weights before writing
    # Write into a temporary sibling, then rename: a reader never sees a half-written folder,
    # and two processes preparing the same file at once both end up with one good folder.
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=cache_root))
    try:
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        os.rename(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not folder.is_dir():  # not a lost race: a real problem (disk full, permissions)
            raise
    return folder


# ---------------------------------------------------------------------------------------------
# Weights

# Per-layer GGUF names -> mlx-lm / Hugging Face module names.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Experts, stacked [experts, out, in] as mlx-lm's SwitchGLU holds them.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (suffix kept as is)."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no mlx-lm counterpart")


def _unpermute_rows(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation, giving back the Hugging Face row order.

    llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute) does
        w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2).reshape(w.shape)
    turning each head's rows from HF's two halves (rotate-half RoPE) into interleaved pairs
    (llama.cpp's "normal" RoPE). The inverse reads the rows as (n_head, d // 2, 2) and swaps back.
    Only rows (the output dimension) move, so packed quantized rows, scales and biases can take
    the same permutation as plain weights.
    """
    return w.reshape(n_head, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _permute_heads(gguf_name: str, config: dict) -> int | None:
    """How many heads a tensor's rows were permuted over by llama.cpp (None: not permuted)."""
    if config["model_type"] != "llama":  # qwen2/qwen3 use NEOX RoPE in llama.cpp: stored as in HF
        return None
    kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else None
    if kind == "attn_q":
        return config["num_attention_heads"]
    if kind == "attn_k":
        return config["num_key_value_heads"]
    return None


def _dequantize(w: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
    """A GGUF quantized triple as float32.

    scales/biases go to float32 first: mx.dequantize returns the scales' dtype, and float16
    output would round Q8_0 values (up to 128 x scale) to 11 significant bits; in float32 the
    result is exact.
    """
    bits = w.shape[-1] // scales.shape[-1]  # a group of 32 values packs into `bits` uint32 words
    return mx.dequantize(
        w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=GROUP_SIZE, bits=bits
    )


def quantization_bits(tensors: dict[str, mx.array], gguf_name: str) -> int | None:
    """Bits per value of a quantized GGUF weight (4 for Q4_0/Q4_1, 8 for Q8_0), None if plain."""
    stem = gguf_name.removesuffix(".weight")
    scales = tensors.get(f"{stem}.scales")
    return None if scales is None else bits_of(tensors[gguf_name], scales)


def bits_of(packed: mx.array, scales: mx.array) -> int:
    """Bits per value of a packed (uint32) quantized weight: a group of 32 values takes `bits` words."""
    return packed.shape[-1] // scales.shape[-1]


def gguf_weights(
    tensors: dict[str, mx.array],
    config: dict,
    keep: Callable[[str], bool] | None = None,
    dequantize: bool = True,
) -> dict[str, mx.array]:
    """GGUF tensors under mlx-lm names, q/k rows back in HF order, for `model.load_weights`.

    keep(hf_name) picks tensors before any work, so a stage touches only its own layers; a
    quantized triple is kept or dropped as a whole, on its `.weight` name. With dequantize=True
    every weight comes back float32; otherwise quantized triples stay as `.weight`/`.scales`/
    `.biases` (group size 32, bits from `quantization_bits`) and other tensors keep their dtype.
    The results are lazy MLX arrays: nothing is computed until they are evaluated.
    """
    out = {}
    for name, value in tensors.items():
        if name.endswith((".scales", ".biases")):
            continue  # handled together with their .weight
        target = hf_name(name)
        if keep is not None and not keep(target):
            continue
        stem = name.removesuffix(".weight")
        parts = [value]
        if quantization_bits(tensors, name):
            parts += [tensors[f"{stem}.scales"], tensors[f"{stem}.biases"]]
        n_head = _permute_heads(name, config)
        if n_head:
            parts = [_unpermute_rows(p, n_head) for p in parts]
        if len(parts) == 3 and dequantize:
            out[target] = _dequantize(*parts)
        elif len(parts) == 3:
            target_stem = target.removesuffix(".weight")
            out[target], out[f"{target_stem}.scales"], out[f"{target_stem}.biases"] = parts
        elif dequantize and parts[0].dtype in (mx.float16, mx.bfloat16):
            out[target] = parts[0].astype(mx.float32)
        else:
            out[target] = parts[0]
    return out
