"""vLLM's SchedulerOutput -> our StepRequest, and our StepResponse -> vLLM's ModelRunnerOutput.

vLLM's own runners remember the tokens they sampled. A single stage does the same
(`stage_keeps_tokens`); in a pipeline the sampling stage is not the embedding one, so the
coordinator remembers the tokens and ships each one once, in the request's next step (new_token_ids).
"""

from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np

from metal_cluster.coordinator.engine.prompt_logprobs import PromptLogprobsCollector
from metal_cluster.proto import PROTO_VERSION, pb


def sampling_to_proto(sp) -> pb.SamplingParams:
    """vLLM's SamplingParams, as far as choosing a token needs them (stop strings, n, max_tokens and
    detokenizing stay with vLLM's front end and scheduler)."""
    out = pb.SamplingParams(
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k if sp.top_k and sp.top_k > 0 else 0,
        min_p=sp.min_p,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
    )
    if sp.seed is not None:
        out.seed = sp.seed
    if sp.logprobs is not None:
        out.logprobs = sp.logprobs
    if sp.prompt_logprobs is not None:
        out.prompt_logprobs = sp.prompt_logprobs
    out.logprob_token_ids.extend(sp.logprob_token_ids or ())
    out.allowed_token_ids.extend(sp.allowed_token_ids or ())
    for word in sp.bad_words_token_ids or ():
        out.bad_words.add(token_ids=word)
    if sp.min_tokens:
        out.min_tokens = sp.min_tokens
        out.stop_token_ids.extend(sorted(sp.all_stop_token_ids))  # EOS and stop_token_ids
    for token, bias in (sp.logit_bias or {}).items():
        out.logit_bias[int(token)] = bias
    out.structured = sp.structured_outputs is not None
    return out


@dataclass
class PoolingHead:
    """vLLM's embedding head after the pooling the last stage did: matryoshka truncation to
    `dimensions`, then L2 normalisation (use_activation)."""

    dimensions: int | None
    normalize: bool

    def apply(self, vector: np.ndarray):
        import torch

        if self.dimensions:
            vector = vector[: self.dimensions]
        if self.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)  # torch's F.normalize eps
        return torch.from_numpy(np.ascontiguousarray(vector, dtype=np.float32))


@dataclass
class ClassifierHead:
    """vLLM's classifier head after the classification head the last stage applied: the affine
    calibration (logit - logit_mean) / logit_sigma, then the model's activation (vLLM's own: sigmoid
    for one label, softmax for several, or what the config names) unless the request turns it off."""

    activation: object  # vLLM's PoolerActivation of this model (a torch module)
    logit_mean: float | None = None
    logit_sigma: float | None = None
    use_activation: bool = True

    def for_request(self, params) -> "ClassifierHead":
        return replace(self, use_activation=params.use_activation is not False)

    def apply(self, logits: np.ndarray):
        import torch

        out = torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))
        if self.logit_mean is not None:
            out = out - self.logit_mean
        if self.logit_sigma is not None:
            out = out / self.logit_sigma
        return self.activation(out) if self.use_activation else out


@dataclass
class Admitted:
    """What a stage learns of a request when it first sees it, kept for a later plan's stages."""

    num_prompt_tokens: int
    sampling: pb.SamplingParams
    lora_id: int = 0
    pooling: str = ""
    classify: bool = False


class StepTranslator:
    def __init__(self, stage_keeps_tokens: bool = False, admitted: dict[str, Admitted] | None = None,
                 pooling: str = "", heads: dict | None = None, classifier: ClassifierHead | None = None):
        self.step_id = 0
        self.pooling = pooling  # a pooling model's pooling type (vLLM's pooler config), else ""
        self.classifier = classifier  # a sequence classifier's head (vLLM's classify task), else None
        self.heads: dict[str, PoolingHead | ClassifierHead] = dict(heads or {})
        # A single stage (first and last) keeps what it samples; stage 0 of a pipeline is told.
        self.stage_keeps_tokens = stage_keeps_tokens
        self.unsent: dict[str, list[int]] = defaultdict(list)
        self.prompt_logprobs = PromptLogprobsCollector()
        # Every unfinished request any plan has seen. One the scheduler resumes after a re-plan is
        # unknown to the new stages: it goes to them as a new request with its outputs.
        self.admitted: dict[str, Admitted] = dict(admitted or {})
        self.on_stages: set[str] = set()
        # Requests that could not run (their LoRA adapter cannot be read): never sent to the stages,
        # while the scheduler, which ends them, may still schedule them.
        self.kept_back: set[str] = set()

    def next_plan(self, stage_keeps_tokens: bool) -> "StepTranslator":
        translator = StepTranslator(stage_keeps_tokens, self.admitted, self.pooling, self.heads, self.classifier)
        translator.kept_back = set(self.kept_back)
        return translator

    def forget(self, finished_req_ids) -> None:
        for req_id in finished_req_ids:
            self.kept_back.discard(req_id)
            self.unsent.pop(req_id, None)
            self.admitted.pop(req_id, None)
            self.heads.pop(req_id, None)
            self.on_stages.discard(req_id)
            self.prompt_logprobs.forget(req_id)

    def to_step(self, so, grammar=None, keep_back=()) -> pb.StepRequest:
        """keep_back: new requests that must not run (they end with an error instead)."""
        step = pb.StepRequest(version=PROTO_VERSION, step_id=self.step_id, stage_keeps_tokens=self.stage_keeps_tokens)
        self.step_id += 1
        step.finished_req_ids.extend(so.finished_req_ids)
        self.forget(so.finished_req_ids)
        self.kept_back.update(keep_back)
        for new in so.scheduled_new_reqs:
            if new.req_id in self.kept_back:
                continue
            pooling, classify = "", False
            if new.pooling_params is not None:  # no sampling: the last stage pools the prompt
                pooling = self.pooling or "LAST"
                params = new.pooling_params
                classify = params.task == "classify"
                self.heads[new.req_id] = (self.classifier.for_request(params) if classify
                                          else PoolingHead(params.dimensions, params.use_activation is not False))
                sampling = pb.SamplingParams()
            else:
                if new.sampling_params.prompt_logprobs is not None:
                    self.prompt_logprobs.expect(new.req_id, len(new.prompt_token_ids))
                sampling = sampling_to_proto(new.sampling_params)
            lora_id = new.lora_request.lora_int_id if new.lora_request is not None else 0
            self.admitted[new.req_id] = Admitted(len(new.prompt_token_ids), sampling, lora_id, pooling, classify)
            self.on_stages.add(new.req_id)
            step.new_requests.append(pb.NewRequest(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                # A preempted request comes back as a new one (vLLM's model runner V2) with its whole
                # history to recompute: the prompt, then what it had produced.
                output_token_ids=(new.prefill_token_ids or [])[len(new.prompt_token_ids):],
                block_ids=new.block_ids[0],
                group_block_ids=[pb.BlockIds(ids=ids) for ids in new.block_ids[1:]],
                num_computed_tokens=new.num_computed_tokens,
                sampling=sampling,
                lora_id=lora_id,
                pooling=pooling,
                classify=classify,
            ))
        for cached in self._cached(so.scheduled_cached_reqs):
            if isinstance(cached, pb.NewRequest):
                step.new_requests.append(cached)
            else:
                step.cached_requests.append(cached)
        drafts = so.scheduled_spec_decode_tokens
        for req_id, n in so.num_scheduled_tokens.items():
            if req_id in self.kept_back:
                continue
            step.scheduled.append(pb.ScheduledTokens(req_id=req_id, num_tokens=n, draft_token_ids=drafts.get(req_id, ())))
        for copy in so.kv_cache_block_copies or ():
            step.block_copies.append(pb.BlockCopy(src=copy.src_block_id, dst=copy.dst_block_id))
        if grammar is not None:
            step.grammar_req_ids.extend(grammar.structured_output_request_ids)
            step.grammar_bitmask = np.ascontiguousarray(grammar.grammar_bitmask, dtype=np.int32).tobytes()
            # With speculative decoding vLLM gives every request 1 + k rows, one per scored position.
            step.grammar_rows_per_request = len(grammar.grammar_bitmask) // len(grammar.structured_output_request_ids)
        return step

    def _cached(self, cached):
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self.kept_back:
                continue
            if req_id not in self.on_stages and req_id in self.admitted and req_id in cached.all_token_ids:
                yield self._resumed_elsewhere(req_id, cached, i)
                continue
            msg = pb.CachedRequest(
                req_id=req_id,
                resumed=req_id in cached.resumed_req_ids,
                num_computed_tokens=cached.num_computed_tokens[i],
            )
            if cached.new_block_ids[i] is not None:
                first, *rest = cached.new_block_ids[i]
                msg.block_ids.extend(first)
                msg.group_block_ids.extend(pb.BlockIds(ids=ids) for ids in rest)
            if req_id in cached.all_token_ids:
                msg.all_token_ids.extend(cached.all_token_ids[req_id])
                self.unsent.pop(req_id, None)  # the full history already holds them
            else:
                msg.new_token_ids.extend(self.unsent.pop(req_id, []))
            yield msg

    def _resumed_elsewhere(self, req_id: str, cached, i: int) -> pb.NewRequest:
        """A request of an earlier plan, preempted by the re-plan and now resumed: new to these stages."""
        seen = self.admitted[req_id]
        tokens = cached.all_token_ids[req_id]
        blocks = cached.new_block_ids[i] or ()
        self.unsent.pop(req_id, None)
        self.on_stages.add(req_id)
        return pb.NewRequest(
            req_id=req_id,
            prompt_token_ids=tokens[: seen.num_prompt_tokens],
            output_token_ids=tokens[seen.num_prompt_tokens :],
            block_ids=blocks[0] if blocks else [],
            group_block_ids=[pb.BlockIds(ids=ids) for ids in blocks[1:]],
            num_computed_tokens=cached.num_computed_tokens[i],
            sampling=seen.sampling,
            lora_id=seen.lora_id,
            pooling=seen.pooling,
            classify=seen.classify,
        )

    def pooled(self, so, response: pb.StepResponse) -> list | None:
        """vLLM's pooler_output: per scheduled request its embedding or class scores, or None (prompt
        not done yet)."""
        if not self.pooling:
            return None
        by_req = {p.req_id: p for p in response.pooled}
        return [self.heads[r].apply(np.array(by_req[r].data, dtype=np.float32)) if r in by_req else None
                for r in so.num_scheduled_tokens]

    def record(self, response: pb.StepResponse) -> None:
        if self.stage_keeps_tokens:
            return
        for s in response.sampled:  # in order, several for a request that verified drafts
            self.unsent[s.req_id].append(s.token_id)


def to_runner_output(so, response: pb.StepResponse, prompt_logprobs: dict | None = None, pooled: list | None = None):
    from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput

    req_ids = list(so.num_scheduled_tokens)
    index = {r: i for i, r in enumerate(req_ids)}
    by_req = defaultdict(list)  # a request that verified drafts has several tokens, in order
    for s in response.sampled:
        by_req[s.req_id].append(s)
    # [] = mid-prefill, no token this step
    tokens = [[s.token_id for s in by_req.get(r, ())] for r in req_ids]
    logprobs = None
    if any(s.HasField("top") for s in response.sampled):
        # vLLM's layout: one row per generated token, request after request (cu_num_generated_tokens
        # says where each starts; a request with no token this step has no row).
        starts = np.concatenate([[0], np.cumsum([len(t) for t in tokens])]).astype(int).tolist()
        width = 1 + max(len(s.top.token_ids) for s in response.sampled)
        n = starts[-1]
        ids = np.zeros((n, width), dtype=np.int32)
        lps = np.full((n, width), -np.inf, dtype=np.float32)
        ranks = np.zeros(n, dtype=np.int32)
        for req_id, sampled in by_req.items():
            for row, s in enumerate(sampled, start=starts[index[req_id]]):
                ids[row, 0], lps[row, 0], ranks[row] = s.token_id, s.logprob, s.rank
                k = len(s.top.token_ids)
                ids[row, 1 : 1 + k] = s.top.token_ids
                lps[row, 1 : 1 + k] = s.top.logprobs
        logprobs = LogprobsLists(ids, lps, ranks, starts[:-1])
    common = dict(req_ids=req_ids, req_id_to_index=index, sampled_token_ids=tokens, logprobs=logprobs,
                  prompt_logprobs_dict=prompt_logprobs or {}, pooler_output=pooled)
    if response.spec_drafts:
        from metal_cluster.coordinator.engine.cluster_scheduler import DraftedOutput

        drafts = {d.req_id: (d.after, list(d.token_ids)) for d in response.spec_drafts}
        return DraftedOutput(**common, spec_drafts=drafts)
    return ModelRunnerOutput(**common)
