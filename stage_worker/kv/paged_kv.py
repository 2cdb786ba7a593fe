"""The paged KV pool of one stage: K and V per local layer, [num_blocks, block_size, kv_heads, head_dim],
each layer shaped as its family says (`families.LayerCache`). A layer whose cache is one latent
array (MLA, `shared_kv`) has keys only: its values entry is None.

Block ids are global across the cluster (vLLM allocates them); block 0 is vLLM's null block and is
never written by a real token. With several KV cache groups, layers of different groups share
arrays (`kv_layout.KVLayout`): the pool holds one array per layout slot, not per layer.
"""

from dataclasses import dataclass, field, replace

import mlx.core as mx

from metal_cluster.stage_worker.kv.kv_layout import KVLayout


@dataclass
class KVPool:
    # Stored flat, [num_blocks * block_size, kv_heads, head_dim]: a scatter into an array nothing
    # else references is done in place by MLX; writing through a reshaped view would copy the pool.
    # A recurrent layer's arrays are its states instead, one row per block id: keys its
    # convolution window, values its recurrent state.
    keys: list[mx.array]  # per array of the layout
    values: list[mx.array | None]  # None for a shared_kv layer
    block_size: int
    layout: KVLayout
    num_blocks: int
    dtype: mx.Dtype
    is_state: list[bool]  # per array of the layout
    # A step's write indices, made once per step and update shape, not per layer (`_index`).
    _indices: dict = field(default_factory=dict, repr=False)

    @classmethod
    def allocate(cls, caches, num_blocks: int, block_size: int, dtype: mx.Dtype, layout: KVLayout | None = None):
        """One K and one V array per array of `layout` (default: one per entry of `caches`, this
        stage's layers in order); K only for a shared_kv layer."""
        layout = layout or KVLayout.one_group(len(caches))
        kinds = array_kinds(caches, layout)
        keys, values = [], []
        for c in kinds:
            if c.state_shapes:
                conv, recurrent = c.state_shapes
                keys.append(mx.zeros((num_blocks, *conv), dtype=dtype))
                values.append(mx.zeros((num_blocks, *recurrent), dtype=mx.float32))
                continue
            shape = (num_blocks * block_size, c.kv_heads, c.head_dim)
            keys.append(mx.zeros(shape, dtype=dtype))
            values.append(None if c.shared_kv else mx.zeros(shape, dtype=dtype))
        mx.eval(keys, [v for v in values if v is not None])
        return cls(keys, values, block_size, layout, num_blocks, dtype, [bool(c.state_shapes) for c in kinds])

    @property
    def arrays(self) -> list[mx.array]:
        """Every array the pool holds."""
        return [a for a in self.keys + self.values if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def state(self, i: int) -> tuple[mx.array, mx.array]:
        """Recurrent layer i's states, [num_blocks, ...] each: convolution window, recurrent state."""
        a = self.layout.arrays[i]
        return self.keys[a], self.values[a]

    def read_state(self, i: int, rows) -> tuple[mx.array, mx.array]:
        """Recurrent layer i's states at block ids `rows` ([B, ...] each; a `StateRows` zeroes
        those of requests starting fresh)."""
        return state_rows(*self.state(i), rows.read, rows.fresh)

    def write_state(self, i: int, rows: mx.array, conv: mx.array, recurrent: mx.array) -> None:
        a = self.layout.arrays[i]
        self.keys[a] = self._put(self.keys[a], rows, conv)
        self.values[a] = self._put(self.values[a], rows, recurrent)

    def layer(self, i: int) -> tuple[mx.array, mx.array | None]:
        """Layer i's K and V as [num_blocks, block_size, kv_heads, head_dim] views (V None: shared_kv)."""
        a = self.layout.arrays[i]
        v = self.values[a]
        return self._blocks(self.keys[a]), None if v is None else self._blocks(v)

    def flat(self, i: int) -> tuple[mx.array, mx.array | None]:
        """Layer i's K and V as stored, [num_blocks * block_size, kv_heads, head_dim]: what the
        paged attention kernels read, with no view to build per layer and step."""
        a = self.layout.arrays[i]
        return self.keys[a], self.values[a]

    def _blocks(self, flat):
        return flat.reshape(-1, self.block_size, *flat.shape[1:])

    def write(self, layer: int, slots: mx.array, k: mx.array, v: mx.array | None = None) -> None:
        """Store this step's K/V ([T, kv_heads, D]) at flat slots (block * block_size + offset);
        a shared_kv layer takes K only."""
        a = self.layout.arrays[layer]
        self.keys[a] = self._put(self.keys[a], slots, k)
        if v is not None:
            self.values[a] = self._put(self.values[a], slots, v)

    def _put(self, pool: mx.array, rows: mx.array, update: mx.array) -> mx.array:
        """`pool` with its rows `rows` replaced by `update`. One ScatterAxis node (done in place,
        since nothing else holds the pool), where `pool[rows] = update` makes up to four (the
        update squeezed, broadcast and reshaped first) in every layer of every step."""
        return mx.put_along_axis(pool, self._index(rows, update.shape), update.astype(pool.dtype), axis=0)

    def _index(self, rows: mx.array, shape: tuple[int, ...]) -> mx.array:
        # Keyed by the rows array itself (held, so its id is not reused): the layers of a step share
        # their group's rows, and a new step brings new arrays.
        entry = self._indices.get(id(rows))
        if entry is None or entry[0] is not rows:
            if len(self._indices) > 8:
                self._indices.clear()
            entry = self._indices[id(rows)] = (rows, {})
        index = entry[1].get(shape)
        if index is None:
            index = entry[1][shape] = mx.broadcast_to(rows.reshape(-1, *[1] * (len(shape) - 1)), shape)
        return index

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        rows_src, rows_dst = mx.array([s for s, _ in pairs]), mx.array([d for _, d in pairs])
        offsets = mx.arange(self.block_size)
        src = (rows_src[:, None] * self.block_size + offsets).reshape(-1)
        dst = (rows_dst[:, None] * self.block_size + offsets).reshape(-1)
        for a, is_state in enumerate(self.is_state):
            for pool in (self.keys[a], self.values[a]):
                if pool is not None:
                    if is_state:
                        pool[rows_dst] = pool[rows_src]
                    else:
                        pool[dst] = pool[src]


def state_rows(conv: mx.array, recurrent: mx.array, read: mx.array, fresh: mx.array) -> tuple[mx.array, mx.array]:
    """Rows `read` of a recurrent layer's state arrays, zeros for the requests starting fresh."""
    return (mx.where(fresh[:, None, None], 0, conv[read]),
            mx.where(fresh[:, None, None, None], 0, recurrent[read]))


def array_kinds(caches, layout: KVLayout) -> list:
    """The LayerCache of each array of `layout`; the layers sharing an array must agree on it."""
    kinds = [None] * layout.num_arrays
    for i, (cache, a) in enumerate(zip(caches, layout.arrays)):
        if kinds[a] is not None and kinds[a] != _shape_of(cache):
            raise ValueError(f"layer {i} ({cache}) cannot share a KV array with a layer shaped {kinds[a]}")
        kinds[a] = _shape_of(cache)
    return kinds


def _shape_of(cache):
    # Sharing an array needs the same entry shape; the window is the block table's business.
    return replace(cache, sliding_window=None)


def bytes_per_block(caches, block_size: int, dtype: mx.Dtype, layout: KVLayout | None = None) -> int:
    """Memory one block id costs on a stage holding the layers of `caches` (K and V, or the one
    latent array of a shared_kv layer), laid out as `layout` says (default: an array per layer)."""
    kinds = array_kinds(caches, layout) if layout else caches
    return sum(c.block_bytes(block_size, dtype.size) for c in kinds)


def blocks_held(cache, num_tokens: int, block_size: int) -> int:
    """Blocks one num_tokens-long request holds in a layer: a recurrent layer one state, a sliding
    layer the blocks its window spans (vLLM frees the rest), any other layer all of them."""
    blocks = -(-num_tokens // block_size)
    if cache.state_shapes:
        return 1
    if cache.sliding_window:
        return min(blocks, -(-(cache.sliding_window - 1) // block_size) + 1)
    return blocks


def request_bytes(caches, num_tokens: int, block_size: int, dtype: mx.Dtype) -> int:
    """The KV one num_tokens-long request holds on a stage with these layers, plus vLLM's null block."""
    return sum((blocks_held(c, num_tokens, block_size) + 1) * c.block_bytes(block_size, dtype.size) for c in caches)
