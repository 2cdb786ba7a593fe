"""Hybrid models (Gated DeltaNet + attention; tiny_models.HYBRID_FAMILIES) through the stage runner:
greedy tokens equal mlx-lm's own generation in float32 with each request's recurrent state in the
pool (one request, packed, chunked prefill mixed with decodes, preempted and recomputed), and a
stage chain cut between recurrent and attention layers equals the whole model."""

import pytest
from mlx_lm.utils import load

import tiny_models
from test_runner import (PROMPTS, make_runner, test_chunked_prefill_mixed_with_decodes,  # noqa: F401
                         test_eight_requests_packed_in_one_batch, test_one_request, test_preempted_and_resumed)

from metal_cluster.stage_worker.model_source import resolve_model


@pytest.fixture(scope="module", params=tiny_models.HYBRID_FAMILIES)
def family(request, tmp_path_factory):
    folder = tiny_models.build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), num_layers=6)
    ref_model, tokenizer = load(str(folder))
    return resolve_model(folder), ref_model, [tokenizer.encode(p) for p in PROMPTS]


def test_stage_chain_equals_whole_model(family):
    """Stages [0,2) [2,3) [3,6): layer 2 is the first attention layer, so one stage holds it alone."""
    import test_runner
    from scheduler_double import SchedulerDouble

    source, _, prompts = family
    whole = make_runner(source)
    chain = [make_runner(source, a, b) for a, b in ((0, 2), (2, 3), (3, 6))]

    def run_chain(step):
        hidden = None
        for runner in chain:
            out = runner.step(step, hidden)
            hidden = out.hidden
        return {r: s.token_id for r, s in out.sampled.items()}

    results = []
    for run in (lambda step: {r: s.token_id for r, s in whole.step(step).sampled.items()}, run_chain):
        sched = SchedulerDouble(run, test_runner.NUM_BLOCKS, test_runner.BLOCK_SIZE, chunk_size=7)
        for i in (1, 3, 6):
            sched.add(f"r{i}", prompts[i], 10)
        results.append(sched.run())
    assert results[0] == results[1]
