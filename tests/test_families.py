"""The MoE and sliding-window families (tiny_models.MORE_FAMILIES) held to the runner suite's checks:
greedy tokens equal mlx-lm's own generation in float32 (one request, packed, chunked, prefix hit,
preempted), and a stage chain cut through dense/MoE and sliding/global layers equals the whole."""

import mlx.core as mx
import pytest
from mlx_lm.utils import load

import tiny_models
from references import mlx_lm_greedy
from test_runner import (PROMPTS, make_runner, test_chunked_prefill_mixed_with_decodes,  # noqa: F401
                         test_eight_requests_packed_in_one_batch, test_one_request, test_preempted_and_resumed,
                         test_shared_prefix_blocks,
                         test_decode_steps_take_the_compiled_path_and_prompt_chunks_do_not)

from metal_cluster.stage_worker.errors import ModelLoadError
from metal_cluster.stage_worker.model.model_source import resolve_model
from metal_cluster.stage_worker.model.shard import load_shard


@pytest.fixture(scope="session", params=tiny_models.MORE_FAMILIES)
def more_model(request, tmp_path_factory):
    return tiny_models.build_tiny_model(request.param, tmp_path_factory.mktemp(request.param), num_layers=6)


@pytest.fixture(scope="module")
def family(more_model):
    ref_model, tokenizer = load(str(more_model))
    return resolve_model(more_model), ref_model, [tokenizer.encode(p) for p in PROMPTS]


def test_stage_chain_equals_whole_model(family):
    """Stages [0,2) [2,3) [3,6): the first boundary cuts dense from MoE (qwen3_moe, glm4_moe), and
    both cut between sliding and global layers (gpt_oss; gemma3's layer 2 is global)."""
    source, _, prompts = family
    whole = make_runner(source)
    chain = [make_runner(source, a, b) for a, b in ((0, 2), (2, 3), (3, 6))]
    from metal_cluster.proto import pb
    from scheduler_double import SchedulerDouble
    import test_runner

    def run_chain(step):
        hidden = None
        for runner in chain:
            out = runner.step(step, hidden)
            hidden = out.hidden
        return {r: s.token_id for r, s in out.sampled.items()}

    def run_whole(step):
        return {r: s.token_id for r, s in whole.step(step).sampled.items()}

    results = []
    for run in (run_whole, run_chain):
        sched = SchedulerDouble(run, test_runner.NUM_BLOCKS, test_runner.BLOCK_SIZE, chunk_size=7)
        for i in (1, 3, 6):
            sched.add(f"r{i}", prompts[i], 10)
        results.append(sched.run())
    assert results[0] == results[1]


def test_missing_expert_tensor_is_one_line(more_model, tmp_path):
    """A checkpoint that lacks one expert's tensor names the file and the tensor."""
    import shutil

    config = resolve_model(more_model).config
    if config["model_type"] not in ("qwen3_moe", "glm4_moe", "mixtral", "deepseek_v3"):
        pytest.skip("per-expert tensors: the Hugging Face MoE layouts")
    broken = tmp_path / "broken"
    shutil.copytree(more_model, broken)
    weights = mx.load(str(broken / "model.safetensors"))
    name = next(n for n in weights if ".experts.1." in n)
    del weights[name]
    mx.save_safetensors(str(broken / "model.safetensors"), weights)
    with pytest.raises(ModelLoadError) as e:
        load_shard(resolve_model(broken))
    message = str(e.value)
    assert "\n" not in message and str(broken) in message and "experts.1" in message, message


# A server costs ~45 s on CI's two cores: by default three families are served, each with one of
# the two splits (MoE behind dense layers, sinks with sliding layers, 2 : 1 sliding : global), and
# Mixtral and GLM's MoE only by the in-process stage chain above. All ten pairs passed on
# 2026-12-01; METAL_CLUSTER_ALL_SPLITS=1 runs them all.
CI_STAGES = {"qwen3_moe": 3, "gpt_oss": 2, "gemma3_text": 3}


@pytest.mark.parametrize("stages", [2, 3])
def test_serve_pipeline_matches_mlx_lm(more_model, family, stages, tmp_path):
    """Through `serve -pp`: 6 layers as [0,3) [3,6) or [0,2) [2,4) [4,6), which cut dense from MoE
    (at 2) and sliding from global layers (gemma3: 2 and 5 are global; gpt_oss alternates)."""
    import concurrent.futures
    import os

    model_type = resolve_model(more_model).config["model_type"]
    if CI_STAGES.get(model_type) != stages and os.environ.get("METAL_CLUSTER_ALL_SPLITS") != "1":
        pytest.skip(f"{model_type} -pp {stages} runs with METAL_CLUSTER_ALL_SPLITS=1 (CI time)")

    import openai
    from server_process import running_server
    from test_pipeline import ARGS, greedy

    _, ref_model, prompts = family
    chosen = [prompts[i] for i in (1, 3, 4, 6)]
    expected = [mlx_lm_greedy(ref_model, ids, 10) for ids in chosen]
    with running_server(more_model, *ARGS, "-pp", str(stages), log_path=tmp_path / "server.log") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda ids: greedy(client, ids, 10), chosen)) == expected
        longer = chosen[0] + chosen[1]  # a prefix-cache hit on the first prompt's blocks
        assert greedy(client, longer, 8) == mlx_lm_greedy(ref_model, longer, 8)
