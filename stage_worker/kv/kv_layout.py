"""Which block table each of a stage's layers reads, and which pool array it writes.

vLLM's hybrid KV cache manager splits a model whose layers attend differently (Gemma 3's sliding
and global layers, GPT-OSS's) into KV cache groups of equally many layers, each with its own block
table per request: a sliding group's table holds only the blocks of its window, the rest are the
null block 0. All groups draw block ids from one pool, so a block id is in use by at most one
group at a time, and layer j of every group can live in the same array (vLLM lays its tensors out
the same way). A stage therefore needs as many arrays as its largest group has layers here, not
one per layer: that is where the memory a long context saves comes from.

A group of recurrent layers (Gated DeltaNet: vLLM's MambaSpec) keeps a fixed-size state per block
id instead of K/V. vLLM's GPU runner lays a state page and a K/V page over the same bytes; MLX
cannot view one buffer as two shapes and still update it in place, so here the recurrent groups'
layers get arrays of their own, beside the K/V arrays (the executor tells vLLM what a block id
really costs, see executor.kv_memory_for_vllm).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[int, ...]  # per local layer: the KV cache group whose block table it reads
    arrays: tuple[int, ...]  # per local layer: the pool array holding its K (and V)
    # per group: the sliding window of its layers (None: full attention, every block kept)
    windows: tuple[int | None, ...]
    # per group: its layers are recurrent and its block tables vLLM's MambaSpec tables (batch.StateRows)
    recurrent: tuple[bool, ...] = (False,)

    @classmethod
    def one_group(cls, num_layers: int) -> "KVLayout":
        """Every layer in one group, each in its own array: a model with one kind of attention."""
        return cls(tuple([0] * num_layers), tuple(range(num_layers)), (None,))

    @classmethod
    def of_stage(cls, kv_groups: list[list[int]], start: int, end: int, caches=None) -> "KVLayout":
        """The layout of layers [start, end) given vLLM's groups (global layer indices each): the
        k-th of a group's layers on this stage goes to array k. `caches`: the whole model's
        LayerCache per layer, for the groups' windows."""
        if not kv_groups:
            return cls.one_group(end - start)
        windows = tuple(caches[layers[0]].sliding_window if caches else None for layers in kv_groups)
        recurrent = tuple(bool(caches and caches[layers[0]].state_shapes) for layers in kv_groups)
        groups, slots = [None] * (end - start), [None] * (end - start)
        for g, layers in enumerate(kv_groups):
            here = [i for i in layers if start <= i < end]
            for k, i in enumerate(here):
                groups[i - start], slots[i - start] = g, (recurrent[g], k)
        missing = [start + i for i, g in enumerate(groups) if g is None]
        if missing:
            raise ValueError(f"layers {missing} are in no KV cache group")
        # K/V arrays first, then the recurrent layers' own: the k-th layer of each kind shares one.
        index = {slot: a for a, slot in enumerate(sorted(set(slots)))}
        return cls(tuple(groups), tuple(index[slot] for slot in slots), windows, recurrent)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_arrays(self) -> int:
        return max(self.arrays, default=-1) + 1


def layer_groups(layer_names_per_group: list[list[str]]) -> list[list[int]]:
    """vLLM's group layer names (`model.layers.{i}.self_attn.attn`) as global layer indices."""
    return [[int(name.split(".")[2]) for name in names] for names in layer_names_per_group]
