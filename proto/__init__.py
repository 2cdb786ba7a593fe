"""Wire contract between hosts. `cluster_pb2` is generated from cluster.proto (see tests/test_proto.py)."""

from metal_cluster.proto import cluster_pb2 as pb

# Peers with another version are refused: a Step's meaning must not drift silently between hosts.
PROTO_VERSION = 9  # 2: Reset, heartbeats; 3: stage dtype, ring wire dtype, stage-kept tokens; 4: ModelStore;
# 5: KV cache groups, start timings, every sampling parameter (logits processors, named-id and prompt
# logprobs), resumed requests' output tokens; 6: speculative drafts, LoRA and pooling, a re-plan's known
# activation peak, WeightsRoom (a worker whose cache cannot hold its layers); 7: classify (a sequence
# classifier's head on the last stage), a draft model on the last stage (Assign) and its drafts
# (StepResponse.spec_drafts); 8: weights over a plaintext port (Grant, bulk_port), pieces hashed with
# BLAKE3, MTP layers on the last stage (spec_mtp); 9: a
# manifest's tensors whole, each with its dtype and shape (a worker caches tensors, not files)

__all__ = ["pb", "PROTO_VERSION"]
