"""A sequence classifier's head (a `*ForSequenceClassification` checkpoint, vLLM's classify task): a
linear `score` layer [num_labels, hidden] over the final-norm hidden state, in place of the lm_head.

mlx-lm builds the causal LM of the same model type; `with_score_head` swaps its lm_head for the
checkpoint's score layer, so the strict load still checks every tensor. vLLM computes the head in
float32 (its pooling models' head dtype), and so does `classify`.
"""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from metal_cluster.stage_worker.model.checkpoint_sizes import read_headers

HEAD = "score"


def score_head(folder: Path) -> tuple[tuple[int, int], bool] | None:
    """The checkpoint's score layer as (weight shape, has a bias), or None when it has none."""
    tensors = read_headers(folder)
    weight = tensors.get(f"{HEAD}.weight")
    if weight is None:
        return None
    return tuple(weight["shape"]), f"{HEAD}.bias" in tensors


def with_score_head(get_classes, shape: tuple[int, int], bias: bool):
    """mlx-lm's get_model_classes, its model class given the score layer instead of the lm_head."""

    def classes(config: dict):
        model_class, args_class = get_classes(config=config)

        class SequenceClassifier(model_class):
            def __init__(self, args):
                super().__init__(args)
                self.pop("lm_head", None)
                num_labels, hidden = shape
                setattr(self, HEAD, nn.Linear(hidden, num_labels, bias=bias))

        SequenceClassifier.__name__ = f"{model_class.__module__.rsplit('.', 1)[-1]}SequenceClassifier"
        return SequenceClassifier, args_class

    return classes


def has_head(model: nn.Module) -> bool:
    return HEAD in model


def classify(model: nn.Module, pooled: mx.array) -> mx.array:
    """The head's logits [..., num_labels] of pooled final-norm hidden states, in float32."""
    head = model[HEAD]
    out = pooled.astype(mx.float32) @ head.weight.astype(mx.float32).T
    if "bias" in head:
        out = out + head.bias.astype(mx.float32)
    return out
