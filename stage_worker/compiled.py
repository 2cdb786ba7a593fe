"""mx.compile for the pure parts of a decode step.

At batch 1 a decode step is host-bound on a GPU: building its graph op by op in Python and MLX
encoding each op take longer than the device's work (bench/README.md, "Where batch-1 time goes").
The parts of a layer that are pure functions of their inputs — the projections, norms and RoPE
before attention, the MLP after it — are compiled, so MLX replays a traced graph with its
elementwise ops fused. Attention and the KV writes stay outside: their launch shapes depend on the
step's metadata, host values a trace would freeze.

MLX keeps a trace per input shape, so only steps whose shapes recur take the compiled path: pure
decode batches (one token per request; batch sizes recur). Prompt chunks, whose lengths vary,
speculative verification, and steps with LoRA adapters (the adapted modules read the step's slots,
which a trace would freeze) run the same modules directly.
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass
class CompileSwitch:
    """Whether the step being built takes the compiled path; the runner sets it per step."""

    on: bool = False


class CompiledWhenOn(nn.Module):
    """A module called through mx.compile while its switch is on, directly otherwise."""

    def __init__(self, inner: nn.Module, switch: CompileSwitch):
        super().__init__()
        self.inner = inner
        # Plain attributes, not entries of the module tree.
        object.__setattr__(self, "switch", switch)
        object.__setattr__(self, "_compiled", mx.compile(inner))

    def __call__(self, x: mx.array) -> mx.array:
        return self._compiled(x) if self.switch.on else self.inner(x)


def attach(layer: nn.Module, switch: CompileSwitch) -> None:
    """Give one wrapped decoder layer's compilable parts the stage's switch: its MLP (or experts)
    and its paged attention's projections (`PagedAttention.switch`)."""
    from metal_cluster.stage_worker.attention import PagedAttention

    if "mlp" in layer and not isinstance(layer.mlp, CompiledWhenOn):
        layer.mlp = CompiledWhenOn(layer.mlp, switch)
    for _, module in layer.named_modules():
        if isinstance(module, PagedAttention):
            object.__setattr__(module, "switch", switch)
