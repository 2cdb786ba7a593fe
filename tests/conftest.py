import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tiny_models  # noqa: E402


@pytest.fixture(scope="session", params=tiny_models.FAMILIES)
def tiny_model(request, tmp_path_factory) -> Path:
    """A tiny random-weight model folder of each family."""
    return tiny_models.build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="session")
def llama_model(tmp_path_factory) -> Path:
    return tiny_models.build_tiny_model("llama", tmp_path_factory.mktemp("llama-only"))


@pytest.fixture(scope="session")
def llama_adapters(llama_model, tmp_path_factory) -> dict:
    """Two random LoRA adapters of llama_model: 'alpha' (mlx-lm format), 'beta' (PEFT); see lora_fixtures."""
    from lora_fixtures import build_adapters

    return build_adapters(llama_model, tmp_path_factory.mktemp("llama-adapters"))


@pytest.fixture(scope="session")
def mtp_model(tmp_path_factory) -> Path:
    """A tiny DeepSeek V3 with one multi-token-prediction layer (speculative decoding's `mtp`)."""
    return tiny_models.build_tiny_model("deepseek_v3", tmp_path_factory.mktemp("deepseek-mtp"), mtp_layers=1)
