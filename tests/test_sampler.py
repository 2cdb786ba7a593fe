"""The MLX sampler's filters against vLLM's own torch code on the same logits: the same tokens kept,
the same values after penalties and bad words (vLLM's semantics, not our reading of them)."""

import mlx.core as mx
import numpy as np
import pytest

from metal_cluster.proto import pb
from metal_cluster.stage_worker.step import sampler
from metal_cluster.stage_worker.step.sampler import SampleRow

VOCAB = 64


def _rows(params_list, **kw):
    return [SampleRow(p, num_outputs=len(kw.get("outputs", [()] * len(params_list))[i]), draw=i,
                      prompt_ids=kw.get("prompts", [()] * len(params_list))[i],
                      output_ids=kw.get("outputs", [()] * len(params_list))[i])
            for i, p in enumerate(params_list)]


def test_top_k_top_p_keep_what_vllm_keeps():
    torch = pytest.importorskip("torch")
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    logits = np.random.default_rng(0).normal(scale=3, size=(5, VOCAB)).astype(np.float32)
    ks, ps = [1, 5, VOCAB, 20, 3], [1.0, 0.9, 0.5, 0.05, 0.99]
    rows = _rows([pb.SamplingParams(temperature=1.0, top_k=k if k < VOCAB else 0, top_p=p) for k, p in zip(ks, ps)])
    ours = np.array(sampler._top_k_top_p(mx.array(logits), rows, np.ones(5, dtype=bool)))
    theirs = apply_top_k_top_p_pytorch(torch.from_numpy(logits.copy()), torch.tensor(ks), torch.tensor(ps)).numpy()
    assert (np.isinf(ours) == np.isinf(theirs)).all()
    assert 0 < np.isfinite(ours).sum() < ours.size


def test_penalties_and_bad_words_as_vllm_applies_them():
    torch = pytest.importorskip("torch")
    from vllm.v1.sample.ops.bad_words import apply_bad_words
    from vllm.model_executor.layers.utils import apply_penalties

    logits = np.random.default_rng(1).normal(scale=3, size=(3, VOCAB)).astype(np.float32)
    prompts, outputs = [(1, 2, 3), (4, 5), (6,)], [(7, 7, 8), (9,), (2, 3)]
    params = [pb.SamplingParams(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.3),
              pb.SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5),
              pb.SamplingParams(repetition_penalty=1.0)]
    params[2].bad_words.add(token_ids=[3, 11])  # its output ends with 3: 11 is banned
    params[2].bad_words.add(token_ids=[2, 12])  # ... but not with 2: 12 stays
    params[2].bad_words.add(token_ids=[13])
    rows = _rows(params, prompts=prompts, outputs=outputs)
    ours = sampler._apply_penalties(sampler._apply_processors(mx.array(logits), rows), rows)

    expected = torch.from_numpy(logits.copy())
    apply_bad_words(expected, {2: [list(w.token_ids) for w in params[2].bad_words]}, [list(o) for o in outputs])

    def padded(lists):  # vLLM pads with the vocabulary size, an id no token has
        width = max(map(len, lists))
        return torch.tensor([list(x) + [VOCAB] * (width - len(x)) for x in lists])

    expected = apply_penalties(expected, padded(prompts), padded(outputs),
                               torch.tensor([p.presence_penalty for p in params]),
                               torch.tensor([p.frequency_penalty for p in params]),
                               torch.tensor([p.repetition_penalty for p in params]))
    np.testing.assert_allclose(np.array(ours), expected.numpy(), rtol=1e-6, atol=1e-6)
    assert np.isneginf(np.array(ours)[2, [11, 13]]).all() and np.isfinite(np.array(ours)[2, 12])
