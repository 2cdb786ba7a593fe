"""A draft model's drafts (vLLM's `draft_model` method) or MTP layers' (`mtp`), as the scheduler
takes them: both run on the last stage (stage_worker/step/speculative/draft.py, mtp.py) and their drafts come back
in the output of the step they extend (`StepResponse.spec_drafts`), so under pipeline parallelism too they always follow
the history they were made from, as n-gram drafts do (cluster_scheduler.py)."""

from dataclasses import dataclass

from metal_cluster.coordinator.engine.ngram import room


@dataclass(frozen=True)
class ModelDrafter:
    """The drafts a step's output carries for a request, cut to the room its next step has."""

    k: int
    max_model_len: int

    @classmethod
    def from_config(cls, speculative_config, max_model_len: int) -> "ModelDrafter | None":
        if speculative_config is None or speculative_config.method not in ("draft_model", "mtp"):
            return None
        return cls(speculative_config.num_speculative_tokens, max_model_len)

    def drafts(self, request, output) -> list[int]:
        proposed = (getattr(output, "spec_drafts", None) or {}).get(request.request_id)
        if proposed is None:
            return []
        after, tokens = proposed
        if after != request.num_tokens:  # made for another history (vLLM cut the output short)
            return []
        return tokens[: max(0, room(request, self.k, self.max_model_len))]
