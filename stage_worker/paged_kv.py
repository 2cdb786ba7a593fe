"""The paged KV pool of one stage: K and V per local layer, [num_blocks, block_size, kv_heads, head_dim],
each layer shaped as its family says (`families.LayerCache`). A layer whose cache is one latent
array (MLA, `shared_kv`) has keys only: its values entry is None.

Block ids are global across the cluster (vLLM allocates them); block 0 is vLLM's null block and is
never written by a real token.
"""

from dataclasses import dataclass

import mlx.core as mx


@dataclass
class KVPool:
    # Stored flat, [num_blocks * block_size, kv_heads, head_dim]: a scatter into an array nothing
    # else references is done in place by MLX; writing through a reshaped view would copy the pool.
    keys: list[mx.array]
    values: list[mx.array | None]  # None for a shared_kv layer
    block_size: int

    @classmethod
    def allocate(cls, caches, num_blocks: int, block_size: int, dtype: mx.Dtype):
        """One K and one V array per entry of `caches` (this stage's layers, in order); K only
        for a shared_kv layer."""
        shapes = [(num_blocks * block_size, c.kv_heads, c.head_dim) for c in caches]
        keys = [mx.zeros(shape, dtype=dtype) for shape in shapes]
        values = [None if c.shared_kv else mx.zeros(shape, dtype=dtype) for c, shape in zip(caches, shapes)]
        mx.eval(keys, [v for v in values if v is not None])
        return cls(keys, values, block_size)

    @property
    def num_blocks(self) -> int:
        return self.keys[0].shape[0] // self.block_size if self.keys else 0

    @property
    def dtype(self) -> mx.Dtype:
        return self.keys[0].dtype if self.keys else mx.float32

    @property
    def arrays(self) -> list[mx.array]:
        """Every array the pool holds."""
        return [a for a in self.keys + self.values if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def layer(self, i: int) -> tuple[mx.array, mx.array | None]:
        """Layer i's K and V as [num_blocks, block_size, kv_heads, head_dim] views (V None: shared_kv)."""
        v = self.values[i]
        return self._blocks(self.keys[i]), None if v is None else self._blocks(v)

    def _blocks(self, flat):
        return flat.reshape(-1, self.block_size, *flat.shape[1:])

    def write(self, layer: int, slots: mx.array, k: mx.array, v: mx.array | None = None) -> None:
        """Store this step's K/V ([T, kv_heads, D]) at flat slots (block * block_size + offset);
        a shared_kv layer takes K only."""
        self.keys[layer][slots] = k.astype(self.keys[layer].dtype)
        if v is not None:
            self.values[layer][slots] = v.astype(self.values[layer].dtype)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        offsets = mx.arange(self.block_size)
        src = (mx.array([s for s, _ in pairs])[:, None] * self.block_size + offsets).reshape(-1)
        dst = (mx.array([d for _, d in pairs])[:, None] * self.block_size + offsets).reshape(-1)
        for pool in self.arrays:
            pool[dst] = pool[src]


def bytes_per_block(caches, block_size: int, dtype: mx.Dtype) -> int:
    """Memory one block id costs on a stage holding the layers of `caches` (K and V, or the one
    latent array of a shared_kv layer)."""
    return sum(block_size * c.values_per_token * dtype.size for c in caches)
