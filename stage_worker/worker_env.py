"""What a worker process is told through its environment (by itself across a reset, or by the
server that started it)."""

# The worker's node id, kept across a reset so that it keeps its name.
NODE_ID_ENV = "METAL_CLUSTER_NODE_ID"

# Set by `serve -pp N` for its local workers: they live only as long as that server process.
PARENT_PID_ENV = "METAL_CLUSTER_PARENT_PID"
