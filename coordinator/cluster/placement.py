"""Which host runs which layers.

Stages go in ring order: the coordinator's own host first (it holds the embedding), then wired
hosts before Wi-Fi ones, larger memory first. Each host takes layers in proportion to what it can
hold at the requested memory share: per layer its weights plus that layer's KV for `kv_tokens`
tokens (a recurrent layer: one request's state, whatever the context), never weights alone, after
the fixed costs of its position (embedding, head, activations; on the last, speculative
decoding's drafter).
"""

from dataclasses import dataclass, field, replace
from pathlib import Path

GIB = 2**30


class PlacementError(ValueError):
    """No plan fits; the message names the host and its shortfall."""


@dataclass
class Host:
    name: str
    grpc_address: str  # host:port
    memory_total: int
    wired: bool = True
    local: bool = False
    ring_port: int = 0
    gpu: bool = False  # its stages compute in the model's own dtype (quantized stays quantized)


@dataclass
class ModelCost:
    layer_bytes: list[int]  # weights of each layer as a stage holds them, in global order
    kv_bytes_per_token: list[int]  # each layer's KV per token
    embed_bytes: int  # first stage only
    head_bytes: int  # last stage only: norm + lm_head (the embedding again when tied)
    activation_bytes: int = 0  # reserve on every stage
    state_bytes: list[int] = field(default_factory=list)  # per layer: one request's recurrent state (or 0)
    # Last stage only: speculative decoding's draft model or MTP layer (weights), and its own KV per token.
    drafter_bytes: int = 0
    drafter_kv_bytes_per_token: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    @classmethod
    def uniform(cls, num_layers: int, layer_bytes: int, kv_bytes_per_token_per_layer: int, embed_bytes: int,
                head_bytes: int, activation_bytes: int = 0) -> "ModelCost":
        return cls([layer_bytes] * num_layers, [kv_bytes_per_token_per_layer] * num_layers, embed_bytes,
                   head_bytes, activation_bytes)

    @classmethod
    def of_model(cls, folder, config: dict, on_gpu: bool = False, activation_bytes: int = 256 * 2**20) -> "ModelCost":
        """Weights per layer from the checkpoint's safetensors headers (experts, dense layers and
        quantization as they really are), KV per layer from its family; config arithmetic for GGUF."""
        from metal_cluster.stage_worker.model.checkpoint_sizes import weight_bytes
        from metal_cluster.stage_worker.model.model_source import text_config

        config = text_config(config)
        estimate = cls.from_config(config, on_gpu, activation_bytes)
        measured = weight_bytes(Path(folder), config, float32=not on_gpu) if folder else None
        if measured is None:
            return estimate
        return cls(measured.layers, estimate.kv_bytes_per_token, measured.embed, measured.head, activation_bytes,
                   estimate.state_bytes)

    @classmethod
    def from_config(cls, config: dict, on_gpu: bool = False, activation_bytes: int = 256 * 2**20) -> "ModelCost":
        """Estimated from config.json alone (dense layers). On GPUs (`on_gpu`: every host of the plan)
        weights cost what the checkpoint stores and KV its dtype; on a CPU everything is float32."""
        from metal_cluster.stage_worker.families import REGISTRY, Family
        from metal_cluster.stage_worker.model.model_source import text_config

        config = text_config(config)
        bytes_per_param, kv_bytes = (param_bytes(config), half_or_float32(config)) if on_gpu else (4, 4)
        hidden, inter = config["hidden_size"], _mlp_width(config)
        heads = config["num_attention_heads"]
        kv_heads, head_dim = Family.kv_geometry(config)
        attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
        layer = attention + 3 * hidden * inter + 2 * hidden
        embed = config["vocab_size"] * hidden
        family = REGISTRY.get(config.get("model_type")) or Family()
        # As each layer lays out its pool: an MLA layer keeps one latent entry, far less than GQA
        # arithmetic on its heads would say.
        caches = family.layer_caches(config)
        kv = [c.values_per_token * kv_bytes for c in caches]
        states = [c.block_bytes(0, kv_bytes) if c.state_shapes else 0 for c in caches]
        return cls([int(layer * bytes_per_param)] * config["num_hidden_layers"], kv,
                   embed_bytes=int(embed * bytes_per_param), head_bytes=int((embed + hidden) * bytes_per_param),
                   activation_bytes=activation_bytes, state_bytes=states)


def with_drafter(cost: ModelCost, model_folder, config: dict, draft_folder=None, mtp: bool = False,
                 on_gpu: bool = False) -> ModelCost:
    """`cost` with speculative decoding's drafter on the last stage: a draft model (`draft_folder`,
    run whole beside the last stage's layers) or the checkpoint's first MTP layer (`mtp`), each
    with a KV pool of its own as deep as the target's."""
    from metal_cluster.stage_worker.model.checkpoint_sizes import mtp_layer_bytes
    from metal_cluster.stage_worker.model.model_source import resolve_model, text_config

    if mtp:
        target = text_config(config)
        weights = mtp_layer_bytes(Path(model_folder), target, float32=not on_gpu)
        kv = ModelCost.from_config(target, on_gpu).kv_bytes_per_token[-1]  # the MTP layer's cache is the last layer's
    elif draft_folder:
        source = resolve_model(draft_folder)
        draft = ModelCost.of_model(source.folder, source.config, on_gpu)
        tied = text_config(source.config).get("tie_word_embeddings", False)
        # One stage holds the whole draft: a tied embedding, counted in both ends, is held once.
        weights = sum(draft.layer_bytes) + draft.embed_bytes + draft.head_bytes - (draft.embed_bytes if tied else 0)
        kv = sum(draft.kv_bytes_per_token)
    else:
        return cost
    return replace(cost, drafter_bytes=weights, drafter_kv_bytes_per_token=kv)


def _mlp_width(config: dict) -> int:
    """The intermediate width a layer's MLP weights add up to: a MoE config without a dense
    intermediate_size (Qwen3.5-MoE's) holds all its experts and a shared one."""
    if config.get("intermediate_size"):
        return config["intermediate_size"]
    return (config.get("num_experts", 0) * config.get("moe_intermediate_size", 0)
            + config.get("shared_expert_intermediate_size", 0))


def half_or_float32(config: dict) -> int:
    """Bytes per value of the checkpoint's compute dtype (a quantized one computes in half)."""
    return 2 if config.get("quantization") or config.get("torch_dtype") in ("bfloat16", "float16") else 4


def param_bytes(config: dict) -> float:
    """Bytes a parameter takes as stored: packed bits plus a half-width scale and bias per group
    for mlx-lm's quantized folders, else the checkpoint's dtype."""
    q = config.get("quantization")
    if q:
        return q["bits"] / 8 + 2 * 2 / q["group_size"]
    return half_or_float32(config)


@dataclass
class StagePlan:
    host: Host
    start: int
    end: int


def ring_order(hosts: list[Host]) -> list[Host]:
    return sorted(hosts, key=lambda h: (not h.local, not h.wired, -h.memory_total, h.name))


def plan(hosts: list[Host], cost: ModelCost, utilization: float, kv_tokens: int) -> list[StagePlan]:
    if not hosts:
        raise PlacementError("no hosts to place the model on")
    ordered = ring_order(hosts)
    states = cost.state_bytes or [0] * cost.num_layers
    per_layer = [w + kv * kv_tokens + s for w, kv, s in zip(cost.layer_bytes, cost.kv_bytes_per_token, states)]
    # The first and last stage carry extra weights; which hosts end up there depends on who is used,
    # so charge them to the first and last host of the ring order.
    room = []
    for k, host in enumerate(ordered):
        fixed = cost.activation_bytes + (cost.embed_bytes if k == 0 else 0)
        if k == len(ordered) - 1:
            fixed += cost.head_bytes + cost.drafter_bytes + cost.drafter_kv_bytes_per_token * kv_tokens
        room.append(max(0, int(utilization * host.memory_total - fixed)))
    counts = _contiguous_split(per_layer, room)
    if counts is None:
        raise PlacementError(_shortfall(ordered, room, cost, per_layer, utilization, kv_tokens))
    stages, start = [], 0
    for host, n in zip(ordered, counts):
        if n:
            stages.append(StagePlan(host, start, start + n))
            start += n
    return stages


def _contiguous_split(per_layer: list[int], room: list[int]) -> list[int] | None:
    """Layers per host, in order: each host's share of the model's bytes in proportion to its room,
    never above it. None when the hosts cannot hold every layer."""
    total, capacity = sum(per_layer), sum(room)
    if capacity <= 0:
        return None
    counts, i, done, target = [], 0, 0, 0.0
    for k, r in enumerate(room):
        target += total * r / capacity
        held, n = 0, 0
        last = k == len(room) - 1
        while i < len(per_layer) and held + per_layer[i] <= r:
            # Stop at the boundary nearest this host's cumulative target (the last host takes the rest).
            if not last and done + per_layer[i] / 2 > target:
                break
            held += per_layer[i]
            done += per_layer[i]
            i, n = i + 1, n + 1
        counts.append(n)
    return counts if i == len(per_layer) else _fill(per_layer, room)


def _fill(per_layer: list[int], room: list[int]) -> list[int] | None:
    """Each host as full as it holds, in order: the split of last resort."""
    counts, i = [], 0
    for r in room:
        held, n = 0, 0
        while i < len(per_layer) and held + per_layer[i] <= r:
            held, i, n = held + per_layer[i], i + 1, n + 1
        counts.append(n)
    return counts if i == len(per_layer) else None


def _shortfall(hosts, room, cost, per_layer, utilization, kv_tokens) -> str:
    need = max(sum(per_layer) - sum(room), max(per_layer) - max(room))
    biggest = max(hosts, key=lambda h: h.memory_total)
    drafter = " and the speculative drafter" if cost.drafter_bytes else ""
    return (
        f"the model does not fit: {cost.num_layers} layers with KV for {kv_tokens} tokens need "
        f"{sum(per_layer) / GIB:.2f} GiB ({max(per_layer) / GIB:.2f} GiB for the heaviest layer), and "
        f"{len(hosts)} host(s) at {utilization:.0%} of their memory hold {sum(room) / GIB:.2f} GiB after "
        f"embedding, head, activations{drafter}; {biggest.name} (the largest) lacks at least {max(need, 0) / GIB:.2f} GiB: "
        f"add a host, raise --gpu-memory-utilization or lower --max-model-len"
    )
