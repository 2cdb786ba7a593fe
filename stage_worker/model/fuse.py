"""Fused projections on a GPU: a layer's q/k/v as one matmul, and its MLP's gate/up as one; and
each residual add with the norm after it as one kernel (`AddNormBlock`, `run_layers`).

At batch 1 a decode step on a GPU is a chain of small matrix-vector products, each its own kernel;
the host encodes every one and the device runs each below its bandwidth. Reading q, k and v's
weights in one product (and gate and up's in one) is the same bytes in fewer, larger kernels: 3 of
Qwen3-8B's 7 products per layer go. vLLM's CUDA models keep their weights fused the same way.

Not on the CPU backend: OpenBLAS blocks a product by its shape, so a fused prompt's values differ in
the last bits from mlx-lm's separate ones, and the CPU path is token-exact against mlx-lm.

A layer is fused at load when its family says its attention and MLP are mlx-lm's plain ones
(`Family.fuses_projections`), and split back (`unfuse_layer`) when a LoRA adapter adapts one of
the fused modules, which then need their own weights again.
"""

import copy
import os

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from metal_cluster.kernels import add_norm, gpu_backend, norm_rope

# METAL_CLUSTER_FUSE=0 loads every layer unfused (the benches' A/B switch).
FUSE = os.environ.get("METAL_CLUSTER_FUSE", "1") != "0"
# METAL_CLUSTER_NORM_ROPE=0 keeps MLX's separate q/k norm and RoPE ops on fused layers (A/B).
NORM_ROPE = os.environ.get("METAL_CLUSTER_NORM_ROPE", "1") != "0"
# METAL_CLUSTER_ADD_NORM=0 keeps the attention's residual add and the post-attention RMSNorm as
# MLX's two ops (A/B).
ADD_NORM = os.environ.get("METAL_CLUSTER_ADD_NORM", "1") != "0"
# METAL_CLUSTER_CARRY=0 keeps each block's last residual add its own op instead of the next
# block's input-norm kernel's (A/B).
CARRY = os.environ.get("METAL_CLUSTER_CARRY", "1") != "0"

ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj")
MLP_PARTS = ("gate_proj", "up_proj")
BLOCK_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm")  # and its MLP, by any name


class SwiGLU(nn.Module):
    """mlx-lm's gated MLP, down(silu(gate(x)) * up(x)), with gate and up read as one product."""

    def __init__(self, original: nn.Module, gate_up: nn.Module, width: int):
        super().__init__()
        self.gate_up, self.down_proj, self.width = gate_up, original.down_proj, width
        object.__setattr__(self, "original", original)  # what unfusing restores; not in the module tree

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.gate_up(x), [self.width], axis=-1)
        return self.down_proj(swiglu(gate, up))


class AddNormBlock(nn.Module):
    """mlx-lm's pre-norm decoder block (norm, attention, residual add, norm, MLP or experts,
    residual add) with the first residual add and the norm after it as one kernel
    (`kernels/add_norm.py`). It holds the block's own modules under their own names, so their
    parameters keep their paths.

    `carried` runs it with its last residual add left to the caller: `run_layers` hands that sum
    to the next block, whose input norm takes it in the same kernel."""

    def __init__(self, layer: nn.Module, mlp_name: str, spec: add_norm.AddNorm, input_spec: add_norm.AddNorm | None):
        super().__init__()
        for name in (*BLOCK_PARTS, mlp_name):
            self[name] = layer[name]
        self.mlp_name = mlp_name
        self.spec = spec
        self.input_spec = input_spec  # None: the input norm stays MLX's, and the block is not carried

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        h, m = self.carried(x, None, mask, cache)
        return h + m

    def carried(self, x: mx.array, pending: mx.array | None, mask=None, cache=None) -> tuple[mx.array, mx.array]:
        """The block on input x + pending (pending None: on x), as (h, m) whose sum is its output."""
        norm = self.post_attention_layernorm
        if x.dtype != norm.weight.dtype:  # activations in another dtype than the plan's: MLX's ops
            x = x if pending is None else x + pending
            h = x + self.self_attn(self.input_layernorm(x), mask, cache)
            return h, self[self.mlp_name](norm(h))
        if pending is None:
            normed = self.input_layernorm(x)
        else:
            x, normed = add_norm.add_rms_norm(x, pending, self.input_layernorm.weight, self.input_spec)
        h, normed = add_norm.add_rms_norm(x, self.self_attn(normed, mask, cache), norm.weight, self.spec)
        return h, self[self.mlp_name](normed)


def run_layers(layers: list[nn.Module], h: mx.array, context_of) -> mx.array:
    """h through `layers` in order, layer i called with `context_of(i)` as its cache. Between two
    carried blocks the residual add goes into the next block's input-norm kernel: one launch a
    layer fewer on a GPU, the same values (the kernel rounds the sum as MLX's add does)."""
    pending = None
    for i, layer in enumerate(layers):
        if isinstance(layer, AddNormBlock) and layer.input_spec is not None:
            h, pending = layer.carried(h, pending, None, context_of(i))
            continue
        if pending is not None:
            h, pending = h + pending, None
        h = layer(h, None, context_of(i))
    return h if pending is None else h + pending


def add_norm_block(layer: nn.Module) -> nn.Module:
    """`layer` as an `AddNormBlock` on a GPU whose kernel takes its post-attention norm; otherwise
    `layer` itself. Only for the blocks of families that say theirs are mlx-lm's plain pre-norm
    ones (`Family.fuses_projections`)."""
    backend = gpu_backend()
    rest = [name for name in layer.children() if name not in BLOCK_PARTS]
    if (not ADD_NORM or backend is None or len(rest) != 1 or not isinstance(layer[rest[0]], nn.Module)
            or any(name not in layer for name in BLOCK_PARTS)):
        return layer
    norm = layer.post_attention_layernorm
    spec = add_norm.plan(norm, norm.weight.dtype, backend)
    if spec is None:
        return layer
    entry = layer.input_layernorm
    input_spec = add_norm.plan(entry, norm.weight.dtype, backend) if CARRY else None
    return AddNormBlock(layer, rest[0], spec, input_spec)


def fuse_layer(layer: nn.Module) -> None:
    """Fuse one wrapped decoder layer's q/k/v (its `PagedAttention`) and its gated MLP, in place."""
    attn = layer.self_attn
    parts = [attn.inner[name] for name in ATTENTION_PARTS]
    if _compatible(parts):
        attn.qkv, attn.qkv_split = _concat(parts), _offsets(parts)
        for name in ATTENTION_PARTS:
            del attn.inner[name]
        backend = gpu_backend()
        if NORM_ROPE and backend is not None:
            head_dim = attn.qkv_split[0] // attn.n_heads
            attn.norm_rope = norm_rope.plan(attn.inner, attn.n_heads, attn.n_kv_heads, head_dim, backend)
    mlp = layer.get("mlp")  # a MoE block has no gate_proj; Mixtral's layers call theirs otherwise
    parts = [mlp[name] for name in MLP_PARTS] if mlp is not None and all(n in mlp for n in MLP_PARTS) else []
    if parts and _compatible(parts):
        layer.mlp = SwiGLU(mlp, _concat(parts), _offsets(parts)[0])
        for name in MLP_PARTS:
            del mlp[name]
    mx.eval(layer.parameters())  # the fused copies now; the separate ones go with their last reference


def unfuse_layer(layer: nn.Module) -> bool:
    """Give a fused layer its separate modules back (a LoRA adapter wraps them); False if it was not fused."""
    undone = False
    attn = layer.get("self_attn")  # a Gated DeltaNet layer has none
    if attn is not None and "qkv" in attn:
        for name, part in zip(ATTENTION_PARTS, _split(attn.qkv, attn.qkv_split)):
            attn.inner[name] = part
        del attn["qkv"]
        attn.qkv_split, undone = None, True
    if isinstance(layer.get("mlp"), SwiGLU):
        fused = layer.mlp
        for name, part in zip(MLP_PARTS, _split(fused.gate_up, [fused.width])):
            fused.original[name] = part
        layer.mlp, undone = fused.original, True
    if undone:
        mx.eval(layer.parameters())
    return undone


def is_fused(layer: nn.Module) -> bool:
    return "qkv" in layer.get("self_attn", {}) or isinstance(layer.get("mlp"), SwiGLU)


# --- linear modules side by side ----------------------------------------------------------------
def _compatible(parts: list[nn.Module]) -> bool:
    """Same class, same input, same quantization, all with or all without a bias."""
    first = parts[0]
    if type(first) not in (nn.Linear, nn.QuantizedLinear) or any(type(p) is not type(first) for p in parts):
        return False
    if any(("bias" in p) != ("bias" in first) for p in parts):
        return False
    if isinstance(first, nn.QuantizedLinear):
        same = ("group_size", "bits", "mode")
        if any(getattr(p, a, None) != getattr(first, a, None) for p in parts for a in same):
            return False
    return all(p.weight.shape[1:] == first.weight.shape[1:] and p.weight.dtype == first.weight.dtype for p in parts)


def _arrays(module: nn.Module) -> list[str]:
    return [k for k in ("weight", "scales", "biases", "bias") if k in module]


def _concat(parts: list[nn.Module]) -> nn.Module:
    """One module whose output is the parts' outputs side by side (their rows stacked)."""
    fused = copy.copy(parts[0])  # keeps the class and its quantization settings
    for key in _arrays(parts[0]):
        fused[key] = mx.concatenate([p[key] for p in parts], axis=0)
    return fused


def _offsets(parts: list[nn.Module]) -> list[int]:
    """Where each part's output columns end, but the last: mx.split's indices."""
    ends, total = [], 0
    for p in parts[:-1]:
        total += p.weight.shape[0]
        ends.append(total)
    return ends


def _split(fused: nn.Module, offsets: list[int]) -> list[nn.Module]:
    bounds = [0, *offsets, fused.weight.shape[0]]
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        part = copy.copy(fused)
        for key in _arrays(fused):
            part[key] = mx.contiguous(fused[key][lo:hi])
        parts.append(part)
    return parts
