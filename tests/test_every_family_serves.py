"""Every `model_type` in the README's family table starts `serve` and answers greedily as mlx-lm
does. Most are served by their own family's suite (SERVED_ELSEWHERE); the rest boot here, one
single-stage server each: model types that share a family file with a served one (mistral,
kimi_k2) go through vLLM's own config and architecture resolution, which is what broke qwen3_5 on a
fresh machine (vLLM's inspection reached for vision code that the README's install lacks)."""

import json
import re
import shutil
from pathlib import Path

import pytest

import test_families
import test_hybrid
import tiny_models
from references import mlx_lm_greedy

README = Path(__file__).resolve().parent.parent / "README.md"

# Where CI serves the others: test_pipeline (FAMILIES, -pp 2 and 3), test_families (CI_STAGES),
# test_hybrid (CI_SERVED), test_mla (deepseek_v3, -pp 2).
SERVED_ELSEWHERE = (set(tiny_models.FAMILIES) | set(test_families.CI_STAGES)
                    | {family for family, _ in test_hybrid.CI_SERVED} | {"deepseek_v3"})

# model_type -> (tiny family whose weights it reuses, architecture its config.json names)
SERVED_HERE = {
    "mistral": ("llama", "MistralForCausalLM"),
    "mixtral": ("mixtral", None),
    "glm4_moe": ("glm4_moe", None),
    "kimi_k2": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "qwen3_5": ("qwen3_5", None),
}

# The image processor config a Qwen3.5 checkpoint ships (its keys and values, shortened).
QWEN_VL_PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
                        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                        "size": {"longest_edge": 16777216, "shortest_edge": 65536}}

ARGS = ["--gpu-memory-utilization", "0.05", "--max-model-len", "256", "--max-num-batched-tokens", "64",
        "--max-num-seqs", "2", "--served-model-name", "m"]


def readme_model_types() -> set[str]:
    """The second column of the table under the README's "model_type in config.json" sentence."""
    text = README.read_text()
    table = text[text.index("| family | model types |"):].split("\n\n", 1)[0]
    return {t for row in table.splitlines()[2:] for t in re.findall(r"`([a-z0-9_]+)`", row.split("|")[2])}


def test_every_readme_family_is_served_by_some_test():
    types = readme_model_types()
    assert len(types) >= 14, types  # the table was found and read
    assert types == SERVED_ELSEWHERE | set(SERVED_HERE), (
        f"not served by any test: {sorted(types - SERVED_ELSEWHERE - set(SERVED_HERE))}; "
        f"served but not in the README: {sorted(SERVED_ELSEWHERE | set(SERVED_HERE) - types)}")
    assert not SERVED_ELSEWHERE & set(SERVED_HERE)


@pytest.mark.parametrize("model_type", sorted(SERVED_HERE))
def test_serve_answers_one_greedy_request(model_type, tmp_path):
    import openai
    from mlx_lm.utils import load

    from server_process import running_server
    from test_pipeline import greedy

    family, architecture = SERVED_HERE[model_type]
    source = tiny_models.build_tiny_model(family, tmp_path / family)
    if family in tiny_models.NESTED_FAMILIES:
        # A vision-language checkpoint ships its image processor's config; vLLM's inspection reads it.
        (source / "preprocessor_config.json").write_text(json.dumps(QWEN_VL_PREPROCESSOR))
    ref_model, tokenizer = load(str(source))
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog")
    expected = mlx_lm_greedy(ref_model, ids, 8)
    served = source
    if architecture is not None:  # the same weights under the other model_type
        served = tmp_path / model_type
        shutil.copytree(source, served)
        config = json.loads((served / "config.json").read_text())
        (served / "config.json").write_text(json.dumps({**config, "model_type": model_type,
                                                        "architectures": [architecture]}))
    with running_server(served, *ARGS, log_path=tmp_path / "server.log") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        assert greedy(client, ids, 8) == expected
