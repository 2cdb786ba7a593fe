"""A fetched stage's model folder: links to the cached small files and to its tensors' files, so
that it loads like a checkpoint folder (`model/model_source.py`, `model/shard.py`).

A safetensors checkpoint's tensors appear as `model-<file>-<tensor>.safetensors` files (each
tensor's cache file is a one-tensor safetensors file), which mlx-lm's loader and the header
readers glob; a GGUF's are listed in `gguf_tensors.json` (path, ggml type, shape of each), which
`model/gguf_blocks.py` reads. The folder holds exactly the stage's tensors: it is built anew for
each load and swapped in whole.
"""

import json
import os
import shutil
from pathlib import Path

from metal_cluster.stage_worker.transfer.tensor_cache import TensorStore, Wanted

GGUF_TENSORS = "gguf_tensors.json"
STAGE = "stage.json"  # what `metal-cluster cache` lists: the model, the layers, the tensors' cache files


def write(folder: Path, files: dict[str, Path], wanted: list[Wanted], tensors: TensorStore,
          model: str = "", layers: tuple[int, int] = (0, 0)) -> Path:
    """The stage's folder: `files` (name in the folder -> cached file) and the wanted tensors."""
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, target in files.items():
        link(tmp / name, target)
    order = {path: i for i, path in enumerate(dict.fromkeys(w.file.path for w in wanted))}
    gguf = {}
    for k, w in enumerate(wanted):
        if w.file.format == "safetensors":
            link(tmp / f"model-{order[w.file.path]:02d}-{k:05d}.safetensors", tensors.path(w.key))
        else:
            gguf[w.tensor.name] = {"path": str(tensors.path(w.key)), "ggml_type": w.tensor.ggml_type,
                                   "shape": list(w.tensor.shape)}
    if gguf:
        (tmp / GGUF_TENSORS).write_text(json.dumps({"tensors": gguf}, indent=1))
    (tmp / STAGE).write_text(json.dumps({"model": model, "layers": list(layers),
                                         "files": sorted(p.name for p in files.values()),
                                         "tensors": [w.key for w in wanted]}))
    old = folder.with_name(f".{folder.name}.old.{os.getpid()}")
    if folder.exists():
        os.rename(folder, old)
    os.rename(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)
    return folder


def link(path: Path, target: Path) -> None:
    """A symlink at `path` to `target`, put in place whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    tmp.replace(path)
