"""The compiled decode step: one traced call per layer, plus what no trace can hold.

A decode step through layers whose mixers are split (`compiled.SplitMixer`) runs, per layer i:

    middle_i (outside: KV writes and attention, or the recurrence and its state writes)
    seam_i   (one trace: the rest of layer i's block — mixer output, residual, norm, MLP, residual —
              then layer i+1's norm and its mixer's `before`)

with a `head` trace for the first split layer's `before` and a `tail` trace for the last's rest.
The blocks are mlx-lm's own, called while their mixer answers for one part (`SplitMixer.phase`):
a trace holds exactly the block's math, and the ops it does not need are dropped from it. A layer
whose mixer is not split runs whole, as outside the compiled path (its MLP compiled). Everything a
trace reads from the step (positions, the states a mixer `reads`, LoRA's slots) is one of its
inputs, so the traces hold no step's values; MLX keeps one per input shape (batch size).
"""

import mlx.core as mx
import mlx.nn as nn

from metal_cluster.stage_worker.model import fuse
from metal_cluster.stage_worker.step.attention import LayerContext
from metal_cluster.stage_worker.step.tracing.compiled import CompileSwitch, SplitMixer, Traced, split_mixer
from metal_cluster.stage_worker.step.tracing.whole_step import WholeStep


class DecodeChain:
    def __init__(self, layers: list[nn.Module], switch: CompileSwitch):
        self.layers, self.switch = layers, switch
        self.mixers: list[SplitMixer | None] = [split_mixer(layer) for layer in layers]
        n = len(layers)
        self.heads = [Traced(self._traced(self._head, i), self) for i in range(n)]
        self.seams = [Traced(self._traced(self._seam, i), self) for i in range(n)]
        self.tails = [Traced(self._traced(self._tail, i), self) for i in range(n)]
        self.counts = (0, 0)  # (parts from the middle, arrays the next mixer reads) of the call being traced
        self.whole = WholeStep(layers, self.mixers, switch)  # on a GPU: the whole step as one trace, where it applies

    def run(self, h: mx.array, batch, pool, compiled: bool, inputs: tuple = ()) -> mx.array:
        """h [1, T, hidden] through every layer: through the traces when `compiled` (a step whose
        shapes recur), else each block as it is. `inputs`: the step state the traces read (LoRA's)."""
        if compiled and not inputs and self.whole.applies(batch, pool):
            out = self.whole.run(h, batch, pool)
            if out is not None:
                return out
        self.switch.on, self.switch.inputs = compiled, inputs
        try:
            if compiled:
                return self(h, batch, pool)
            return fuse.run_layers(self.layers, h, lambda i: LayerContext(batch, pool, i))
        finally:
            self.switch.on, self.switch.inputs = False, ()

    def __call__(self, h: mx.array, batch, pool) -> mx.array:
        """h [1, T, hidden] through every layer; the switch is on."""
        parts, n = None, len(self.layers)
        contexts = [LayerContext(batch, pool, i) for i in range(n)]
        for i, (layer, mixer, cache) in enumerate(zip(self.layers, self.mixers, contexts)):
            if mixer is None:
                h = layer(h, None, cache)
                continue
            if parts is None:
                parts = self.heads[i](h, batch.positions, *mixer.reads(cache))
            middle = tuple(mixer.middle(tuple(parts), cache))
            following = self.mixers[i + 1] if i + 1 < n else None
            if following is None:
                self.counts = (len(middle), 0)
                h, parts = self.tails[i](h, *middle)[0], None
                continue
            reads = following.reads(contexts[i + 1])
            self.counts = (len(middle), len(reads))
            h, *parts = self.seams[i](h, *middle, batch.positions, *reads)
        return h

    # --- what the traces run (once per input shape) ----------------------------------------------
    def _traced(self, fn, i):
        def run(*args):
            # The block's own compiled parts (CompiledWhenOn) run inline: this trace is the compiled call.
            on, self.switch.on = self.switch.on, False
            try:
                return fn(i, *args)
            finally:
                self.switch.on = on
        return run

    def _head(self, i, x, positions, *reads):
        return self._before(i, x, positions, reads)

    def _seam(self, i, x, *args):
        n_middle, n_reads = self.counts
        middle, positions, reads = args[:n_middle], args[n_middle], args[n_middle + 1:]
        h = self._after(i, x, middle)
        return (h, *self._before(i + 1, h, positions, reads))

    def _tail(self, i, x, *middle):
        return (self._after(i, x, middle),)

    def _before(self, i, x, positions, reads) -> tuple:
        """Layer i's block up to its mixer: the mixer's `before` parts."""
        mixer = self.mixers[i]
        object.__setattr__(mixer, "phase", ("capture", (positions, tuple(reads))))
        try:
            self.layers[i](x, None, None)
            return tuple(mixer.phase[1])
        finally:
            object.__setattr__(mixer, "phase", None)

    def _after(self, i, x, middle) -> mx.array:
        """Layer i's block with its mixer's output made of `middle`: the layer's output."""
        mixer = self.mixers[i]
        object.__setattr__(mixer, "phase", ("inject", tuple(middle)))
        try:
            return self.layers[i](x, None, None)
        finally:
            object.__setattr__(mixer, "phase", None)
