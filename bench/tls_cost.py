"""What the control plane's mutual TLS adds to a step: the gRPC Step round trip of a decode step,
TLS (stage_worker/net/cluster_tls.py, as the cluster runs it) vs plaintext, to 1 and to 3 stages at once
(the executor sends every step to every stage and waits for all), on loopback.

The stages here answer at once (a fixed StepResponse), so the time is all transport: what TLS adds
to it is what it adds to a real step. Compare it with the time per output token of
bench/pipeline.py on the same machine.

  .venv/bin/python bench/tls_cost.py [--steps 2000] [--seqs 16]
"""

import argparse
import platform
import statistics
import time
from concurrent import futures

import grpc


from metal_cluster.proto import PROTO_VERSION, pb
from metal_cluster.proto import cluster_pb2_grpc as pb_grpc
from metal_cluster.stage_worker.net import cluster_tls

TOKEN = "bench-token"


class Echo(pb_grpc.StageServicer):
    def __init__(self, answer):
        self.answer = answer

    def Step(self, req, context):
        return self.answer


def decode_step(seqs: int) -> tuple[pb.StepRequest, pb.StepResponse]:
    req = pb.StepRequest(version=PROTO_VERSION, step_id=1)
    answer = pb.StepResponse(step_id=1)
    for i in range(seqs):
        req.cached_requests.append(pb.CachedRequest(req_id=f"cmpl-{i:032x}", num_computed_tokens=700 + i,
                                                    new_token_ids=[1000 + i]))
        req.scheduled.append(pb.ScheduledTokens(req_id=f"cmpl-{i:032x}", num_tokens=1))
        answer.sampled.append(pb.SampledToken(req_id=f"cmpl-{i:032x}", token_id=2000 + i))
    return req, answer


def stages(n: int, tls: bool, answer):
    servers, stubs = [], []
    for k in range(n):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_StageServicer_to_server(Echo(answer), server)
        if tls:
            port = cluster_tls.add_port(server, "127.0.0.1:0", TOKEN, f"stage{k}")
            channel = cluster_tls.channel(f"127.0.0.1:{port}", TOKEN)
        else:
            port = server.add_insecure_port("127.0.0.1:0")
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        server.start()
        servers.append(server)
        stubs.append(pb_grpc.StageStub(channel))
    return servers, stubs


def step_times(stubs, req, steps: int) -> list[float]:
    for _ in range(50):  # connect, handshake, warm up
        [f.result() for f in [s.Step.future(req, timeout=10) for s in stubs]]
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        [f.result() for f in [s.Step.future(req, timeout=10) for s in stubs]]
        times.append(time.perf_counter() - t)
    return times


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seqs", type=int, default=16, help="requests in the decode step")
    p.add_argument("--rounds", type=int, default=3, help="alternating plaintext/TLS rounds (noise)")
    args = p.parse_args()
    req, answer = decode_step(args.seqs)
    print(f"{platform.machine()} {platform.system()}, grpc {grpc.__version__}; decode step of {args.seqs} "
          f"requests ({req.ByteSize()} B out, {answer.ByteSize()} B back), {args.steps} steps x {args.rounds} rounds")
    print("| stages | plaintext median (us) | TLS median (us) | added per step (us) |")
    print("|---:|---:|---:|---:|")
    for n in (1, 3):
        medians = {False: [], True: []}
        for _ in range(args.rounds):
            for tls in (False, True):
                servers, stubs = stages(n, tls, answer)
                medians[tls].append(statistics.median(step_times(stubs, req, args.steps)) * 1e6)
                for s in servers:
                    s.stop(0)
        plain, tls = statistics.median(medians[False]), statistics.median(medians[True])
        print(f"| {n} | {plain:.0f} | {tls:.0f} | {tls - plain:+.0f} |")


if __name__ == "__main__":
    main()
