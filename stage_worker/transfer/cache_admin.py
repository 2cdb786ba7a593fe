"""What `metal-cluster cache` shows and prunes: the stages this worker's cache holds tensors for
(`stage_folder.py` writes a stage.json into each), and removing cached tensors, least recently
used first, down to a size."""

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from metal_cluster.stage_worker.transfer.stage_folder import STAGE
from metal_cluster.stage_worker.transfer.tensor_cache import TensorStore
from metal_cluster.stage_worker.transfer.weights_cache import BlobStore


@dataclass
class CachedStage:
    model: str
    manifest: str  # the first hex digits of its manifest's hash
    layers: tuple[int, int]
    tensors: int  # of the stage's tensors, how many are in the cache
    wanted: int  # and how many it has
    bytes: int  # that they take
    last_used: float  # seconds since the epoch, 0 when none is left


def stages(root: Path) -> list[CachedStage]:
    sizes = {key: (n, used) for key, n, used in TensorStore(root / "tensors").entries()}
    out = []
    for info in sorted((root / "models").glob(f"*/{STAGE}")):
        stage = json.loads(info.read_text())
        have = [sizes[k] for k in stage["tensors"] if k in sizes]
        out.append(CachedStage(stage["model"], info.parent.name.split("-")[0][:12], tuple(stage["layers"]), len(have),
                               len(stage["tensors"]), sum(n for n, _ in have), max((u for _, u in have), default=0)))
    return out


def total_bytes(root: Path) -> int:
    return TensorStore(root / "tensors").disk_bytes() + BlobStore(root / "blobs").total_bytes()


def prune(root: Path, max_bytes: int) -> tuple[int, int]:
    """Remove cached tensors, least recently used first, until they take at most `max_bytes`; then
    the stage folders that lost a tensor (a later fetch makes them again) and the small files no
    stage folder links to. (tensor files removed, bytes freed)."""
    tensors = TensorStore(root / "tensors")
    with tensors.locked():
        removed, freed = tensors.evict(max_bytes, keep=set())
        present = {key for key, _, _ in tensors.entries()}
        linked = set()
        for info in list((root / "models").glob(f"*/{STAGE}")):
            stage = json.loads(info.read_text())
            if set(stage["tensors"]) <= present:
                linked |= set(stage["files"])
            else:
                shutil.rmtree(info.parent, ignore_errors=True)
        blobs = BlobStore(root / "blobs")
        for sha in blobs.blobs():
            if sha not in linked:
                freed += blobs.disk_bytes(sha)
                blobs.remove(sha)
        if not linked:  # no stage left: the small files' folders go too
            for folder in (root / "models").glob("*") if (root / "models").exists() else []:
                shutil.rmtree(folder, ignore_errors=True)
    return removed, freed


def ago(t: float) -> str:
    if not t:
        return "-"
    s = max(0, time.time() - t)
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.0f} {unit} ago"
    return f"{s:.0f} s ago"
