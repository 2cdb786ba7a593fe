"""Which host runs which layers.

Stages go in ring order: the coordinator's own host first (it holds the embedding), then wired
hosts before Wi-Fi ones, larger memory first. Each host takes layers in proportion to what it can
hold at the requested memory share: per layer its weights plus that layer's KV for `kv_tokens`
tokens, never weights alone, after the fixed costs of its position (embedding, head, activations).
"""

import math
from dataclasses import dataclass

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
    num_layers: int
    layer_bytes: int
    embed_bytes: int  # first stage only
    head_bytes: int  # last stage only: norm + lm_head (the embedding again when tied)
    kv_bytes_per_token_per_layer: int
    activation_bytes: int = 0  # reserve on every stage

    @classmethod
    def from_config(cls, config: dict, on_gpu: bool = False, activation_bytes: int = 256 * 2**20):
        """Estimated from config.json alone. On GPUs (`on_gpu`: every host of the plan) weights cost
        what the checkpoint stores and KV its dtype; on a CPU everything is float32 (DESIGN.md)."""
        bytes_per_param, kv_bytes = (param_bytes(config), half_or_float32(config)) if on_gpu else (4, 4)
        hidden, inter = config["hidden_size"], config["intermediate_size"]
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
        layer = attention + 3 * hidden * inter + 2 * hidden
        embed = config["vocab_size"] * hidden
        return cls(
            num_layers=config["num_hidden_layers"],
            layer_bytes=int(layer * bytes_per_param),
            embed_bytes=int(embed * bytes_per_param),
            head_bytes=int((embed + hidden) * bytes_per_param),
            kv_bytes_per_token_per_layer=kv_values_per_token_per_layer(config) * kv_bytes,
            activation_bytes=activation_bytes,
        )


def kv_values_per_token_per_layer(config: dict) -> int:
    """Values a token keeps in the paged pool of its largest layer, as its family lays the layers out
    (an MLA layer keeps one latent entry, far less than GQA arithmetic on its heads would say). A
    config of no known family counts K and V of its attention heads."""
    from metal_cluster.stage_worker.families import REGISTRY, Family  # imports MLX (not its device)

    family = REGISTRY.get(config.get("model_type")) or Family()
    return max(c.values_per_token for c in family.layer_caches(config))


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
    per_layer = cost.layer_bytes + cost.kv_bytes_per_token_per_layer * kv_tokens
    # The first and last stage carry extra weights; which hosts end up there depends on who is used,
    # so charge them to the first and last host of the ring order and check again at the end.
    capacity = []
    for k, host in enumerate(ordered):
        fixed = cost.activation_bytes + (cost.embed_bytes if k == 0 else 0)
        fixed += cost.head_bytes if k == len(ordered) - 1 else 0
        capacity.append(max(0, int((utilization * host.memory_total - fixed) // per_layer)))
    if sum(capacity) < cost.num_layers:
        raise PlacementError(_shortfall(ordered, capacity, cost, per_layer, utilization, kv_tokens))
    counts = _proportional(capacity, cost.num_layers)
    stages, start = [], 0
    for host, n in zip(ordered, counts):
        if n:
            stages.append(StagePlan(host, start, start + n))
            start += n
    return stages


def _proportional(capacity: list[int], total: int) -> list[int]:
    """Split `total` layers in proportion to capacity, never above it (largest remainders first)."""
    room = sum(capacity)
    shares = [total * c / room for c in capacity]
    counts = [min(c, math.floor(s)) for c, s in zip(capacity, shares)]
    order = sorted(range(len(capacity)), key=lambda i: shares[i] - counts[i], reverse=True)
    while sum(counts) < total:
        for i in order:
            if sum(counts) < total and counts[i] < capacity[i]:
                counts[i] += 1
    return counts


def _shortfall(hosts, capacity, cost, per_layer, utilization, kv_tokens) -> str:
    missing_layers = cost.num_layers - sum(capacity)
    need = missing_layers * per_layer
    biggest = max(hosts, key=lambda h: h.memory_total)
    return (
        f"the model does not fit: {cost.num_layers} layers with KV for {kv_tokens} tokens need "
        f"{per_layer / GIB:.2f} GiB per layer, and {len(hosts)} host(s) at {utilization:.0%} of their memory "
        f"hold only {sum(capacity)}; {biggest.name} (the largest) lacks {need / GIB:.2f} GiB for the other "
        f"{missing_layers} layer(s): add a host, raise --gpu-memory-utilization or lower --max-model-len"
    )
