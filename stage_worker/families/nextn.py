"""The multi-token-prediction layers DeepSeek V3 and GLM-4.5 ship (`num_nextn_predict_layers`, after
the decoder layers: `model.layers.{N + i}.*`), which mlx-lm's sanitize drops: what a family file
needs to read and run them for speculative decoding's `mtp` method (vLLM's DeepSeekMTP and
Glm4MoeMTP). Each is enorm and hnorm (of the next token's embedding and of the target's hidden
state), eh_proj mixing the two, one decoder layer of the family's own kind, and shared_head (norm,
head); a layer may carry its own copy of the embedding."""

import dataclasses
import importlib
import re
from collections.abc import Callable
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn

from metal_cluster.stage_worker.errors import ModelLoadError
from metal_cluster.stage_worker.families.base import LayerCache, MTPLayer

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# A layer's own parts; the rest of its tensors are its decoder layer's.
_OWN_PARTS = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")


class NextNHooks:
    """A family's multi-token-prediction hooks (families/base.py), for families whose checkpoints
    carry NextN layers of the family's own decoder layer; mixed in before Family. The family names
    mlx-lm's module and decoder-layer class, and whether a further guess reads shared_head's norm
    of the last output (DeepSeek) or the output itself (GLM), as vLLM 0.33 does."""

    mtp_module: str  # mlx_lm.models.<this>
    mtp_block: str  # its decoder layer class
    mtp_recycles_norm: bool

    def mtp_layers(self, config):
        return layer_count(config)

    def is_mtp_tensor(self, name, config):
        return is_tensor(name, config)

    def load_mtp(self, source, config):
        if not layer_count(config):
            return super().load_mtp(source, config)
        module = importlib.import_module(f"mlx_lm.models.{self.mtp_module}")
        args = module.ModelArgs.from_dict(config)
        one = SimpleNamespace(args=dataclasses.replace(args, num_hidden_layers=1))
        block = getattr(module, self.mtp_block)
        return load(source, config, block=lambda i: block(args, i), sanitize=lambda w: module.Model.sanitize(one, w),
                    cache=self.layer_caches(config)[-1], recycles_norm=self.mtp_recycles_norm,
                    keep_dtype=lambda k: "e_score_correction_bias" not in k)  # as mlx-lm keeps it


def layer_count(config: dict) -> int:
    return config.get("num_nextn_predict_layers") or 0


def is_tensor(name: str, config: dict) -> bool:
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= config["num_hidden_layers"]


class NextNLayer(MTPLayer):
    """At position p: the embedding of token p + 1 (zero at position 0, as vLLM masks it) and the
    target's hidden state, each RMS-normed, concatenated, projected, through the decoder layer;
    shared_head's norm and head give the logits. `recycles_norm`: the next guess reads the output
    after shared_head's norm (vLLM's DeepSeek MTP) or as it is (vLLM's GLM MTP)."""

    def __init__(self, hidden: int, vocab: int, eps: float, block: nn.Module, cache: LayerCache,
                 recycles_norm: bool, keep_dtype: Callable[[str], bool] | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.enorm = nn.RMSNorm(hidden, eps=eps)
        self.hnorm = nn.RMSNorm(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = block
        self.shared_head = nn.Module()
        self.shared_head.norm = nn.RMSNorm(hidden, eps=eps)
        self.shared_head.head = nn.Linear(hidden, vocab, bias=False)
        self.cache = cache
        self.recycles_norm = recycles_norm
        self._keep_dtype = keep_dtype

    @property
    def cast_predicate(self):
        return self._keep_dtype or (lambda k: True)

    def __call__(self, tokens, positions, hidden, context):
        e = mx.where((positions == 0)[:, None], 0, self.embed_tokens(tokens))
        x = self.eh_proj(mx.concatenate([self.enorm(e), self.hnorm(hidden).astype(e.dtype)], axis=-1))
        return self.block(x[None], None, context)[0]

    def logits(self, out):
        return self.shared_head.head(self.shared_head.norm(out))

    def recycle(self, out):
        return self.shared_head.norm(out) if self.recycles_norm else out


def load(source, config: dict, *, block: Callable[[int], nn.Module],
         sanitize: Callable[[dict], dict], cache: LayerCache, recycles_norm: bool,
         keep_dtype: Callable[[str], bool] | None = None) -> list[NextNLayer]:
    """The checkpoint's NextN layers, weights lazy. `block(i)`: the family's decoder layer of global
    index i (mlx-lm's class); `sanitize`: mlx-lm's sanitize of a one-layer model of the family, which
    the layer's tensors go through as layer 0 (stacked experts, MLA's kv_b_proj split, fp8
    dequantized), so they arrive as the family's own layers' do."""
    from metal_cluster.stage_worker.model.tensors import load_tensors

    first, n = config["num_hidden_layers"], layer_count(config)
    top = ("model.embed_tokens.weight", "lm_head.weight")  # for layers without their own copies
    stored = load_tensors(source.folder, lambda name: is_tensor(name, config) or name in top)
    layers = []
    for index in range(first, first + n):
        prefix = f"model.layers.{index}."
        own = {k[len(prefix):]: v for k, v in stored.items() if k.startswith(prefix)}
        if not own:
            raise ModelLoadError(f"{source.folder}: config.json has num_nextn_predict_layers, but the checkpoint has "
                                 f"no tensors {prefix}* (mlx-lm's conversions drop them): use the original "
                                 "checkpoint, or speculate with \"ngram\" or \"draft_model\"")
        for name, fallback in (("embed_tokens.weight", top[0]), ("shared_head.head.weight", top[1]),
                               ("shared_head.head.weight", top[0])):  # a tied head is the embedding
            if name not in own and fallback in stored:
                own[name] = stored[fallback]
        if any(k.endswith(".scales") for k in own):
            raise ModelLoadError(f"{source.folder}: quantized MTP layers ({prefix}*) are not supported; "
                                 "use a checkpoint whose MTP layers are in float, bfloat16 or fp8")
        weights = {}
        for name, v in sanitize({f"model.layers.0.{k}": v for k, v in own.items()}).items():
            name = name.removeprefix("model.layers.0.")
            weights[name if name.startswith(_OWN_PARTS) else "block." + name] = v
        layer = NextNLayer(config["hidden_size"], config["vocab_size"], config.get("rms_norm_eps", 1e-6),
                           block(index), cache, recycles_norm, keep_dtype)
        try:
            layer.load_weights(list(weights.items()), strict=True)
        except ValueError as e:
            raise ModelLoadError(f"{source.folder}: MTP layer {prefix}*: {str(e).splitlines()[0]}") from None
        layers.append(layer)
    return layers
