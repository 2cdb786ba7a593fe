"""The paged KV pool of one stage: K and V per local layer, [num_blocks, block_size, kv_heads, head_dim].

Block ids are global across the cluster (vLLM allocates them); block 0 is vLLM's null block and is
never written by a real token.
"""

from dataclasses import dataclass

import mlx.core as mx


@dataclass
class KVPool:
    keys: list[mx.array]
    values: list[mx.array]

    @classmethod
    def allocate(cls, num_layers, num_blocks, block_size, kv_heads, head_dim, dtype=mx.float32):
        shape = (num_blocks, block_size, kv_heads, head_dim)
        keys = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        values = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        mx.eval(keys, values)
        return cls(keys, values)

    @property
    def num_blocks(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def block_size(self) -> int:
        return self.keys[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)

    def write(self, layer: int, slots: mx.array, k: mx.array, v: mx.array) -> None:
        """Store this step's K/V ([T, kv_heads, D]) at flat slots (block * block_size + offset)."""
        self.keys[layer] = _scatter(self.keys[layer], slots, k)
        self.values[layer] = _scatter(self.values[layer], slots, v)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = mx.array([s for s, _ in pairs])
        dst = mx.array([d for _, d in pairs])
        for pools in (self.keys, self.values):
            for i, pool in enumerate(pools):
                pool[dst] = pool[src]
                pools[i] = pool


def _scatter(pool, slots, rows):
    n, bs, h, d = pool.shape
    flat = pool.reshape(n * bs, h, d)
    flat[slots] = rows.astype(pool.dtype)
    return flat.reshape(n, bs, h, d)


def bytes_per_block(num_layers, block_size, kv_heads, head_dim, dtype=mx.float32) -> int:
    """Memory one block id costs on a stage holding num_layers layers (K and V)."""
    return 2 * num_layers * block_size * kv_heads * head_dim * dtype.size
