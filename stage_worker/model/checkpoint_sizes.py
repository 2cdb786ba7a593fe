"""What each layer of a checkpoint weighs, read from its safetensors headers alone (no tensor data).

Config arithmetic misses what a layer really holds: a MoE layer's experts make it many times a dense
layer, the first dense layers of a MoE model are lighter, quantized tensors carry scales. The
headers say exactly, per tensor. A stage on MLX's CPU backend computes in float32 and dequantizes
(DESIGN.md), so there a tensor costs 4 bytes per value it stands for.
"""

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from metal_cluster.stage_worker.model.model_source import text_tensor_name

_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2,
             "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class WeightBytes:
    layers: list[int]  # bytes of each layer, in global order
    embed: int  # the input embedding
    head: int  # the final norm and lm_head (0 for the head when it is tied to the embedding)
    tied: bool


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """One safetensors file's tensors (name -> {"dtype", "shape", "data_offsets"}) and the file
    offset their data_offsets count from; a damaged header is one ModelLoadError line."""
    from metal_cluster.stage_worker.errors import ModelLoadError

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ModelLoadError(f"{path}: truncated safetensors file (no header)")
        (size,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path}: the safetensors header is not valid JSON ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + size


def read_headers(folder: Path) -> dict[str, dict]:
    """name -> {"dtype", "shape", "data_offsets"} over every model*.safetensors file of `folder`."""
    tensors = {}
    for path in sorted(Path(folder).glob("model*.safetensors")):
        tensors.update(read_header(path)[0])
    return tensors


def weight_bytes(folder: Path, config: dict, float32: bool) -> WeightBytes | None:
    """Per-layer bytes as a stage holds them, or None when the folder holds no weights we can read."""
    source = Path(folder) / "gguf_source.json"
    if source.is_file():
        return gguf_weight_bytes(Path(json.loads(source.read_text())["gguf"]), config, float32)
    tensors = read_headers(folder)
    if not tensors:
        return None
    bits = (config.get("quantization") or {}).get("bits")
    layers = [0] * config["num_hidden_layers"]
    embed = head = 0
    for stored_name, t in tensors.items():
        name = text_tensor_name(stored_name)
        if name is None:  # a vision tower or an MTP head: no stage holds it
            continue
        n = _held_bytes(name, t, float32, bits)
        if (m := _LAYER.search(name)) is not None:
            i = int(m.group(1))
            if i < len(layers):  # a layer past num_hidden_layers is an MTP head no stage runs
                layers[i] += n
        elif "embed_tokens" in name:
            embed += n
        else:
            head += n
    # A sequence classifier's head is its score layer (counted in `head`), not the embedding.
    tied = not any((text_tensor_name(name) or "").startswith(("lm_head.", "score.")) for name in tensors)
    return WeightBytes(layers, embed, head + (embed if tied else 0), tied)


def mtp_layer_bytes(folder: Path, config: dict, float32: bool) -> int:
    """Bytes of the checkpoint's first multi-token-prediction layer (`model.layers.{N}.*` after the N
    decoder layers, its own embedding and head copies included) as a last stage holds it for
    speculative decoding's `mtp` method, which runs that layer alone (stage_worker/step/speculative/mtp.py)."""
    prefix = f"model.layers.{config['num_hidden_layers']}."
    bits = (config.get("quantization") or {}).get("bits")
    return sum(_held_bytes(name, t, float32, bits) for name, t in read_headers(folder).items()
               if name.startswith(prefix))


def _held_bytes(name: str, t: dict, float32: bool, bits: int | None) -> int:
    stored = t["data_offsets"][1] - t["data_offsets"][0]
    if not float32:
        return stored
    if name.endswith((".scales", ".biases")) and bits:
        return 0  # folded into the float32 weight it scales
    if bits and t["dtype"] == "U32":
        return stored // 4 * (32 // bits) * 4  # 32 // bits values per packed word, 4 bytes each
    return stored // _ITEMSIZE.get(t["dtype"], 4) * 4


# Types MLX loads as affine-quantized triples, kept so on a GPU: bits per value. MLX dequantizes the
# other quantized types to float16 as it loads them.
_GGUF_TRIPLES = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
_GGUF_FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
_GGUF_GROUP = 32  # values per group of a triple: one float16 scale and one float16 bias each
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.")


def gguf_weight_bytes(path: Path, config: dict, float32: bool) -> WeightBytes | None:
    """The same from a GGUF's tensor table (llama.cpp's names: blk.N., token_embd, output)."""
    try:
        tensors = gguf_tensor_table(path)
    except (OSError, ValueError, struct.error):
        return None  # the load says what is wrong with the file
    layers = [0] * config["num_hidden_layers"]
    embed = head = 0
    itemsize = 4 if float32 else _gguf_compute_itemsize(tensors)
    for t in tensors:
        bits = None if float32 else _GGUF_TRIPLES.get(t.type_name)
        if bits is None:
            n = t.n_elements * itemsize
        else:  # packed uint32 words, and a scale and a bias in float16 per group
            n = t.n_elements * bits // 8 + t.n_elements // _GGUF_GROUP * 4
        if (m := _GGUF_LAYER.match(t.name)) is not None:
            if int(m.group(1)) < len(layers):
                layers[int(m.group(1))] += n
        elif t.name.startswith("token_embd"):
            embed += n
        else:
            head += n
    tied = not any(t.name == "output.weight" for t in tensors)
    return WeightBytes(layers, embed, head + (embed if tied else 0), tied)


def _gguf_compute_itemsize(tensors: list["GGUFTensor"]) -> int:
    """Bytes per value of a GGUF's plain tensors on a GPU stage, which casts them to its compute
    dtype (`dtypes.weights_dtype`): the scales' float16 when triples are kept, else the float type
    most values are stored in (other quantized types arrive dequantized to float16)."""
    if any(t.type_name in _GGUF_TRIPLES for t in tensors):
        return 2
    values = {4: 0, 2: 0}
    for t in tensors:
        values[_GGUF_FLOAT_BYTES.get(t.type_name, 2)] += t.n_elements
    return max(values, key=values.get)


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    n_elements: int
    n_bytes: int
    type_name: str  # ggml's: F32, Q4_1, ...


# GGUF metadata value types (ids 0-12) -> bytes of one value; 8 (string) and 9 (array) vary.
_GGUF_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_tensor_table(path: Path) -> list[GGUFTensor]:
    """A GGUF file's tensor table, read past its metadata without parsing it. gguf's GGUFReader
    builds numpy views of every metadata item first (a tokenizer's ~100k strings): 4-13 s on the
    2-core test machine, paid by every re-plan's placement; this walk takes milliseconds."""
    import mmap

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or not 2 <= version <= 3:
            raise ValueError(f"{path}: not a little-endian GGUF v2/v3 file")
        pos = 24
        for _ in range(n_kv):
            pos = _skip_string(buf, pos)
            (kind,) = struct.unpack_from("<I", buf, pos)
            pos = _skip_value(buf, pos + 4, kind)
        tensors = []
        for _ in range(n_tensors):
            (length,) = struct.unpack_from("<Q", buf, pos)
            name = bytes(buf[pos + 8:pos + 8 + length]).decode()
            pos += 8 + length
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            kind, _offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            n = 1
            for d in dims:
                n *= d
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            tensors.append(GGUFTensor(name, n, n // block * block_bytes, GGMLQuantizationType(kind).name))
    return tensors


def _skip_string(buf, pos: int) -> int:
    (length,) = struct.unpack_from("<Q", buf, pos)
    return pos + 8 + length


def _skip_value(buf, pos: int, kind: int) -> int:
    if kind == 8:
        return _skip_string(buf, pos)
    if kind == 9:
        item, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item in _GGUF_VALUE_BYTES:
            return pos + count * _GGUF_VALUE_BYTES[item]
        for _ in range(count):
            pos = _skip_value(buf, pos, item)
        return pos
    if kind not in _GGUF_VALUE_BYTES:
        raise ValueError(f"unknown GGUF metadata value type {kind}")
    return pos + _GGUF_VALUE_BYTES[kind]
