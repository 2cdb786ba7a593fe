"""Hybrid models (Gated DeltaNet + attention; tiny_models.HYBRID_FAMILIES) through the stage runner:
greedy tokens equal mlx-lm's own generation in float32 with each request's recurrent state in the
pool (one request, packed, chunked prefill mixed with decodes, preempted and recomputed), and a
stage chain cut between recurrent and attention layers equals the whole model."""

import pytest
from mlx_lm.utils import load

import tiny_models
from test_families import test_stage_chain_equals_whole_model  # noqa: F401  (layer 2: the first attention layer)
from test_runner import (PROMPTS, test_chunked_prefill_mixed_with_decodes,  # noqa: F401
                         test_eight_requests_packed_in_one_batch, test_one_request, test_preempted_and_resumed)

from metal_cluster.stage_worker.model_source import resolve_model


@pytest.fixture(scope="module", params=tiny_models.HYBRID_FAMILIES)
def family(request, tmp_path_factory):
    folder = tiny_models.build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), num_layers=6)
    ref_model, tokenizer = load(str(folder))
    return resolve_model(folder), ref_model, [tokenizer.encode(p) for p in PROMPTS]
