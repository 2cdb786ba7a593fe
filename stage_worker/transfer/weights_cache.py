"""The worker's content-addressed cache of a model's small files (config, tokenizer), whole:
`blobs/<sha256 of the file>`. Weights are cached tensor by tensor instead (`tensor_cache.py`).

`<sha256>.pieces` lists the pieces that arrived and matched their hash. Pieces are hashed again
before each use: one corrupted or truncated on disk is found and fetched again; one that never
finished arriving was never listed.
"""

import contextlib
import fcntl
import logging
import os
from pathlib import Path

from metal_cluster.proto import pb
from metal_cluster.stage_worker.transfer import manifest as manifests

log = logging.getLogger("metal_cluster.worker")
READ_BYTES = 8 * 2**20


class BlobStore:
    def __init__(self, root: Path):
        self.root = root

    def path(self, sha: str) -> Path:
        return self.root / sha

    @contextlib.contextmanager
    def locked(self, sha: str):
        """One writer per blob: two stages on one host sharing a cache fetch a file in turn."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{sha}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def recorded(self, sha: str) -> set[tuple[int, int, str]]:
        try:
            lines = (self.root / f"{sha}.pieces").read_text().splitlines()
        except FileNotFoundError:
            return set()
        out = set()
        for line in lines:
            parts = line.split()
            if len(parts) == 3:  # a line cut short by a crash is not a record
                out.add((int(parts[0]), int(parts[1]), parts[2]))
        return out

    def missing(self, entry: pb.ModelFile, wanted: list[pb.Piece]) -> list[pb.Piece]:
        """The wanted pieces the blob lacks, hashing again the ones it says it has."""
        have = self.recorded(entry.sha256)
        path = self.path(entry.sha256)
        out, bad = [], 0
        with contextlib.ExitStack() as stack:
            f = stack.enter_context(open(path, "rb")) if path.exists() and have else None
            for p in wanted:
                if (p.offset, p.length, p.blake3) not in have:
                    out.append(p)
                elif _hash_range(f, p.offset, p.length) != p.blake3:
                    out.append(p)
                    bad += 1
        if bad:
            log.warning("%d cached piece(s) of %s failed their hash (corrupted or truncated on disk): "
                        "fetching them again", bad, entry.path)
        return out

    def unrecorded_bytes(self, wanted) -> int:
        """Bytes of the wanted (entry, pieces) the blobs do not list as arrived, not hashed again:
        a quick estimate of what a fetch moves (a piece corrupted since is fetched on top)."""
        total = 0
        for entry, pieces in wanted:
            have = self.recorded(entry.sha256)
            total += sum(p.length for p in pieces if (p.offset, p.length, p.blake3) not in have)
        return total

    def open_for_write(self, entry: pb.ModelFile) -> int:
        path = self.path(entry.sha256)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if os.fstat(fd).st_size != entry.size:  # new, or truncated on disk
            os.ftruncate(fd, entry.size)
        return fd

    def touch(self, sha: str) -> None:
        """Mark the blob as used now: eviction takes the blobs used longest ago first."""
        (self.root / f"{sha}.used").touch()

    def disk_bytes(self, sha: str) -> int:
        try:
            return self.path(sha).stat().st_blocks * 512  # what its pieces take, not its sparse size
        except FileNotFoundError:
            return 0

    def blobs(self) -> list[str]:
        return [p.name for p in self.root.iterdir() if len(p.name) == 64 and "." not in p.name] if self.root.exists() else []

    def total_bytes(self) -> int:
        return sum(self.disk_bytes(b) for b in self.blobs())

    def evict(self, limit: int, keep: set[str]) -> list[str]:
        """Remove blobs not in `keep`, least recently used first, until the cache is within `limit`
        bytes (or only kept blobs are left). The removed blobs' hashes."""
        blobs = self.blobs()
        used = sum(self.disk_bytes(b) for b in blobs)
        removed = []
        for sha in sorted((b for b in blobs if b not in keep), key=self._last_used):
            if used <= limit:
                break
            used -= self.disk_bytes(sha)
            self.remove(sha)
            removed.append(sha)
        return removed

    def remove(self, sha: str) -> None:
        with self.locked(sha):
            for suffix in ("", ".pieces", ".used"):
                (self.root / f"{sha}{suffix}").unlink(missing_ok=True)

    def _last_used(self, sha: str) -> float:
        try:
            return (self.root / f"{sha}.used").stat().st_mtime
        except FileNotFoundError:
            return 0.0

    def record(self, sha: str, piece: pb.Piece) -> None:
        with open(self.root / f"{sha}.pieces", "a") as f:
            f.write(f"{piece.offset} {piece.length} {piece.blake3}\n")


def _hash_range(f, offset: int, length: int) -> str:
    h = manifests.piece_hash()
    f.seek(offset)
    left = length
    while left:
        data = f.read(min(READ_BYTES, left))
        if not data:  # the file is shorter than it must be
            return ""
        h.update(data)
        left -= len(data)
    return h.hexdigest()
