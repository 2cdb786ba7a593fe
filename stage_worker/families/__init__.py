"""Model families as files: how each meets the paged runner. A new family is one module and one
line in FAMILIES; nothing else in the runner knows which family it runs."""

from metal_cluster.stage_worker.errors import ModelLoadError
from metal_cluster.stage_worker.families.base import Family, LayerCache
from metal_cluster.stage_worker.families.deepseek_v3 import DeepseekV3
from metal_cluster.stage_worker.families.dense import Llama, Qwen
from metal_cluster.stage_worker.families.gemma3 import Gemma3
from metal_cluster.stage_worker.families.gpt_oss import GptOss
from metal_cluster.stage_worker.families.moe import Glm4Moe, Mixtral, Qwen3Moe
from metal_cluster.stage_worker.families.qwen3_5 import Qwen3_5
from metal_cluster.stage_worker.families.qwen3_next import Qwen3Next

FAMILIES: tuple[Family, ...] = (Llama(), Qwen(), Qwen3Moe(), Mixtral(), Glm4Moe(), GptOss(), Gemma3(),
                               DeepseekV3(), Qwen3Next(), Qwen3_5())
REGISTRY: dict[str, Family] = {t: f for f in FAMILIES for t in f.model_types}
SUPPORTED_MODEL_TYPES = tuple(REGISTRY)


def family_of(config: dict, where) -> Family:
    """The family of a config.json, or one line saying what is supported."""
    model_type = config.get("model_type")
    family = REGISTRY.get(model_type)
    if family is None:
        raise ModelLoadError(f"{where}: architecture {model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    family.check_weights(config, where)
    return family


__all__ = ["FAMILIES", "Family", "LayerCache", "REGISTRY", "SUPPORTED_MODEL_TYPES", "family_of"]
