"""Where a re-plan's time goes, step by step, without vLLM in the way.

Starts 3 local stage workers the way `serve -pp 3` does, places SmolLM2 over them (replan.build, as
the executor does), runs one step, SIGKILLs the middle worker and then times the executor's heal
path piece by piece: probe who answers, reset the survivors (their processes come back idle),
place, assign (load + warm-up, per stage as the worker reports it), start (ring + KV pool), and
the first step on the new plan. The workers log to stderr. (Placement cost is computed in each
re-plan here; the executor keeps it from its first plan.)

  .venv/bin/python bench/replan_profile.py [--repeat 3] 2>workers.log
"""

import argparse
import os
import platform
import signal
import statistics
import time

from metal_cluster.coordinator.cluster import local_workers, replan
from metal_cluster.coordinator.cluster.stages import RemoteStage
from metal_cluster.proto import PROTO_VERSION, pb
from metal_cluster.stage_worker.families import family_of
from metal_cluster.stage_worker.model.model_source import resolve_model

BLOCK_SIZE = 16
NUM_BLOCKS = 1025  # what vLLM arrives at for `bench/faults.py`'s server (3 stages, 0.5 utilization)


def settings(source, activation_known=None) -> replan.Settings:
    config = source.config
    return replan.Settings(model=str(source.folder), config=config, block_size=BLOCK_SIZE, max_num_batched_tokens=256,
                           utilization=0.5, max_model_len=1024, num_blocks=NUM_BLOCKS, ring_timeout_s=60,
                           caches=family_of(config, source.folder / "config.json").layer_caches(config),
                           activation_known=activation_known or {})


def one_step(pipeline, step_id: int, req_id: str) -> float:
    began = time.perf_counter()
    step = pb.StepRequest(version=PROTO_VERSION, step_id=step_id)
    step.new_requests.append(pb.NewRequest(req_id=req_id, prompt_token_ids=list(range(1, 33)),
                                           block_ids=[1, 2, 3]))
    step.scheduled.append(pb.ScheduledTokens(req_id=req_id, num_tokens=32))
    pipeline.submit(step).result(timeout=120)
    return time.perf_counter() - began


def one_replan(workers, source) -> dict:
    stages = [RemoteStage(w.address) for w in workers]
    healths = [s.wait_ready(time.monotonic() + 60) for s in stages]
    plan = replan.build(stages, healths, settings(source))
    one_step(plan.pipeline, 0, "before")
    peak = replan.measured_peak(plan.pipeline.stages, plan.assigned, {})
    victim = workers[1]
    clock = {"hit": time.monotonic()}
    os.kill(victim.pid, signal.SIGKILL)
    plan.pipeline.close()
    candidates = [RemoteStage(w.address) for w in workers]
    alive, _ = replan.answering(candidates, timeout_s=2.0)
    clock["probe"] = time.monotonic()
    kept, healths = replan.reset_all(alive, "profile", time.monotonic() + replan.RESET_TIMEOUT_S)
    clock["restart"] = time.monotonic()
    known = replan.activation_known([w.address for w in workers], peak)  # as the executor passes it
    plan = replan.build(kept, healths, settings(source, known), say=lambda line: None)
    clock["load and start"] = time.monotonic()
    timings = [(r.load_seconds, r.warm_up_seconds) for r in plan.assigned]
    clock["first step"] = clock["load and start"] + one_step(plan.pipeline, 0, "after")
    plan.pipeline.close()
    keys = list(clock)
    out = {k: clock[k] - clock[p] for p, k in zip(keys, keys[1:])}
    for part, seconds in plan.seconds.items():
        out[f"  {part}"] = seconds
    out["load (max over stages)"] = max(t[0] for t in timings)
    out["warm-up (max over stages)"] = max(t[1] for t in timings)
    out["serving again"] = clock["load and start"] - clock["hit"]
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    source = resolve_model(None)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M')}; "
          f"load average {os.getloadavg()[0]:.2f}; 3 local stages -> 2, {source.folder.name}")
    runs = []
    for _ in range(args.repeat):
        with local_workers.started(3) as workers:
            runs.append(one_replan(workers, source))
        print("  " + ", ".join(f"{k} {v:.2f}" for k, v in runs[-1].items()), flush=True)
    print("| part | median (s) |")
    print("|---|---:|")
    for key in runs[0]:
        print(f"| {key} | {statistics.median(r[key] for r in runs):.2f} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
