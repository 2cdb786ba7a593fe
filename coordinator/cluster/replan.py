"""Re-plan after a lost stage (or when the operator asks): find the stages that still answer, bring
their processes back idle, place the layers over them, load, and start a new ring.

Every wait here is bounded, so a re-plan always ends: serving on a new plan, or an error that says
why the hosts left cannot hold the model.
"""

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from metal_cluster.coordinator.commands import load_progress
from metal_cluster.coordinator.cluster import placement
from metal_cluster.coordinator.cluster.stages import WAIT_POLL_S, DraftAssignment, Pipeline, StageCallError, wire_dtype
from metal_cluster.proto import pb
from metal_cluster.stage_worker.model.dtypes import from_name
from metal_cluster.stage_worker.host import machine_id
from metal_cluster.stage_worker.kv.kv_layout import KVLayout
from metal_cluster.stage_worker.kv.memory import KVBudget, MemoryBudgetError
from metal_cluster.stage_worker.kv.paged_kv import bytes_per_block, request_bytes

RESET_TIMEOUT_S = 60


class ReplanError(RuntimeError):
    """The hosts that are left cannot serve; the message says why and what to do."""


@dataclass
class Settings:
    """What a plan must satisfy, from vLLM's configuration."""

    model: str
    config: dict  # the model's config.json
    block_size: int
    max_num_batched_tokens: int
    utilization: float  # per host
    max_model_len: int
    num_blocks: int  # vLLM's block count; a new plan never holds more
    ring_timeout_s: float
    kv_groups: list[list[int]] = field(default_factory=list)  # vLLM's KV cache groups ([]: one)
    caches: list = field(default_factory=list)  # the family's LayerCache per layer
    # Stage address -> the activation peak known for it from the plan before (stages not listed warm up).
    activation_known: dict[str, int] = field(default_factory=dict)
    # on_gpu -> the model's placement cost: it never changes, so the executor keeps it across re-plans.
    costs: dict = field(default_factory=dict)
    draft: DraftAssignment | None = None  # speculative decoding's draft model, on the last stage


@dataclass
class Plan:
    pipeline: Pipeline
    ranges: list[tuple[int, int]]
    assigned: list[pb.AssignResponse]
    num_blocks: int
    seconds: dict[str, float] = field(default_factory=dict)  # place, load (assign: weights + warm-up), start


def shares_per_host(host_ids: list[str], utilization: float) -> list[float]:
    """--gpu-memory-utilization is per host: stages sharing a machine split its share."""
    return [utilization / host_ids.count(h) for h in host_ids]


def ring_hosts(stages, healths) -> list[str]:
    if len(stages) < 2:
        return []
    return [f"{s.name.rsplit(':', 1)[0]}:{h.ring_port}" for s, h in zip(stages, healths)]


def answering(stages: list, timeout_s: float) -> tuple[list, list[str]]:
    """The stages whose worker answers a health check, and a reason for each one that does not."""
    def probe(stage):
        try:
            stage.health(timeout=timeout_s)
            return None
        except StageCallError as e:
            return str(e)

    with ThreadPoolExecutor(max_workers=max(1, len(stages))) as pool:
        errors = list(pool.map(probe, stages))
    return [s for s, e in zip(stages, errors) if e is None], [e for e in errors if e is not None]


def reset_all(stages: list, reason: str, deadline: float) -> tuple[list, list]:
    """Reset every stage's process and wait for it to come back idle: (stages, healths) that did."""
    def reset(stage):
        try:
            stage.reset(reason)
            return wait_idle(stage, deadline)
        except StageCallError:
            return None

    with ThreadPoolExecutor(max_workers=max(1, len(stages))) as pool:
        healths = list(pool.map(reset, stages))
    kept = [(s, h) for s, h in zip(stages, healths) if h is not None]
    return [s for s, _ in kept], [h for _, h in kept]


def wait_idle(stage, deadline: float):
    while True:
        try:
            health = stage.wait_ready(deadline)
            if health.state == "idle":
                return health
        except StageCallError:
            if time.monotonic() >= deadline:
                raise
        if time.monotonic() >= deadline:
            raise StageCallError(f"stage {stage.name}: not idle {RESET_TIMEOUT_S}s after a reset")
        time.sleep(WAIT_POLL_S)


def model_cost(settings: Settings, on_gpu: bool) -> placement.ModelCost:
    if on_gpu not in settings.costs:
        cost = placement.ModelCost.of_model(settings.model, settings.config, on_gpu=on_gpu)
        draft = settings.draft
        if draft is not None:
            cost = placement.with_drafter(cost, settings.model, settings.config, draft.model or None, draft.mtp, on_gpu)
        settings.costs[on_gpu] = cost
    return settings.costs[on_gpu]


def place(stages: list, healths: list, settings: Settings) -> tuple[list, list, list[tuple[int, int]]]:
    """Stages (and their healths) in ring order, and their layer ranges."""
    num_layers = settings.config["num_hidden_layers"]
    if len(stages) == 1:
        return stages, healths, [(0, num_layers)]
    host_ids = [h.host_id for h in healths]
    here = machine_id()
    hosts = [
        placement.Host(name=h.node_id or s.name, grpc_address=s.name,
                       memory_total=h.host_memory_bytes // host_ids.count(h.host_id), local=h.host_id == here,
                       gpu=h.device.endswith("gpu"))
        for s, h in zip(stages, healths)
    ]
    cost = model_cost(settings, on_gpu=all(h.gpu for h in hosts))
    try:
        stage_plans = placement.plan(hosts, cost, settings.utilization, settings.max_model_len)
    except placement.PlacementError as e:
        raise ReplanError(str(e)) from None
    by_address = {s.name: (s, h) for s, h in zip(stages, healths)}
    ordered = [by_address[p.host.grpc_address] for p in stage_plans]
    return [s for s, _ in ordered], [h for _, h in ordered], [(p.start, p.end) for p in stage_plans]


# A stage's activation peak at a given batch size hardly depends on how many layers it runs (MLX frees
# each layer's intermediates before the next: SmolLM2's 256-token peak is 13.9 MB for 2 layers, 14.3 MB
# for 30), so the previous plan's largest, whose stages between them ran every layer, with a margin
# for a new mix of embedding and head, stands for any range on the same workers.
ACTIVATION_MARGIN = 1.25


def activation_known(addresses: list[str], measured_peak: int) -> dict[str, int]:
    """What a re-plan may take as measured for each worker that ran a plan before: no second warm-up.
    `measured_peak`: the largest activation peak those workers measured (not one passed to them)."""
    return {a: int(measured_peak * ACTIVATION_MARGIN) for a in addresses} if measured_peak > 0 else {}


def measured_peak(stages: list, assigned: list[pb.AssignResponse], known: dict[str, int]) -> int:
    """The largest activation peak that stages measured themselves (those given one did not)."""
    return max((r.activation_bytes for s, r in zip(stages, assigned) if s.name not in known), default=0)


def build(stages: list, healths: list, settings: Settings, say=lambda line: None) -> Plan:
    """Load the layers on idle stages and start them: the new pipeline, ready for steps."""
    if not stages:
        raise ReplanError("no stage worker is left")
    clock = [time.monotonic()]
    stages, healths, ranges = place(stages, healths, settings)
    clock.append(time.monotonic())
    pipeline = Pipeline(stages)
    shares = shares_per_host([h.host_id for h in healths], settings.utilization)
    try:
        with load_progress.reported(stages, say):
            assigned = pipeline.assign(settings.model, ranges, settings.block_size, settings.max_num_batched_tokens,
                                       shares, [settings.activation_known.get(s.name, 0) for s in stages],
                                       settings.draft)
        clock.append(time.monotonic())
        caches = settings.caches
        blocks = []
        for share, r, (a, b) in zip(shares, assigned, ranges):
            dtype = from_name(r.dtype or "float32")
            draft_bytes = r.spec_draft_bytes_per_block * (-(-settings.max_model_len // settings.block_size) + 1)
            KVBudget(share, r.host_memory_bytes, r.weights_bytes, r.activation_bytes).check_fits(
                settings.max_model_len,
                request_bytes(caches[a:b], settings.max_model_len, settings.block_size, dtype) + draft_bytes)
            layout = KVLayout.of_stage(settings.kv_groups, a, b)
            blocks.append(r.kv_budget_bytes // (bytes_per_block(caches[a:b], settings.block_size, dtype, layout)
                                                + r.spec_draft_bytes_per_block))
        num_blocks = min(min(blocks), settings.num_blocks)
        started = pipeline.start(num_blocks, ring_hosts(stages, healths), settings.ring_timeout_s,
                                 wire_dtype([r.dtype for r in assigned]), settings.kv_groups)
        clock.append(time.monotonic())
    except (StageCallError, MemoryBudgetError) as e:
        pipeline.close()
        raise ReplanError(str(e)) from None
    seconds = {k: b - a for k, a, b in zip(("place", "load", "start"), clock, clock[1:])}
    seconds["of which KV allocate"] = max(r.kv_allocate_seconds for r in started)
    return Plan(pipeline, ranges, assigned, num_blocks, seconds)
