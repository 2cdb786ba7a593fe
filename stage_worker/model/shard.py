"""Load the part of a model one stage runs: layers [start, end), plus the embedding on the first
stage and norm + lm_head (a sequence classifier's score head) on the last. Only those tensors are
read from disk.

mlx-lm builds the model with lazy weights; the layers this stage does not run are dropped before
anything is evaluated, so their tensors are never read. The shard is cast to its compute dtype
(`dtypes.py`) before that first read: quantized weights stay quantized on a GPU.
"""

import re
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import _get_classes, load_model

from metal_cluster.stage_worker.model import classifier, dtypes, fuse
from metal_cluster.stage_worker.step.tracing import compiled
from metal_cluster.stage_worker.step.tracing.compiled import CompileSwitch
from metal_cluster.stage_worker.errors import ModelLoadError
from metal_cluster.stage_worker.families import Family, LayerCache, family_of
from metal_cluster.stage_worker.model.model_source import ModelSource, text_tensor_name


@dataclass
class ModelShard:
    model: nn.Module  # mlx-lm model holding only this stage's layers
    config: dict
    start: int
    end: int
    num_layers: int  # in the whole model
    family: Family
    caches: list[LayerCache]  # what each of this stage's layers keeps in the paged pool
    dtype: mx.Dtype = mx.float32  # what this stage computes in: activations, KV pool, hidden states
    # Whether the step being built runs the layers' pure parts through mx.compile (`step/tracing/compiled.py`).
    compile_switch: CompileSwitch = field(default_factory=CompileSwitch)

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.num_layers

    @property
    def layers(self) -> list:
        return self.family.inner(self.model).layers

    def embed(self, token_ids: mx.array) -> mx.array:
        return self.family.embed(self.model, token_ids)

    @property
    def classifies(self) -> bool:
        """A sequence classifier's last stage: the checkpoint's score head instead of an lm_head."""
        return classifier.has_head(self.model)

    def logits(self, hidden: mx.array) -> mx.array:
        if self.classifies:  # what a classifier has for logits (a warm-up prefill samples from them)
            return classifier.classify(self.model, self.family.inner(self.model).norm(hidden))
        return self.family.logits(self.model, hidden)


def load_shard(source: ModelSource, start: int = 0, end: int | None = None,
               fetched: set[str] | None = None) -> ModelShard:
    """`fetched`: the tensors a folder fetched from a model store holds (the others are holes)."""
    config = source.config
    family = family_of(config, source.folder / "config.json")
    num_layers = config["num_hidden_layers"]
    end = num_layers if end is None else end
    if not 0 <= start < end <= num_layers:
        raise ModelLoadError(f"layer range [{start}, {end}) is outside the model's {num_layers} layers")
    gpu = dtypes.on_gpu()
    model = (_load_gguf_model(source, config, start, end, gpu) if source.is_gguf
             else _load_folder_model(source, family, config, whole=fetched is None))
    model = family.language_model(model)
    _keep_only(family.inner(model), model, start, end, num_layers)
    if fetched is not None and not source.is_gguf:
        _check_fetched(model, start, fetched, source.folder)
    dtype = dtypes.compute_dtype(dtypes.model_weights(model), gpu)
    dtypes.settle(model, dtype)
    mx.eval(model.parameters())
    caches = family.layer_caches(config)[start:end]
    switch = CompileSwitch()
    fused = gpu and fuse.FUSE and family.fuses_projections
    layers = family.inner(model).layers
    for i, (layer, cache) in enumerate(zip(layers, caches)):
        family.wrap_layer(layer, cache)
        if fused:
            fuse.fuse_layer(layer)
            layer = layers[i] = fuse.add_norm_block(layer)
        compiled.attach(layer, switch)
    return ModelShard(model=model, config=config, start=start, end=end, num_layers=num_layers, family=family,
                      caches=caches, dtype=dtype, compile_switch=switch)


def _load_folder_model(source: ModelSource, family: Family, config: dict, whole: bool = True) -> nn.Module:
    """`whole`: the folder holds every tensor of the checkpoint; a fetched stage's holds only its own
    (one file each: `transfer/stage_folder.py`), so the load cannot be strict, and `_check_fetched`
    makes sure that every tensor the stage keeps came."""
    head = classifier.score_head(source.folder)
    classes = _get_classes if head is None else classifier.with_score_head(_get_classes, *head)
    if family.mtp_layers(config):
        classes = _without_mtp(classes, family)
    if not whole:
        _open_files_for(source.folder)
    try:
        model, _ = load_model(source.folder, lazy=True, strict=whole, get_model_classes=classes)
    except KeyError as e:  # mlx-lm's sanitize looks up a tensor the checkpoint does not have
        raise ModelLoadError(f"cannot load weights from {source.folder}: tensor {e.args[0]} is missing") from None
    except (ValueError, FileNotFoundError) as e:
        raise ModelLoadError(f"cannot load weights from {source.folder}: {_one_line(e)}") from None
    return model


def _open_files_for(folder) -> None:
    """MLX keeps each safetensors file open until its arrays are read, and a fetched stage's folder
    holds a file per tensor (thousands for a big MoE): let this process open that many (macOS
    starts a process at 256)."""
    import resource

    need = len(list(folder.glob("model*.safetensors"))) + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        for want in (need * 2, need):
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
                return
            except (ValueError, OSError):
                continue


def _without_mtp(get_classes, family: Family):
    """mlx-lm's get_model_classes, its sanitize first dropping the checkpoint's multi-token-prediction
    layers (mlx-lm drops DeepSeek V3's only as layer 61); speculative decoding loads them itself
    (`step/speculative/mtp.py`)."""

    def classes(config: dict):
        model_class, args_class = get_classes(config=config)

        class WithoutMTP(model_class):
            def sanitize(self, weights):
                weights = {k: v for k, v in weights.items() if not family.is_mtp_tensor(k, config)}
                return super().sanitize(weights) if hasattr(model_class, "sanitize") else weights

        WithoutMTP.__name__ = model_class.__name__
        return WithoutMTP, args_class

    return classes


def _load_gguf_model(source: ModelSource, config: dict, start: int, end: int, gpu: bool) -> nn.Module:
    from metal_cluster.stage_worker.model import gguf

    if source.gguf_tensors is not None:  # a fetched stage: its tensors alone, as the GGUF stores them
        from metal_cluster.stage_worker.model import gguf_blocks

        tensors = gguf_blocks.load_index(source.gguf_tensors)
    else:
        tensors, _ = gguf.read_gguf(source.gguf)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    tied = "lm_head" not in model
    last = end == config["num_hidden_layers"]

    def keep(name: str) -> bool:
        if name.startswith("model.layers."):
            return start <= int(name.split(".")[2]) < end
        if name.startswith("model.embed_tokens."):
            return start == 0 or (last and tied)
        return last

    # A GPU keeps Q4_0/Q4_1/Q8_0 tensors as MLX affine triples; the CPU computes in float32.
    weights = gguf.gguf_weights(tensors, config, keep=keep, dequantize=not gpu)
    if not gpu:
        model.eval()
        model.load_weights(list(weights.items()), strict=False)
        return model
    quantized = {name.removesuffix(".scales"): weights[name.removesuffix(".scales") + ".weight"]
                 for name in weights if name.endswith(".scales")}

    def quantize_params(path, _module):
        if path not in quantized:
            return False
        bits = gguf.bits_of(quantized[path], weights[f"{path}.scales"])
        return {"group_size": gguf.GROUP_SIZE, "bits": bits}

    nn.quantize(model, class_predicate=quantize_params)
    model.eval()
    model.load_weights(list(weights.items()), strict=False)
    return model


def _keep_only(inner: nn.Module, model: nn.Module, start: int, end: int, num_layers: int) -> None:
    """Drop what this stage does not run, so none of it is ever evaluated."""
    tied = "lm_head" not in model and not classifier.has_head(model)
    inner.layers = inner.layers[start:end]
    last = end == num_layers
    if start != 0 and not (last and tied):
        inner.pop("embed_tokens")
    if not last:
        inner.pop("norm")
        model.pop("lm_head", None)
        model.pop(classifier.HEAD, None)


def _one_line(e: Exception, names: int = 3) -> str:
    """mlx's "Missing N parameters: \n a,\n b, ..." as one line naming the first few."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
    rest = lines[1:]
    if len(rest) > names:
        rest = rest[:names] + [f"... and {len(rest) - names} more"]
    return " ".join([lines[0], *rest])


_LAYER_PREFIX = re.compile(r"model\.layers\.\d+\.")


def _check_fetched(model: nn.Module, start: int, fetched: set[str], folder) -> None:
    """Every tensor the stage kept was fetched: the strict load saw all names, but the bytes of the
    tensors not fetched are holes, and a stage must never compute with them. A layer's parameter
    that its family's sanitize made out of other tensors (stacked experts, MLA's split kv_b_proj)
    has no name of its own in the checkpoint: its layer's tensors, fetched whole, stand for it."""
    from mlx.utils import tree_flatten

    fetched = {n for n in map(text_tensor_name, fetched) if n is not None}  # the names the stage's model has
    fetched_layers = {m.group(0) for name in fetched if (m := _LAYER_PREFIX.match(name))}
    missing = [name for name in (_global_name(n, start) for n, _ in tree_flatten(model.parameters()))
               if name not in fetched and not ((m := _LAYER_PREFIX.match(name)) and m.group(0) in fetched_layers)]
    if missing:
        raise ModelLoadError(f"{folder}: the stage needs {missing[0]} (and {len(missing) - 1} more), "
                             "which were not fetched from the model store")


def _global_name(name: str, start: int) -> str:
    """'model.layers.0.mlp...' of a stage starting at layer `start` -> its name in the checkpoint."""
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"]:
        parts[2] = str(int(parts[2]) + start)
    return ".".join(parts)


