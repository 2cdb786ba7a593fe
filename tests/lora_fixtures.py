"""Random LoRA adapters for the tiny models, in mlx-lm's and PEFT's formats, and the oracle: mlx-lm's
own model with the adapter fused into its weights (mlx-lm's load_adapters + LoRALinear.fuse)."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_unflatten
from mlx_lm.utils import load

ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def random_pairs(model_dir: Path, modules, rank: int, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """'model.layers.i.<module>' -> (lora_a [in, r], lora_b [r, out]), big enough to change the text."""
    from metal_cluster.coordinator.engine.lora_adapters import linear_shapes

    rng = np.random.default_rng(seed)
    pairs = {}
    for (layer, module), (n_in, n_out) in sorted(linear_shapes(str(model_dir)).items()):
        if module in modules:
            a = rng.normal(0, 1 / np.sqrt(n_in), (n_in, rank)).astype(np.float32)
            b = rng.normal(0, 1 / np.sqrt(rank), (rank, n_out)).astype(np.float32)
            pairs[f"model.layers.{layer}.{module}"] = (a, b)
    return pairs


def write_mlx(out: Path, pairs, rank: int, scale: float, num_layers: int, modules) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (a, b) in pairs.items():
        tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"] = mx.array(a), mx.array(b)
    mx.save_safetensors(str(out / "adapters.safetensors"), tensors)
    (out / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": num_layers,
        "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(modules)}}))
    return out


def write_peft(out: Path, pairs, rank: int, alpha: float, modules) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (a, b) in pairs.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = mx.array(np.ascontiguousarray(a.T))
        tensors[f"base_model.model.{name}.lora_B.weight"] = mx.array(np.ascontiguousarray(b.T))
    mx.save_safetensors(str(out / "adapter_model.safetensors"), tensors)
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none", "use_rslora": False,
        "target_modules": sorted({m.split(".")[-1] for m in modules})}))
    return out


def build_adapters(model_dir: Path, out: Path, num_layers: int = 4) -> dict:
    """Two adapters: 'alpha' in mlx-lm's format (attention only, rank 4) and 'beta' in PEFT's (every
    linear module, rank 8, lora_alpha 16 = scale 2), plus 'beta' again in mlx-lm's format for the oracle."""
    alpha_pairs = random_pairs(model_dir, ATTENTION, 4, seed=1)
    beta_pairs = {k: (a, b / 4) for k, (a, b) in random_pairs(model_dir, ATTENTION + MLP, 8, seed=2).items()}
    return {
        "alpha": write_mlx(out / "alpha", alpha_pairs, 4, 1.0, num_layers, ATTENTION),
        "beta": write_peft(out / "beta", beta_pairs, 8, 16.0, ATTENTION + MLP),
        "beta_as_mlx": write_mlx(out / "beta-mlx", beta_pairs, 8, 2.0, num_layers, ATTENTION + MLP),
    }


def fused_model(model_dir: Path, mlx_adapter: Path):
    """What mlx_lm.fuse does: load the adapter with mlx-lm, then merge every LoRA layer's delta."""
    model, _ = load(str(model_dir), adapter_path=str(mlx_adapter))
    fused = [(name, module.fuse()) for name, module in model.named_modules() if hasattr(module, "fuse")]
    model.update_modules(tree_unflatten(fused))
    return model
