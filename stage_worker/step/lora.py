"""Many LoRA adapters in one batch: each token's delta by its request's adapter slot.

Every adapted linear module of the stage's layers holds stacked A `[S, in, R]` and B `[S, R, out]`
(S = --max-loras + 1 slots, R = --max-lora-rank; slot 0 is zeros: the base model), and adds
`gather_mm(gather_mm(x, A, slot), B, slot)` to its base output. While the slots are narrow
(--max-loras x --max-lora-rank <= DENSE_WIDTH) the same delta is two dense matmuls instead:
`((x @ A_cat) * mask) @ B_cat` over the slots side by side, where the step's mask keeps each token's
own slot's R columns. That is 4 graph ops per module instead of 7, and plain GEMMs: for small models
and batches, where a step's time is mostly per-op overhead, it is the faster form. The stage keeps every adapter it was
given on the host (numpy); a step's adapters are made resident first, the least recently used one
giving up its slot. A step without adapters runs the base modules alone: the same ops as without LoRA.
"""

from collections import OrderedDict
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal_cluster.proto import pb
from metal_cluster.stage_worker.model import fuse
from metal_cluster.stage_worker.step.tracing.compiled import CompileSwitch
from metal_cluster.stage_worker.step.request_table import StepError


class LoRAError(ValueError):
    """An adapter this stage cannot apply (a bad LoRAAdd, or a step naming one it does not hold)."""


@dataclass
class HostAdapter:
    lora_id: int
    name: str
    # (local layer, module) -> (A [in, r], B [r, out]) float32, the scale in B
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]


DENSE_WIDTH = 512  # max_loras * max_rank up to which the slots are applied as dense matmuls


@dataclass
class SlotState:
    """What the wrapped modules read during a step: each token's slot, or None (no adapter runs)."""

    token_slots: mx.array | None = None  # [T] uint32 (gathered form)
    token_mask: mx.array | None = None  # [T, L * R]: 1 on the token's slot's columns (dense form)
    dense: bool = False
    # (layer, module) -> (A [S, in, R], B [S, R, out]) gathered, or (A_cat [in, L*R], B_cat [L*R, out]) dense
    stacks: dict[tuple[int, str], tuple[mx.array, mx.array]] = field(default_factory=dict)


class SlotLoRALinear(nn.Module):
    def __init__(self, base: nn.Module, state: SlotState, key: tuple[int, str]):
        super().__init__()
        self.base = base
        # Plain attributes, not entries of the module tree: they are no parameters of the model.
        object.__setattr__(self, "_state", state)
        object.__setattr__(self, "_key", key)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        slots = self._state.token_slots
        if slots is None:
            return y
        a, b = self._state.stacks[self._key]
        if self._state.dense:  # x is [1, T, in]: the mask [T, L*R] broadcasts over the leading 1
            return y + ((x @ a) * self._state.token_mask) @ b
        rows = x.reshape(-1, 1, x.shape[-1])  # the packed batch: one token per row
        z = mx.gather_mm(mx.gather_mm(rows, a, rhs_indices=slots), b, rhs_indices=slots)
        return y + z.reshape(y.shape)


class LoRABank:
    def __init__(self, layers: list[nn.Module], start: int, dtype: mx.Dtype = mx.float32,
                 switch: CompileSwitch | None = None):
        self.layers, self.start, self.dtype = layers, start, dtype
        # The stage's compiled decode path: a traced module reads the step's slots as inputs of its
        # call (`step_inputs`, `_bind`), and its traces are rebuilt when the stacks change.
        self.switch = switch or CompileSwitch()
        self.switch.bind = self._bind
        self.adapters: dict[int, HostAdapter] = {}
        self.max_loras = self.max_rank = 0
        self.resident: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, least recently used first
        self.host_stacks: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
        self.state = SlotState()

    # --- adapters on the host ---------------------------------------------------------------------
    def add(self, req: pb.LoRAAddRequest) -> None:
        if req.lora_id <= 0:
            raise LoRAError(f"LoRA adapter ids start at 1, got {req.lora_id}")
        if req.max_loras < 1 or req.max_rank < 1:
            raise LoRAError(f"max_loras ({req.max_loras}) and max_rank ({req.max_rank}) must be at least 1")
        if (self.max_loras, self.max_rank) not in ((0, 0), (req.max_loras, req.max_rank)):
            raise LoRAError(f"this stage holds adapters for {self.max_loras} slots of rank {self.max_rank}, "
                            f"not {req.max_loras} of rank {req.max_rank}")
        for local in {t.layer - self.start for t in req.tensors}:
            # An adapter wraps q_proj, gate_proj, ...: a layer loaded fused gets them back.
            if 0 <= local < len(self.layers) and fuse.unfuse_layer(self.layers[local]):
                self.switch.generation += 1
                self.switch.layers_changed += 1
        weights = {}
        for t in req.tensors:
            local = t.layer - self.start
            if not 0 <= local < len(self.layers):
                raise LoRAError(f"adapter {req.name!r}: layer {t.layer} is not on this stage")
            if t.rank > req.max_rank:
                raise LoRAError(f"adapter {req.name!r}: rank {t.rank} is over the maximum {req.max_rank}")
            base = _base_linear(self.layers[local], t.module)
            if base is None:
                raise LoRAError(f"adapter {req.name!r}: layer {t.layer} has no linear module {t.module!r}")
            a = np.frombuffer(t.a, dtype="<f4").reshape(t.input_dims, t.rank)
            b = np.frombuffer(t.b, dtype="<f4").reshape(t.rank, t.output_dims)
            weights[(local, t.module)] = (a, b)
        self.max_loras, self.max_rank = req.max_loras, req.max_rank
        self.state.dense = req.max_loras * req.max_rank <= DENSE_WIDTH
        self.remove(req.lora_id)  # loaded again in place: its slot holds the old weights
        for local, module in weights:
            self._wrap(local, module)
        self.adapters[req.lora_id] = HostAdapter(req.lora_id, req.name, weights)

    def remove(self, lora_id: int) -> bool:
        slot = self.resident.pop(lora_id, None)
        if slot is not None:
            self._fill(slot, None)
        return self.adapters.pop(lora_id, None) is not None

    # --- a step's slots ---------------------------------------------------------------------------
    def slots_for(self, lora_ids: set[int]) -> dict[int, int]:
        """Make this step's adapters resident (LRU eviction of the others): lora id -> slot."""
        lora_ids = {i for i in lora_ids if i}
        for lora_id in lora_ids:
            if lora_id not in self.adapters:
                raise StepError(f"LoRA adapter {lora_id} was never added to this stage")
        if len(lora_ids) > self.max_loras:
            raise StepError(f"a step uses {len(lora_ids)} LoRA adapters, more than the {self.max_loras} slots")
        for lora_id in sorted(lora_ids):
            if lora_id in self.resident:
                self.resident.move_to_end(lora_id)
                continue
            used = set(self.resident.values())
            free = [s for s in range(1, self.max_loras + 1) if s not in used]
            if not free:
                victim = next(i for i in self.resident if i not in lora_ids)
                free = [self.resident.pop(victim)]
            self.resident[lora_id] = free[0]
            self._fill(free[0], self.adapters[lora_id])
        return {i: self.resident[i] for i in lora_ids}

    def activate(self, slots: np.ndarray | None) -> None:
        """Each token's slot for the graph about to be built (None: no adapter in this step)."""
        state = self.state
        if slots is None:
            state.token_slots = state.token_mask = None
            return
        state.token_slots = mx.array(slots.astype(np.uint32))
        if state.dense:
            columns = np.arange(self.max_loras * self.max_rank) // self.max_rank + 1  # the slot of each column
            state.token_mask = mx.array((columns[None, :] == slots[:, None]).astype(np.float32)).astype(self.dtype)

    def step_inputs(self) -> tuple:
        """The step's slots as arrays, for the compiled path (() when no adapter runs)."""
        state = self.state
        if state.token_slots is None:
            return ()
        return (state.token_slots, state.token_mask) if state.dense else (state.token_slots,)

    def _bind(self, inputs: tuple) -> tuple:
        state = self.state
        previous = self.step_inputs()
        state.token_slots = inputs[0] if inputs else None
        state.token_mask = inputs[1] if len(inputs) > 1 else None
        return previous

    # --- helpers ----------------------------------------------------------------------------------
    def _wrap(self, local: int, module: str) -> None:
        key = (local, module)
        if key in self.host_stacks:
            return
        parent, name = _parent(self.layers[local], module)
        base = getattr(parent, name)
        out_dims, in_dims = base.weight.shape
        if isinstance(base, nn.QuantizedLinear):
            in_dims = in_dims * 32 // base.bits
        slots = self.max_loras + 1
        self.host_stacks[key] = (np.zeros((slots, in_dims, self.max_rank), np.float32),
                                 np.zeros((slots, self.max_rank, out_dims), np.float32))
        setattr(parent, name, SlotLoRALinear(base, self.state, key))
        for slot, lora_id in ((s, i) for i, s in self.resident.items()):
            self._fill(slot, self.adapters[lora_id], keys=[key])
        self._upload([key])

    def _fill(self, slot: int, adapter: HostAdapter | None, keys=None) -> None:
        """Slot `slot` of every stack takes `adapter`'s weights (zeros where it does not adapt)."""
        keys = list(self.host_stacks) if keys is None else keys
        for key in keys:
            a_stack, b_stack = self.host_stacks[key]
            a_stack[slot], b_stack[slot] = 0, 0
            pair = adapter.weights.get(key) if adapter else None
            if pair is not None:
                a, b = pair
                a_stack[slot, :, : a.shape[1]] = a
                b_stack[slot, : b.shape[0]] = b
        self._upload(keys)

    def _upload(self, keys) -> None:
        # New device arrays, never written in place: a step still queued keeps the stacks it was built with.
        for key in keys:
            a, b = self.host_stacks[key]
            if self.state.dense:  # slots 1.. side by side: A_cat [in, L*R], B_cat [L*R, out]
                a = a[1:].transpose(1, 0, 2).reshape(a.shape[1], -1)
                b = b[1:].reshape(-1, b.shape[2])
            self.state.stacks[key] = (mx.array(a).astype(self.dtype), mx.array(b).astype(self.dtype))
        self.switch.generation += 1  # the traces captured the stacks they were built with


def _parent(layer: nn.Module, module: str) -> tuple[nn.Module, str]:
    """The module holding `module` ("self_attn.q_proj") inside a layer whose attention may be
    wrapped for the paged pool (its projections then live on `.inner`)."""
    *path, name = module.split(".")
    node = layer
    for part in [*path, name]:
        parent = node if hasattr(node, part) or not hasattr(node, "inner") else node.inner
        node = getattr(parent, part)
    return parent, name


def _base_linear(layer: nn.Module, module: str) -> nn.Module | None:
    try:
        parent, name = _parent(layer, module)
        found = getattr(parent, name)
    except AttributeError:
        return None
    if isinstance(found, SlotLoRALinear):
        found = found.base
    return found if isinstance(found, (nn.Linear, nn.QuantizedLinear)) else None
