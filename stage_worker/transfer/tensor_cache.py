"""The worker's cache of tensors: `tensors/<key>`, one file per tensor of the checkpoint, holding
its bytes exactly as the checkpoint stores them (GGUF quant blocks, safetensors data as they came:
never a converted or dequantized copy), so the cache takes what the stage's tensors take.

A safetensors tensor's file is a one-tensor safetensors file (its own short header, then its
bytes), so mlx-lm's loader and every header reader open a stage's folder of links to them as they
open a checkpoint; a GGUF tensor's file is its bytes alone (`model/gguf_blocks.py` reads them).

A tensor arriving is `<key>.part`, appended in order: a transfer cut off part way resumes at its
last byte (what arrived is hashed again from disk). Complete and matching its BLAKE3, it is renamed
to `<key>`; a file is hashed again before each use, and one corrupted or truncated since is removed
and fetched again, never loaded. A file's mtime is when a stage last used it: the cache limit and
`metal-cluster cache prune` remove the least recently used first.
"""

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from metal_cluster.proto import pb
from metal_cluster.stage_worker.transfer import manifest as manifests

log = logging.getLogger("metal_cluster.worker")
READ_BYTES = 8 * 2**20
PART = ".part"


@dataclass(frozen=True)
class Wanted:
    """One tensor a stage needs: where it lies in its checkpoint file, and its piece's hash."""

    file: pb.ModelFile
    tensor: pb.TensorRange
    piece: pb.Piece

    @property
    def key(self) -> str:
        """Its cache file's name: the bytes' hash and the header's (the same bytes under two names,
        say two layers' norms of ones, are two files: their headers differ)."""
        named = hashlib.sha256(self.prefix).hexdigest()[:16]
        return f"{self.piece.blake3}-{named}"

    @property
    def prefix(self) -> bytes:
        return header(self.file.format, self.tensor)


def header(fmt: str, t: pb.TensorRange) -> bytes:
    """What a tensor's cache file holds before its bytes: a safetensors header naming it alone."""
    if fmt != "safetensors":
        return b""
    text = json.dumps({t.name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [0, t.length]}},
                      separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads its header to 8 bytes
    return len(text).to_bytes(8, "little") + text


class TensorStore:
    def __init__(self, root: Path):
        self.root = root

    def path(self, key: str) -> Path:
        return self.root / key

    @contextlib.contextmanager
    def locked(self):
        """One writer at a time: two stages on one host sharing a cache fetch in turn."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def ready(self, w: Wanted) -> bool:
        """Whether the tensor's file is here, whole and matching its hash; one that is not is removed."""
        path = self.path(w.key)
        if not path.exists():
            return False
        whole = path.stat().st_size == len(w.prefix) + w.piece.length and _starts_with(path, w.prefix)
        if whole and _hash_file(path, len(w.prefix), w.piece.length) == w.piece.blake3:
            return True
        log.warning("cached tensor %s of %s failed its hash (corrupted or truncated on disk): fetching it again",
                    w.tensor.name, w.file.path)
        path.unlink(missing_ok=True)
        return False

    def arrived(self, w: Wanted) -> int:
        """Bytes of the tensor a cut-off transfer left in its .part file (0: none, or a bad one)."""
        part = self.path(w.key + PART)
        try:
            size = part.stat().st_size - len(w.prefix)
        except FileNotFoundError:
            return 0
        if 0 <= size <= w.piece.length and _starts_with(part, w.prefix):
            return size
        part.unlink(missing_ok=True)  # longer than the tensor, or not its header: start again
        return 0

    def open_part(self, w: Wanted, have: int) -> int:
        """The .part file, open to write the tensor's bytes from `have` on."""
        fd = os.open(self.path(w.key + PART), os.O_RDWR | os.O_CREAT, 0o644)
        if not have:
            os.ftruncate(fd, 0)
            os.pwrite(fd, w.prefix, 0)
        return fd

    def finish(self, w: Wanted, blake3: str) -> bool:
        """Rename the complete .part file into place if its hash is the manifest's; else drop it."""
        part = self.path(w.key + PART)
        if blake3 != w.piece.blake3:
            part.unlink(missing_ok=True)
            return False
        part.replace(self.path(w.key))
        return True

    def prefix_hash(self, w: Wanted, have: int):
        """A piece hash fed with the `have` bytes already in the .part file."""
        h = manifests.piece_hash()
        with open(self.path(w.key + PART), "rb") as f:
            f.seek(len(w.prefix))
            _feed(h, f, have)
        return h

    def unarrived_bytes(self, wanted: list[Wanted]) -> int:
        """Bytes of the wanted tensors not in the cache, not hashed again: a quick estimate of what a
        fetch moves (a tensor corrupted since is fetched on top)."""
        total = 0
        for w in wanted:
            if not self.path(w.key).exists():
                part = self.path(w.key + PART)
                have = max(0, part.stat().st_size - len(w.prefix)) if part.exists() else 0
                total += max(0, w.piece.length - have)
        return total

    def touch(self, keys) -> None:
        now = time.time()
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                os.utime(self.path(key), (now, now))

    def entries(self) -> list[tuple[str, int, float]]:
        """(key, bytes, last used) of every complete tensor file (it has no holes: its size is what
        it takes, but for the disk's rounding up to a block)."""
        out = []
        with contextlib.suppress(FileNotFoundError):
            for p in self.root.iterdir():
                if not p.name.startswith(".") and not p.name.endswith(PART):
                    with contextlib.suppress(FileNotFoundError):
                        st = p.stat()
                        out.append((p.name, st.st_size, st.st_mtime))
        return out

    def disk_bytes(self) -> int:
        return sum(n for _, n, _ in self.entries()) + sum(
            p.stat().st_size for p in self.root.glob(f"*{PART}")) if self.root.exists() else 0

    def evict(self, limit: int, keep: set[str]) -> tuple[int, int]:
        """Remove tensor files not in `keep`, least recently used first, until the tensors take at
        most `limit` bytes (or only kept ones are left); .part files of tensors not kept go first.
        (files removed, bytes freed)."""
        for part in list(self.root.glob(f"*{PART}")) if self.root.exists() else []:
            if part.name.removesuffix(PART) not in keep:
                part.unlink(missing_ok=True)
        entries = self.entries()
        used = sum(n for _, n, _ in entries)
        removed = freed = 0
        for key, n, _ in sorted((e for e in entries if e[0] not in keep), key=lambda e: e[2]):
            if used <= limit:
                break
            self.path(key).unlink(missing_ok=True)
            used -= n
            removed += 1
            freed += n
        return removed, freed


def _starts_with(path: Path, prefix: bytes) -> bool:
    """Whether the file begins with its tensor's header (the hash covers only the tensor's bytes)."""
    with open(path, "rb") as f:
        return f.read(len(prefix)) == prefix


def _feed(h, f, length: int) -> bool:
    left = length
    while left:
        data = f.read(min(READ_BYTES, left))
        if not data:
            return False
        h.update(data)
        left -= len(data)
    return True


def _hash_file(path: Path, skip: int, length: int) -> str:
    h = manifests.piece_hash()
    try:
        with open(path, "rb") as f:
            f.seek(skip)
            if not _feed(h, f, length):
                return ""
    except FileNotFoundError:
        return ""
    return h.hexdigest()
