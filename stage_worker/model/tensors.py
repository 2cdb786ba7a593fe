"""Named tensors of a checkpoint folder that mlx-lm's loader never hands a stage (its sanitize drops
them): read lazily, from only the safetensors files that hold them (their headers say which)."""

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from metal_cluster.stage_worker.model.checkpoint_sizes import read_header


def load_tensors(folder: Path, keep: Callable[[str], bool]) -> dict[str, mx.array]:
    """name -> lazy array for every stored tensor whose name `keep` accepts."""
    out = {}
    for path in sorted(Path(folder).glob("model*.safetensors")):
        names = [n for n in read_header(path)[0] if n != "__metadata__" and keep(n)]
        if names:
            stored = mx.load(str(path))
            out.update({n: stored[n] for n in names})
    return out
