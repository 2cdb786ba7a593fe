"""A decode step's layers as one traced call, where attention runs on the GPU's paged kernels.

At batch 1 a decode step on a GPU is host-bound (bench/README.md): the decode chain
(`decode_chain.py`) still makes, for every layer, a compiled call, the K/V writes and the attention
kernel's launch in Python. When every layer's attention takes the paged decode kernel, the whole
step can be one trace instead:

- the kernel's launch depends on the step's host values only through the number of requests and
  the longest context. The trace plans for a context rounded up to a power-of-two number of blocks
  (the block tables are padded to it with the null block) and reads each request's real length
  from `seq_lens` on the device; the partitions past it are empty. So the plan follows from the
  inputs' shapes: one trace per (batch size, table width), the most recently used kept;
- the pool's arrays go in as inputs and come back as outputs; once the runner holds the outputs
  nothing else references the inputs, so MLX still writes them in place.

A trace is kept only if every attention call in it took the decode kernel: anything else (the
CPU backend, a recurrent layer, MLA's latent attention, a shape the kernel does not take) depends on
host values a trace would freeze, and those stages stay on the decode chain.
"""

import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn

from metal_cluster import kernels
from metal_cluster.kernels import AttentionMetadata
from metal_cluster.stage_worker.model import fuse
from metal_cluster.stage_worker.step.attention import LayerContext, PagedAttention
from metal_cluster.stage_worker.step.batch import GroupTables
from metal_cluster.stage_worker.step.tracing.compiled import CompileSwitch

log = logging.getLogger(__name__)

# METAL_CLUSTER_WHOLE_STEP=0 keeps every decode step on the per-layer chain (the benches' A/B switch).
ENABLED = os.environ.get("METAL_CLUSTER_WHOLE_STEP", "1") != "0"

MIN_BLOCKS = 16  # the smallest block-table width a trace is made for
# Traces kept, the most recently used: each (batch size, table widths) is one whole-model trace, and
# MLX searches a compiled function's traces one by one, so each key gets a function of its own.
MAX_TRACES = 64


def table_width(blocks: int) -> int:
    """The block-table width a step with `blocks` columns runs at: the next power of two."""
    width = MIN_BLOCKS
    while width < blocks:
        width *= 2
    return width


class WholeStep:
    """Decode steps of one stage's layers as one mx.compile trace (see the module's doc)."""

    def __init__(self, layers: list[nn.Module], mixers: list, switch: CompileSwitch):
        """`mixers`: each layer's split token mixer (`compiled.split_mixer`), as the chain found them."""
        self.layers, self.switch = layers, switch
        # Attention that hands the kernel the step's metadata as the trace builds it: PagedAttention's.
        # MLA's latent attention (families/deepseek_v3.py) re-plans its decodes from host values.
        plain = all(isinstance(m, PagedAttention) for m in mixers)
        self.usable: bool | None = None if ENABLED and plain else False  # None until the first trace says
        self.layers_changed = None  # the switch's count the traces were made at
        self.traces: OrderedDict[tuple, Callable] = OrderedDict()  # (batch size, widths) -> compiled step
        self._template = None  # (batch, pool) the trace being made copies what it does not take as input
        self._routes: list | None = None  # the attention routes of the trace MLX is making, while it does

    def applies(self, batch, pool) -> bool:
        """Whether this step can take the trace: one token a request, a GPU with the paged kernels,
        attention only (no recurrent state), and no trace found unusable before."""
        return (self.usable is not False and kernels.gpu_backend() is not None and not any(pool.is_state)
                and all(t.state is None and batch.positions.shape[0] == len(t.attn.seq_lens_host) for t in batch.groups))

    def run(self, h: mx.array, batch, pool) -> mx.array | None:
        """h [1, B, hidden] through every layer in one call; None if the trace is unusable (the
        caller then runs the chain)."""
        flat, widths = [], []
        for tables in batch.groups:
            meta = tables.attn
            have = meta.block_tables.shape[1]
            width = table_width(max(have, -(-max(meta.seq_lens_host) // pool.block_size)))
            padded = meta.block_tables if width == have else mx.pad(meta.block_tables, [(0, 0), (0, width - have)])
            flat += [tables.slot_mapping, meta.cu_seqlens_q, meta.seq_lens, padded]
            widths.append(width)
        compiled = self._compiled((batch.positions.shape[0], *widths))
        self._template, self._routes = (batch, pool), None
        try:
            out = compiled(h, batch.positions, *flat, *_arrays(pool))
        except Exception as e:  # a layer that needs host values a trace cannot hold
            log.warning("decode steps stay on the per-layer chain: one trace of the whole step failed (%s: %s)",
                        type(e).__name__, e)
            self.usable = False
            self.traces.clear()
            return None
        finally:
            self._template = None
        if self._routes is not None:  # MLX made a trace this call: kept only if every attention took the kernel
            self.usable = bool(self._routes) and all(r == "kernel" for r in self._routes)
            if not self.usable:
                log.warning("decode steps stay on the per-layer chain: attention in the whole step's trace did not "
                            "take the paged decode kernel")
        if not self.usable:
            self.usable = False
            self.traces.clear()
            return None
        pool.keys[:], pool.values[:] = _unflat(pool, out[1:])  # the same lists: holders see the new arrays
        return out[0]

    def _compiled(self, key: tuple) -> Callable:
        """The compiled step for one (batch size, widths), made on first use; the least recently used
        goes past MAX_TRACES, and all go when the layers' modules change."""
        if self.layers_changed != self.switch.layers_changed:
            self.traces.clear()
            self.layers_changed = self.switch.layers_changed
        compiled = self.traces.get(key)
        if compiled is None:
            compiled = self.traces[key] = mx.compile(self._traced)
            while len(self.traces) > MAX_TRACES:
                self.traces.popitem(last=False)
        else:
            self.traces.move_to_end(key)
        return compiled

    def _traced(self, h, positions, *arrays):
        """Runs only while MLX traces: each layer as it is, on a batch and pool made of the inputs."""
        batch, pool = self._template
        n = len(batch.groups)
        groups = []
        for g in range(n):
            slots, cu_seqlens_q, seq_lens, tables = arrays[4 * g: 4 * g + 4]
            num_reqs, width = tables.shape
            # The plan's host view of the step: every request at the bucket's full context.
            meta = AttentionMetadata(cu_seqlens_q, seq_lens, tables, pool.block_size,
                                     query_lens_host=[1] * num_reqs, seq_lens_host=[width * pool.block_size] * num_reqs)
            groups.append(GroupTables(slots, meta))
        shadow_batch = replace(batch, positions=positions, groups=groups)
        keys, values = _unflat(pool, arrays[4 * n:])
        shadow_pool = replace(pool, keys=keys, values=values, _indices={})
        h = fuse.run_layers(self.layers, h, lambda i: LayerContext(shadow_batch, shadow_pool, i))
        self._routes = [r for t in groups for r in t.attn.__dict__.get("_paged_attention_routes", {}).values()]
        return (h, *_arrays(shadow_pool))


def _arrays(pool) -> list[mx.array]:
    """The pool's arrays in the trace's order: keys, then values (a shared_kv layer has none)."""
    return pool.keys + [v for v in pool.values if v is not None]


def _unflat(pool, arrays) -> tuple[list, list]:
    """`_arrays`' inverse: keys and values lists shaped as `pool`'s, holding `arrays`."""
    it = iter(arrays)
    keys = [next(it) for _ in pool.keys]
    return keys, [None if v is None else next(it) for v in pool.values]
