"""The paged KV pool: its arrays, its layout over KV cache groups, and the memory budget it gets."""
