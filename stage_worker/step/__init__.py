"""The step path: request table, batch packing, the layers' paged attention, sampling, LoRA slots."""
