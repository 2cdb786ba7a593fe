"""GGUF tensors from their raw bytes, as `mx.load` gives them for a whole file: Q4_0/Q4_1/Q8_0
blocks as MLX affine triples (packed uint32 `weight`, float16 `scales` and `biases`, group size
32), F32/F16/BF16 as they are. A worker's cache holds each tensor's bytes as they came in the
checkpoint (`transfer/tensor_cache.py`), not a GGUF file, so MLX's own reader cannot open them.

llama.cpp's blocks of 32 values: Q4_0 `d` (f16) and 16 bytes, value j in the low nibble of byte
j and value j + 16 in its high nibble, x = d * (q - 8); Q4_1 `d`, `m` and the same nibbles,
x = d * q + m; Q8_0 `d` and 32 int8, x = d * q. MLX's affine form is x = scale * q + bias with
q unsigned, packed little end first into uint32 words.
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from metal_cluster.stage_worker.errors import ModelLoadError

F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30  # ggml type ids
_PLAIN = {F32: np.float32, F16: np.float16}
BLOCK = 32
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}


def tensor_bytes(ggml_type: int, shape: list[int]) -> int:
    """What a tensor of this type and (numpy-order) shape takes in a GGUF file."""
    n = int(np.prod(shape))
    if ggml_type in _BLOCK_BYTES:
        return n // BLOCK * _BLOCK_BYTES[ggml_type]
    return n * (2 if ggml_type in (F16, BF16) else 4)


def arrays(name: str, ggml_type: int, shape: list[int], raw: np.ndarray) -> dict[str, mx.array]:
    """The tensor `name` (`shape` in numpy order, last axis innermost) from its raw uint8 bytes."""
    if ggml_type in _PLAIN:
        return {name: mx.array(raw.view(_PLAIN[ggml_type]).reshape(shape))}
    if ggml_type == BF16:
        # As MLX reads a whole GGUF: its BF16 tensors come back float16.
        return {name: mx.array(raw.view(np.uint16).reshape(shape)).view(mx.bfloat16).astype(mx.float16)}
    if ggml_type not in _BLOCK_BYTES:
        raise ModelLoadError(f"GGUF tensor {name} is of ggml type {ggml_type}; a fetched stage loads "
                             "Q4_0, Q4_1, Q8_0, F16, BF16 and F32 tensors")
    blocks = raw.reshape(-1, _BLOCK_BYTES[ggml_type])
    d = blocks[:, :2].copy().view(np.float16)[:, 0]
    if ggml_type == Q8_0:
        q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        bias, bits = -128 * d.astype(np.float32), 8
    else:
        nibbles = blocks[:, 4:] if ggml_type == Q4_1 else blocks[:, 2:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1)
        bias = (blocks[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float32) if ggml_type == Q4_1
                else -8 * d.astype(np.float32))
        bits = 4
        q = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)  # two values a byte, the first low
    rows = shape[:-1]
    stem = name.removesuffix(".weight")
    groups = shape[-1] // BLOCK
    return {name: mx.array(np.ascontiguousarray(q).view(np.uint32).reshape(*rows, shape[-1] * bits // 32)),
            f"{stem}.scales": mx.array(d.reshape(*rows, groups)),
            f"{stem}.biases": mx.array(bias.astype(np.float16).reshape(*rows, groups))}


def load_index(index: Path) -> dict[str, mx.array]:
    """Every tensor a fetched stage's `gguf_tensors.json` lists, from its cache file (mapped, not
    read whole first), under the names and in the form `mx.load` gives a whole GGUF's."""
    out = {}
    for name, t in json.loads(Path(index).read_text())["tensors"].items():
        path = Path(t["path"])
        want = tensor_bytes(t["ggml_type"], t["shape"])
        if not path.is_file() or path.stat().st_size != want:
            raise ModelLoadError(f"{index}: the cached bytes of {name} are missing or cut short ({path}): "
                                 "fetch the stage again")
        raw = np.memmap(path, dtype=np.uint8, mode="r") if want else np.zeros(0, np.uint8)
        out.update(arrays(name, t["ggml_type"], t["shape"], raw))
    return out
