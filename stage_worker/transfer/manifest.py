"""A model's manifest: its files, their sizes and sha256, and for weight files each tensor's byte
range, read from the headers alone (safetensors' JSON header, GGUF's tensor table).

A file's sha256 names it (the worker's cache is keyed by it); each piece carries a BLAKE3, which
the worker checks as the piece arrives: SHA-256 cost a receiving worker twice what the bytes
themselves cost it, BLAKE3 a fifth of SHA-256 (bench/README.md, "Weights over the model store").

Each file is cut into pieces that a worker fetches and verifies one by one: each tensor whole (a
worker's cache keeps tensors, `tensor_cache.py`; a cut-off transfer resumes at the byte), the
header and the gaps between tensors (in parts of at most PIECE_BYTES). Each tensor carries its
dtype and shape (a GGUF tensor its ggml type), so a worker needs no header to load it. The manifest is
computed once per model (it reads every byte to hash it) and cached under the model's identity
(paths, sizes, mtimes), so a second `up` of the same model reads only the headers' stat.

No MLX here: the coordinator builds manifests without loading a model.
"""

import hashlib
from collections.abc import Callable
from pathlib import Path

from metal_cluster.proto import PROTO_VERSION, pb
from metal_cluster.stage_worker.model.checkpoint_sizes import read_header
from metal_cluster.stage_worker.errors import ModelLoadError
from metal_cluster.stage_worker.model.model_source import ModelSource, cache_dir, text_tensor_name

PIECE_BYTES = 64 * 2**20  # of a header or a gap: tensors are pieces whole
READ_BYTES = 8 * 2**20
FORMAT = 3  # bump when what a manifest holds changes, so cached ones are rebuilt
GGUF_SOURCE = "gguf_source.json"  # names a path on the coordinator: the worker writes its own


def model_files(source: ModelSource) -> dict[str, Path]:
    """What a worker needs of the model, by the name it has in the model folder."""
    files = {p.relative_to(source.folder).as_posix(): p for p in sorted(source.folder.rglob("*"))
             if p.is_file() and not any(part.startswith(".") for part in p.relative_to(source.folder).parts)}
    if source.gguf:
        files.pop(GGUF_SOURCE, None)
        files[source.gguf.name] = source.gguf
    return files


def tensor_ranges(path: Path) -> tuple[str, list[pb.TensorRange]]:
    """The file's format and its tensors' absolute byte ranges, from the header alone."""
    if path.suffix == ".safetensors":
        return "safetensors", _safetensors_ranges(path)
    if path.suffix == ".gguf":
        return "gguf", _gguf_ranges(path)
    return "other", []


def _safetensors_ranges(path: Path) -> list[pb.TensorRange]:
    header, base = read_header(path)
    ranges = [pb.TensorRange(name=name, offset=base + info["data_offsets"][0],
                             length=info["data_offsets"][1] - info["data_offsets"][0], dtype=info["dtype"],
                             shape=info["shape"])
              for name, info in header.items()]
    return sorted(ranges, key=lambda r: r.offset)


def _gguf_ranges(path: Path) -> list[pb.TensorRange]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:
        raise ModelLoadError(f"cannot read GGUF {path}: file is truncated or not a GGUF ({e})") from None
    # GGUFReader gives the shape innermost axis first (ggml's ne); numpy's order is the other way round.
    ranges = [pb.TensorRange(name=t.name, offset=int(t.data_offset), length=int(t.n_bytes),
                             shape=[int(n) for n in reversed(t.shape)], ggml_type=int(t.tensor_type))
              for t in reader.tensors]
    return sorted(ranges, key=lambda r: r.offset)


def cut(size: int, tensors: list[pb.TensorRange], piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """(offset, length) of the pieces covering a file: each tensor whole, gaps (the header) in parts."""
    pieces, at = [], 0

    def add(start: int, end: int) -> None:
        for a in range(start, end, piece_bytes):
            pieces.append((a, min(end, a + piece_bytes) - a))

    for t in tensors:
        if t.offset > at:
            add(at, t.offset)
        if t.offset + t.length > at or (t.length == 0 and t.offset >= at):
            pieces.append((max(at, t.offset), t.offset + t.length - max(at, t.offset)))
        at = max(at, t.offset + t.length)
    if size > at:
        add(at, size)
    return pieces


def describe(name: str, path: Path, progress: Callable[[int], None] = lambda n: None) -> pb.ModelFile:
    """One file's entry: one pass over its bytes hashes the file and each piece."""
    size = path.stat().st_size
    fmt, tensors = tensor_ranges(path)
    whole = hashlib.sha256()
    entry = pb.ModelFile(path=name, size=size, format=fmt, tensors=tensors)
    with open(path, "rb") as f:
        for offset, length in cut(size, tensors):
            piece = piece_hash()
            left = length
            while left:
                data = f.read(min(READ_BYTES, left))
                if not data:
                    raise ModelLoadError(f"{path} shrank while it was being read: is something writing it?")
                piece.update(data)
                whole.update(data)
                left -= len(data)
                progress(len(data))
            entry.pieces.append(pb.Piece(offset=offset, length=length, blake3=piece.hexdigest()))
    entry.sha256 = whole.hexdigest()
    return entry


def piece_hash():
    """A new hash object of the kind the pieces carry (Piece.blake3)."""
    import blake3  # here: a stage that never fetches (a GPU test machine) need not have it

    return blake3.blake3()


def digest(files) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.SerializeToString(deterministic=True))
    return h.hexdigest()


def identity(files: dict[str, Path]) -> str:
    """Changes when any file is replaced, grows or is touched: then the manifest is rebuilt."""
    h = hashlib.sha256(f"{FORMAT}".encode())
    for name, path in files.items():
        st = path.stat()
        h.update(f"\0{name}\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()


def build(source: ModelSource, name: str, progress: Callable[[int, int], None] = lambda done, total: None,
          cache: Path | None = None) -> pb.ManifestResponse:
    """The model's manifest, from the cache when its files have not changed since."""
    files = model_files(source)
    cached = (cache or cache_dir() / "manifests") / f"{identity(files)}.pb"
    if cached.is_file():
        manifest = pb.ManifestResponse.FromString(cached.read_bytes())
        if manifest.files:
            return manifest
    total, done = sum(p.stat().st_size for p in files.values()), [0]

    def step(n: int) -> None:
        done[0] += n
        progress(done[0], total)

    entries = [describe(n, p, step) for n, p in files.items()]
    manifest = pb.ManifestResponse(version=PROTO_VERSION, sha256=digest(entries), name=name, files=entries)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    tmp.write_bytes(manifest.SerializeToString())
    tmp.replace(cached)
    return manifest


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor belongs to (safetensors or GGUF name), None for the others."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
        return int(parts[2])
    if len(parts) > 1 and parts[0] == "blk":
        return int(parts[1])
    return None


def is_embedding(name: str) -> bool:
    return name.startswith(("model.embed_tokens.", "token_embd."))


def mtp_keeps(name: str, num_layers: int, own_embedding: bool) -> bool:
    """Whether a last stage that runs the checkpoint's MTP layers (speculative decoding's `mtp`)
    reads this tensor beyond its own: the layers past num_hidden_layers (DeepSeek V3's and GLM-4.5's
    `model.layers.{N}.*`), and the embedding when they hold no copy of their own."""
    name = text_tensor_name(name)
    if name is None:
        return False
    layer = layer_of(name)
    return (layer is not None and layer >= num_layers) or (not own_embedding and is_embedding(name))


def stage_keeps(name: str, start: int, end: int, num_layers: int, tied: bool) -> bool:
    """Whether the stage running layers [start, end) reads this tensor: its layers, the embedding on
    the first stage (and on the last when the head is tied to it), the rest (norm, head) on the last."""
    name = text_tensor_name(name)
    if name is None:
        return False
    layer = layer_of(name)
    if layer is not None:
        return start <= layer < end
    last = end == num_layers
    if is_embedding(name):
        return start == 0 or (last and tied)
    return last
