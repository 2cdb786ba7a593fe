"""A stage's step phases (Health's step_phases and step_marks): every part of a step is there, in
order, and they add up to the step; the tokens are the same whether or not anyone looks."""

import json

import pytest

from metal_cluster.proto import PROTO_VERSION, pb
from metal_cluster.stage_worker.host import StageHost
from scheduler_double import SchedulerDouble

BLOCK_SIZE = 8
NUM_BLOCKS = 32
PARTS = ["queue", "prepare", "build", "device", "resolve", "answer"]


@pytest.fixture(scope="module")
def host(llama_model):
    layers = json.loads((llama_model / "config.json").read_text())["num_hidden_layers"]
    host = StageHost()
    host.assign(pb.AssignRequest(version=PROTO_VERSION, model=str(llama_model), layer_start=0, layer_end=layers,
                                 block_size=BLOCK_SIZE, max_num_batched_tokens=32, memory_utilization=0.05))
    host.start(pb.StartRequest(version=PROTO_VERSION, num_blocks=NUM_BLOCKS, world_size=1))
    return host


def decode(host, ahead: bool) -> list[int]:
    next_id = [host.next_step]

    def step_fn(step):
        step.step_id, next_id[0] = next_id[0], next_id[0] + 1
        answer = host.launch(step) if ahead else None
        if ahead:
            return lambda: {s.req_id: s.token_id for s in answer().sampled}
        return {s.req_id: s.token_id for s in host.step(step).sampled}

    sched = SchedulerDouble(step_fn, NUM_BLOCKS, BLOCK_SIZE, ahead=ahead)
    sched.add("r", [5, 9, 13, 2, 7], 8)
    while not sched.reqs["r"].done:
        sched.step()
    return sched.reqs["r"].output


def test_phases_cover_the_step_in_order(host):
    host.phases.clear()
    sync_tokens = decode(host, ahead=False)
    health = host.health()
    phases, marks = dict(health.step_phases), dict(health.step_marks)
    assert set(PARTS + ["step"]) <= set(phases), phases
    assert all(v >= 0 for v in phases.values())
    # The last step's marks: when it arrived, then each part's end, in the order the parts run.
    ends = [marks["entered"]] + [marks[p] for p in PARTS]
    assert ends == sorted(ends)
    assert sum(phases[p] for p in PARTS) <= 1.5 * phases["step"] + 1e-3
    # One step ahead (the stage keeps its tokens): the same parts, the same tokens.
    assert decode(host, ahead=True) == sync_tokens
    assert set(PARTS) <= set(host.health().step_phases)
