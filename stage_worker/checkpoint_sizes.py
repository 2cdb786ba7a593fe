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
    for name, t in tensors.items():
        n = _held_bytes(name, t, float32, bits)
        if (m := _LAYER.search(name)) is not None:
            i = int(m.group(1))
            if i < len(layers):  # a layer past num_hidden_layers is an MTP head no stage runs
                layers[i] += n
        elif "embed_tokens" in name:
            embed += n
        else:
            head += n
    tied = not any(name.startswith("lm_head") for name in tensors)
    return WeightBytes(layers, embed, head + (embed if tied else 0), tied)


def _held_bytes(name: str, t: dict, float32: bool, bits: int | None) -> int:
    stored = t["data_offsets"][1] - t["data_offsets"][0]
    if not float32:
        return stored
    if name.endswith((".scales", ".biases")) and bits:
        return 0  # folded into the float32 weight it scales
    if bits and t["dtype"] == "U32":
        return stored // 4 * (32 // bits) * 4  # 32 // bits values per packed word, 4 bytes each
    return stored // _ITEMSIZE.get(t["dtype"], 4) * 4


# Types MLX loads as affine-quantized triples (kept so on a GPU); it dequantizes the rest to float16.
_GGUF_KEPT = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"}
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.")


def gguf_weight_bytes(path: Path, config: dict, float32: bool) -> WeightBytes | None:
    """The same from a GGUF's tensor table (llama.cpp's names: blk.N., token_embd, output)."""
    from gguf import GGUFReader

    try:
        tensors = GGUFReader(path).tensors
    except (OSError, ValueError):
        return None  # the load says what is wrong with the file
    layers = [0] * config["num_hidden_layers"]
    embed = head = 0
    for t in tensors:
        n = int(t.n_elements) * 4 if float32 else (
            int(t.n_bytes) if t.tensor_type.name in _GGUF_KEPT else int(t.n_elements) * 2)
        if (m := _GGUF_LAYER.match(t.name)) is not None:
            if int(m.group(1)) < len(layers):
                layers[int(m.group(1))] += n
        elif t.name.startswith("token_embd"):
            embed += n
        else:
            head += n
    tied = not any(t.name == "output.weight" for t in tensors)
    return WeightBytes(layers, embed, head + (embed if tied else 0), tied)
