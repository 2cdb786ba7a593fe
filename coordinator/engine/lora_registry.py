"""The executor's LoRA adapters: what vLLM's add_lora / remove_lora / pin_lora / list_loras see.

An adapter is read once (lora_adapters.py) and each stage gets its own layers' part. The stages keep
up to --max-cpu-loras adapters on their hosts, evicting the least recently used one that no running
request uses and that is not pinned; --max-loras of them are resident in a step's stacks (the stages
swap them by LRU). A request naming an adapter the stages no longer hold (evicted, or resolved by a
vLLM LoRA resolver) has it loaded again from its path first, as vLLM's own workers do; where that
path no longer holds it, the request ends with a 400 naming why (vLLM's own workers stop the engine).
"""

import logging
from collections import OrderedDict

from metal_cluster.coordinator.engine.lora_adapters import LoRAAdapter, LoRAAdapterError, read_adapter

log = logging.getLogger("vllm.metal_cluster.lora")


class LoRARegistry:
    def __init__(self, model_folder: str, max_loras: int, max_rank: int, max_cpu_loras: int):
        self.model_folder = model_folder
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self.pinned: set[int] = set()
        self.users: dict[str, int] = {}  # running request -> its adapter

    def add(self, lora_request, pipeline, ranges) -> bool:
        adapter = read_adapter(lora_request.lora_path, lora_request.lora_name, self.model_folder, self.max_rank)
        pipeline.lora_add(adapter, lora_request.lora_int_id, self.max_loras, self.max_rank, ranges)
        self.adapters[lora_request.lora_int_id] = adapter
        self.adapters.move_to_end(lora_request.lora_int_id)
        log.info("LoRA adapter '%s' (id %d, rank %d, %d modules) on %d stage(s)", adapter.name,
                 lora_request.lora_int_id, adapter.rank, len(adapter.weights), len(ranges))
        self._evict(pipeline, keep=lora_request.lora_int_id)
        return True

    def remove(self, lora_id: int, pipeline) -> bool:
        if self.adapters.pop(lora_id, None) is None:
            return False
        self.pinned.discard(lora_id)
        pipeline.lora_remove(lora_id)
        return True

    def pin(self, lora_id: int) -> bool:
        if lora_id not in self.adapters:
            return False
        self.pinned.add(lora_id)
        return True

    def ids(self) -> set[int]:
        return set(self.adapters)

    def admit(self, so, pipeline, ranges) -> dict[str, str]:
        """Before a step goes out: its new requests' adapters on the stages, and who uses which.
        Returns the requests whose adapter cannot be read again (evicted, and its folder changed or
        gone since), each with why: they must not run, and the others are not held up by them."""
        self.finish(so.finished_req_ids)
        unreadable = {}
        for new in so.scheduled_new_reqs:
            lora = new.lora_request
            if lora is None:
                continue
            if lora.lora_int_id in self.adapters:
                self.adapters.move_to_end(lora.lora_int_id)
            else:
                try:
                    self.add(lora, pipeline, ranges)
                except LoRAAdapterError as e:
                    log.warning("LoRA adapter '%s' (id %d) cannot be read again for request %s: %s",
                                lora.lora_name, lora.lora_int_id, new.req_id, e)
                    unreadable[new.req_id] = (
                        f"{e} (it was evicted from the stages, --max-cpu-loras {self.max_cpu_loras}, and is "
                        "read again at its next use: put its folder back, or /v1/unload_lora_adapter it and "
                        "/v1/load_lora_adapter it from where it is now)")
                    continue
            self.users[new.req_id] = lora.lora_int_id
        return unreadable

    def finish(self, req_ids) -> None:
        for req_id in req_ids:
            self.users.pop(req_id, None)

    def resend(self, pipeline, ranges) -> None:
        """A new plan's stages know no adapter: give them all again."""
        for lora_id, adapter in self.adapters.items():
            pipeline.lora_add(adapter, lora_id, self.max_loras, self.max_rank, ranges)

    def _evict(self, pipeline, keep: int) -> None:
        in_use = set(self.users.values()) | {keep}
        while len(self.adapters) > self.max_cpu_loras:
            victim = next((i for i in self.adapters if i not in self.pinned and i not in in_use), None)
            if victim is None:
                log.warning("LoRA: %d adapters held, over --max-cpu-loras %d: the others are pinned or in use",
                            len(self.adapters), self.max_cpu_loras)
                return
            log.info("LoRA adapter '%s' (id %d) evicted from the stages (--max-cpu-loras %d)",
                     self.adapters[victim].name, victim, self.max_cpu_loras)
            self.remove(victim, pipeline)
