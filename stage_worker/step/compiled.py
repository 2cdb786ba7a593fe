"""mx.compile for the pure parts of a decode step.

At batch 1 a decode step is host-bound on a GPU: building its graph op by op in Python and MLX
encoding each op take longer than the device's work (bench/README.md, "Where batch-1 time goes").
The parts of a layer that are pure functions of their inputs — the projections, norms and RoPE
before attention, the o_proj after it, the MLP — are compiled, so MLX replays a traced graph with
its elementwise ops fused. Attention and the KV writes stay outside: their launch shapes depend on
the step's metadata, host values a trace would freeze.

MLX keeps a trace per input shape, so only steps whose shapes recur take the compiled path: pure
decode batches (one token per request; batch sizes recur). Prompt chunks, whose lengths vary, and
speculative verification run the same modules directly. What the traced modules read from shared
step state (LoRA's per-token slots) goes into each compiled call as an input, so no trace freezes
it; what they capture as constants (LoRA's stacked adapters) bumps the switch's generation when it
changes, and the traces are rebuilt.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn


@dataclass
class CompileSwitch:
    """The compiled path's settings for the step being built; the runner sets them per step."""

    on: bool = False
    # Step state the traced modules read (LoRA's slots): handed to every compiled call as inputs;
    # `bind(inputs)` puts them where those modules look and returns what was there.
    inputs: tuple = ()
    bind: Callable[[tuple], tuple] = field(default=lambda inputs: ())
    generation: int = 0  # bumped when constants the traces captured change


class Traced:
    """`fn(*args)` through mx.compile while its owner's switch is on, directly otherwise."""

    def __init__(self, fn: Callable, owner):
        self.fn, self.owner = fn, owner
        self.generation, self.compiled, self.arity = None, None, 0

    def __call__(self, *args):
        switch = self.owner.switch
        if not switch.on:
            return self.fn(*args)
        if self.generation != switch.generation:
            self.compiled, self.generation = mx.compile(self._with_inputs), switch.generation
        self.arity = len(args)
        return self.compiled(*args, *switch.inputs)

    def _with_inputs(self, *arrays):
        # Runs only while MLX traces: the traced inputs stand in for the step state, then it goes back.
        switch = self.owner.switch
        previous = switch.bind(arrays[self.arity:])
        try:
            return self.fn(*arrays[: self.arity])
        finally:
            switch.bind(previous)


class CompiledWhenOn(nn.Module):
    """A module called through `Traced` (the MLP, or the experts)."""

    def __init__(self, inner: nn.Module, switch: CompileSwitch):
        super().__init__()
        self.inner = inner
        # Plain attributes, not entries of the module tree.
        object.__setattr__(self, "switch", switch)
        object.__setattr__(self, "traced", Traced(inner, self))

    def __call__(self, x: mx.array) -> mx.array:
        return self.traced(x)


def attach(layer: nn.Module, switch: CompileSwitch) -> None:
    """Give one wrapped decoder layer's compilable parts the stage's switch: its MLP (or experts)
    and its paged attention's projections (`PagedAttention.switch`)."""
    from metal_cluster.stage_worker.step.attention import PagedAttention

    if "mlp" in layer and not isinstance(layer.mlp, CompiledWhenOn):
        layer.mlp = CompiledWhenOn(layer.mlp, switch)
    for _, module in layer.named_modules():
        if isinstance(module, PagedAttention):
            object.__setattr__(module, "switch", switch)
