"""The paged KV pool of one stage: K and V per local layer, [num_blocks, block_size, kv_heads, head_dim],
each layer shaped as its family says (`families.LayerCache`).

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
    values: list[mx.array]
    block_size: int

    @classmethod
    def allocate(cls, caches, num_blocks: int, block_size: int, dtype: mx.Dtype):
        """One K and one V array per entry of `caches` (this stage's layers, in order)."""
        shapes = [(num_blocks * block_size, c.kv_heads, c.head_dim) for c in caches]
        keys = [mx.zeros(shape, dtype=dtype) for shape in shapes]
        values = [mx.zeros(shape, dtype=dtype) for shape in shapes]
        mx.eval(keys, values)
        return cls(keys, values, block_size)

    @property
    def num_blocks(self) -> int:
        return self.keys[0].shape[0] // self.block_size if self.keys else 0

    @property
    def dtype(self) -> mx.Dtype:
        return self.keys[0].dtype if self.keys else mx.float32

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)

    def layer(self, i: int) -> tuple[mx.array, mx.array]:
        """Layer i's K and V as [num_blocks, block_size, kv_heads, head_dim] views."""
        return self._blocks(self.keys[i]), self._blocks(self.values[i])

    def _blocks(self, flat):
        return flat.reshape(-1, self.block_size, *flat.shape[1:])

    def write(self, layer: int, slots: mx.array, k: mx.array, v: mx.array) -> None:
        """Store this step's K/V ([T, kv_heads, D]) at flat slots (block * block_size + offset)."""
        self.keys[layer][slots] = k.astype(self.keys[layer].dtype)
        self.values[layer][slots] = v.astype(self.values[layer].dtype)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        offsets = mx.arange(self.block_size)
        src = (mx.array([s for s, _ in pairs])[:, None] * self.block_size + offsets).reshape(-1)
        dst = (mx.array([d for _, d in pairs])[:, None] * self.block_size + offsets).reshape(-1)
        for pool in self.keys + self.values:
            pool[dst] = pool[src]


def bytes_per_block(caches, block_size: int, dtype: mx.Dtype) -> int:
    """Memory one block id costs on a stage holding the layers of `caches` (K and V)."""
    return sum(2 * block_size * c.kv_heads * c.head_dim * dtype.size for c in caches)
