"""mx.compile for the pure parts of a decode step.

At batch 1 a decode step is host-bound on a GPU: building its graph op by op in Python and MLX
encoding each op take longer than the device's work (bench/README.md, "Where batch-1 time goes").
The parts of a layer that are pure functions of their inputs are compiled, so MLX replays a traced
graph with its elementwise ops fused. A layer whose token mixer is a `SplitMixer` (paged attention,
the Gated DeltaNet) is cut around what is not pure — the pool writes, and attention, whose launch
shapes depend on the step's metadata, host values a trace would freeze — and `decode_chain.py`
traces everything between two such cuts as one call: a layer's mixer output, residuals, norms and
MLP, then the next layer's norm and projections. A layer whose mixer is not split runs its block
as it is, with only its MLP (or experts) compiled (`CompiledWhenOn`).

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
    # Bumped when layers change their modules (fused projections split back for an adapter): what
    # traces that never hold adapter state follow (`whole_step.py`), not every adapter upload.
    layers_changed: int = 0


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


class SplitMixer(nn.Module):
    """A layer's token mixer (what mlx-lm's block calls as self_attn or linear_attn) in three parts:

    - `before(x, positions, *reads) -> parts`: pure (projections, norms, RoPE), traced;
    - `middle(parts, cache) -> parts`: what reads or writes the pool or the step's host metadata
      (KV writes, attention, the recurrence's state writes), never traced;
    - `after(parts) -> r`: pure (o_proj, gates), traced; r is what the block adds to its residual.

    `reads(cache)`: arrays `before` needs from the step besides positions (the pool's states), as
    inputs of the trace. Called directly, the mixer runs the three in order. While `decode_chain`
    traces a block, `phase` makes the call answer for one part only: "capture" keeps `before`'s
    parts and returns zeros (the block's rest is then dead and dropped from the trace), "inject"
    ignores its input and returns `after` of parts computed outside.
    """

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "phase", None)  # (mode, payload) while a block is traced

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        if self.phase is not None:
            mode, payload = self.phase
            if mode == "inject":
                return self.after(payload)
            positions, reads = payload
            object.__setattr__(self, "phase", ("captured", self.before(x, positions, *reads)))
            return mx.zeros_like(x)
        return self.after(self.middle(self.before(x, cache.batch.positions, *self.reads(cache)), cache))

    def reads(self, cache) -> tuple:
        return ()

    def before(self, x: mx.array, positions: mx.array, *reads) -> tuple:
        raise NotImplementedError

    def middle(self, parts: tuple, cache) -> tuple:
        raise NotImplementedError

    def after(self, parts: tuple) -> mx.array:
        raise NotImplementedError


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


def split_mixer(layer: nn.Module) -> SplitMixer | None:
    """The layer's split token mixer, when it has exactly one."""
    found = [m for _, m in layer.named_modules() if isinstance(m, SplitMixer)]
    return found[0] if len(found) == 1 else None


def attach(layer: nn.Module, switch: CompileSwitch) -> None:
    """Give one wrapped decoder layer whose mixer is not split its compiled MLP (or experts); a
    split layer is traced whole by `decode_chain`."""
    if split_mixer(layer) is None and "mlp" in layer and not isinstance(layer.mlp, CompiledWhenOn):
        layer.mlp = CompiledWhenOn(layer.mlp, switch)
