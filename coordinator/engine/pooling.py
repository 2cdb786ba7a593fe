"""What vLLM's pooling runner (--runner pooling) makes of the model, for the executor: which pooling
task the stages serve, how the last stage pools, and a sequence classifier's head.

vLLM's `--convert embed` makes a causal LM an embedding model (/v1/embeddings; /v1/score and
/v1/rerank as cosine similarity); `--convert classify`, the default for a `*ForSequenceClassification`
checkpoint, makes it a classifier (/classify; /v1/score and /v1/rerank as a cross-encoder when it has
one label). The classification head (the checkpoint's score.weight) runs on the last stage, right
after the pooling; vLLM's calibration and activation follow here, on the pooled logits.
"""

from pathlib import Path

from metal_cluster.coordinator.engine.step_translation import ClassifierHead
from metal_cluster.stage_worker.model import classifier


def pooling_task(model_config) -> str | None:
    """"embed" or "classify" for a pooling model, None for a generating one."""
    if model_config.runner_type != "pooling":
        return None
    return "classify" if model_config.convert_type == "classify" else "embed"


def pooling_type(model_config) -> str:
    """How the last stage pools a prompt (vLLM's pooler config): LAST, MEAN or CLS; "" to generate."""
    if pooling_task(model_config) is None:
        return ""
    config = model_config.pooler_config
    return str(getattr(config, "seq_pooling_type", None) or getattr(config, "pooling_type", None) or "LAST")


def classifier_refusal(model_config) -> str | None:
    """Why this checkpoint cannot be served as vLLM's classifier (one line), or None when it can."""
    if pooling_task(model_config) != "classify":
        return None
    hf = model_config.hf_config
    if getattr(hf, "classifier_from_token", None) or getattr(hf, "method", None):
        return ("a head made from lm_head rows (classifier_from_token / method, as an LLM reranker's "
                "hf_overrides ask) is not supported yet: serve a checkpoint with a score.weight head")
    head = classifier.score_head(Path(model_config.model))
    if head is None:
        return ("--convert classify needs the checkpoint's classification head, a score.weight tensor "
                "[num_labels, hidden] (a *ForSequenceClassification checkpoint); this one has none")
    (num_labels, _), _ = head
    if num_labels != getattr(hf, "num_labels", num_labels):
        return (f"score.weight has {num_labels} rows but config.json names {hf.num_labels} labels "
                "(id2label): they must agree")
    return None


def classifier_head(model_config) -> ClassifierHead | None:
    """vLLM's own activation for this classifier (sigmoid for one label, softmax for several, or
    what the config names) and its score calibration."""
    if pooling_task(model_config) != "classify":
        return None
    from vllm.model_executor.layers.pooler.activations import resolve_classifier_act_fn

    pooler = model_config.pooler_config
    return ClassifierHead(resolve_classifier_act_fn(model_config, static_num_labels=False),
                          getattr(pooler, "logit_mean", None), getattr(pooler, "logit_sigma", None))
