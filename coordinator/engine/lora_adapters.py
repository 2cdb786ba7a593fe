"""Read a LoRA adapter folder into what the stages apply: per (layer, linear module) the pair A, B
with delta(x) = x @ A @ B, the adapter's scale folded into B.

Two formats: PEFT's (adapter_config.json + adapter_model.safetensors: `lora_A.weight [r, in]`,
`lora_B.weight [out, r]`, scale lora_alpha / r, or / sqrt(r) with rsLoRA) and mlx-lm's
(adapter_config.json + adapters.safetensors: `lora_a [in, r]`, `lora_b [r, out]`, scale
`lora_parameters.scale`). Everything a stage could refuse is checked here, with a message that
names the problem and the fix, so that a bad adapter is a 400 or one start-up line.
"""

import functools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from metal_cluster.proto import PROTO_VERSION, pb
from metal_cluster.stage_worker.model.model_source import text_tensor_name

PEFT_WEIGHTS = "adapter_model.safetensors"
MLX_WEIGHTS = "adapters.safetensors"
CONFIG = "adapter_config.json"
_PEFT_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
_MLX_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.lora_([ab])$")


def _text_name(key: str) -> str:
    """An adapter tensor's name as the text model has it: PEFT's base_model.model. prefix dropped,
    and a vision-language model's (Qwen3.5) model.language_model. read as the text model's."""
    key = key.removeprefix("base_model.model.")
    return text_tensor_name(key) or key


class LoRAAdapterError(ValueError):
    """An adapter this server cannot serve; the message names the adapter, the problem and the fix."""


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    # (global layer, module inside the layer) -> (A [in, r], B [r, out] with the scale in it), float32
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def add_request(self, lora_id: int, max_loras: int, max_rank: int, layers: range) -> pb.LoRAAddRequest:
        """The LoRAAdd message of a stage running `layers`: only its own layers' tensors."""
        req = pb.LoRAAddRequest(version=PROTO_VERSION, lora_id=lora_id, name=self.name, max_loras=max_loras,
                                max_rank=max_rank)
        for (layer, module), (a, b) in sorted(self.weights.items()):
            if layer in layers:
                req.tensors.add(layer=layer, module=module, rank=a.shape[1], input_dims=a.shape[0],
                                output_dims=b.shape[1], a=a.astype("<f4").tobytes(), b=b.astype("<f4").tobytes())
        return req


def read_adapter(path: str | Path, name: str, model_folder: str | Path, max_rank: int) -> LoRAAdapter:
    folder = Path(path).expanduser()
    where = f"LoRA adapter '{name}' ({folder})"
    if not folder.is_dir():
        raise LoRAAdapterError(f"{where}: no such folder; give the path of a folder holding {CONFIG} and "
                               f"{PEFT_WEIGHTS} (PEFT) or {MLX_WEIGHTS} (mlx-lm)")
    if not (folder / CONFIG).is_file():
        raise LoRAAdapterError(f"{where}: {CONFIG} is missing; the folder must hold the adapter's config")
    try:
        config = json.loads((folder / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"{where}: {CONFIG} is not readable JSON ({e})") from None
    if (folder / PEFT_WEIGHTS).is_file():
        adapter = _read_peft(folder, name, config, where)
    elif (folder / MLX_WEIGHTS).is_file():
        adapter = _read_mlx(folder, name, config, where)
    else:
        raise LoRAAdapterError(f"{where}: neither {PEFT_WEIGHTS} (PEFT) nor {MLX_WEIGHTS} (mlx-lm) is there")
    if not adapter.weights:
        raise LoRAAdapterError(f"{where}: the weights hold no LoRA tensors of the model's decoder layers")
    if adapter.rank > max_rank:
        raise LoRAAdapterError(f"{where}: rank {adapter.rank} is over --max-lora-rank {max_rank}; start the server "
                               f"with --max-lora-rank {adapter.rank} or more")
    _check_against_model(adapter, model_folder, where)
    return adapter


def _load(file: Path, where: str) -> dict[str, np.ndarray]:
    import mlx.core as mx

    try:
        tensors = mx.load(str(file))
    except Exception as e:  # mlx says only "failed to open", or what in the header is wrong
        raise LoRAAdapterError(f"{where}: cannot read {file.name} as safetensors ({e})") from None
    return {k: np.array(v.astype(mx.float32)) for k, v in tensors.items()}


def _read_peft(folder: Path, name: str, config: dict, where: str) -> LoRAAdapter:
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type {kind} is not LoRA; only LoRA adapters are served")
    for key, what in (("use_dora", "DoRA"), ("alpha_pattern", "per-module alphas"),
                      ("modules_to_save", "fully trained modules")):
        if config.get(key):
            raise LoRAAdapterError(f"{where}: {what} ({key}) are not supported; serve a plain LoRA adapter")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{where}: LoRA biases (bias={config['bias']!r}) are not supported; "
                               "train with bias='none'")
    alpha = config.get("lora_alpha")
    if alpha is None:
        raise LoRAAdapterError(f"{where}: {CONFIG} has no lora_alpha")
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in _load(folder / PEFT_WEIGHTS, where).items():
        m = _PEFT_NAME.match(_text_name(key))
        if not m:
            raise LoRAAdapterError(f"{where}: tensor {key} is not a LoRA weight of a decoder layer's linear module "
                                   "(embeddings and lm_head are not supported)")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = value
    adapter = LoRAAdapter(name=name, path=str(folder), rank=0)
    for key, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"{where}: layer {key[0]} {key[1]} has lora_{''.join(pair)} without its partner")
        a, b = pair["A"].T, pair["B"].T  # [in, r], [r, out]
        rank = a.shape[1]
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        adapter.weights[key] = _pair(a, b * scale, key, where)
        adapter.rank = max(adapter.rank, rank)
    return adapter


def _read_mlx(folder: Path, name: str, config: dict, where: str) -> LoRAAdapter:
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise LoRAAdapterError(f"{where}: fine_tune_type {kind!r} is not served; only 'lora' adapters are")
    params = config.get("lora_parameters") or {}
    if "scale" not in params:
        raise LoRAAdapterError(f"{where}: {CONFIG} has no lora_parameters.scale")
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in _load(folder / MLX_WEIGHTS, where).items():
        m = _MLX_NAME.match(_text_name(key))
        if not m:
            raise LoRAAdapterError(f"{where}: tensor {key} is not a LoRA weight of a decoder layer's linear module")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = value
    adapter = LoRAAdapter(name=name, path=str(folder), rank=0)
    for key, pair in pairs.items():
        if set(pair) != {"a", "b"}:
            raise LoRAAdapterError(f"{where}: layer {key[0]} {key[1]} has lora_{''.join(pair)} without its partner")
        adapter.weights[key] = _pair(pair["a"], pair["b"] * params["scale"], key, where)
        adapter.rank = max(adapter.rank, pair["a"].shape[1])
    return adapter


def _pair(a: np.ndarray, b: np.ndarray, key, where: str):
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise LoRAAdapterError(f"{where}: layer {key[0]} {key[1]}: A {a.shape} and B {b.shape} are not a LoRA pair")
    return np.ascontiguousarray(a, dtype=np.float32), np.ascontiguousarray(b, dtype=np.float32)


def _check_against_model(adapter: LoRAAdapter, model_folder, where: str) -> None:
    shapes = linear_shapes(str(model_folder))
    num_layers = max((layer for layer, _ in shapes), default=-1) + 1
    for (layer, module), (a, b) in sorted(adapter.weights.items()):
        if layer >= num_layers:
            raise LoRAAdapterError(f"{where}: it adapts layer {layer}, but the model has {num_layers} layers; "
                                   "was it trained for another model?")
        shape = shapes.get((layer, module))
        if shape is None:
            known = sorted({m for (i, m) in shapes if i == layer})
            raise LoRAAdapterError(f"{where}: it targets {module} of layer {layer}, which the model does not have "
                                   f"(its linear modules: {', '.join(known)})")
        if (a.shape[0], b.shape[1]) != shape:
            raise LoRAAdapterError(f"{where}: layer {layer} {module} maps {a.shape[0]} -> {b.shape[1]}, the model's "
                                   f"{shape[0]} -> {shape[1]}; was it trained for another model?")


@functools.lru_cache(maxsize=4)
def linear_shapes(model_folder: str) -> dict[tuple[int, str], tuple[int, int]]:
    """(layer, module) -> (input, output) dims of every linear module in the model's decoder layers,
    from config.json alone: mlx-lm builds the model with lazy (never evaluated) weights."""
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes

    from metal_cluster.stage_worker.model.model_source import resolve_model

    config = resolve_model(model_folder).config
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    shapes = {}
    for i, layer in enumerate(model.layers):
        for module_name, module in layer.named_modules():
            if isinstance(module, nn.Linear):
                out_dims, in_dims = module.weight.shape
                shapes[(i, module_name)] = (in_dims, out_dims)
    return shapes
