"""What the CLI tells the executor (which runs in vLLM's EngineCore process) through the environment."""

# Comma-separated gRPC addresses of the stage workers, in ring order; unset = one local stage.
STAGES_ENV = "METAL_CLUSTER_STAGES"

# Set to 1 to wait for each step before the next (no overlap between stages): for benchmarks.
NO_OVERLAP_ENV = "METAL_CLUSTER_NO_OVERLAP"

# Layer ranges of the stages, "start-end,start-end,...", from placement; unset = an even split.
LAYERS_ENV = "METAL_CLUSTER_LAYERS"

# Seconds a stage may miss heartbeats before it counts as lost (and the cluster re-plans). Heartbeats
# go out ten times a second, so a frozen stage is seen within a second; a freeze of half a second
# (or a loaded host answering late) is not a loss.
STAGE_TIMEOUT_ENV = "METAL_CLUSTER_STAGE_TIMEOUT"
DEFAULT_STAGE_TIMEOUT_S = 0.75

# Seconds a request running when a stage was lost may wait for the new plan before it ends with a
# retryable error (it resumes where it stopped if the new plan serves sooner).
RESUME_TIMEOUT_ENV = "METAL_CLUSTER_RESUME_TIMEOUT"
DEFAULT_RESUME_TIMEOUT_S = 120.0

# Seconds one step may take on the stages before it counts as stuck: a backstop behind heartbeats.
STEP_TIMEOUT_ENV = "METAL_CLUSTER_STEP_TIMEOUT"
DEFAULT_STEP_TIMEOUT_S = 600.0

# The coordinator's model store ("host:port") and the manifest it serves: remote stages fetch their
# weights from it. Unset: every stage reads the model at the coordinator's path.
MODEL_STORE_ENV = "METAL_CLUSTER_MODEL_STORE"
MANIFEST_ENV = "METAL_CLUSTER_MANIFEST"

# Comma-separated addresses of stage workers on the coordinator's own disk: they read the path.
LOCAL_STAGES_ENV = "METAL_CLUSTER_LOCAL_STAGES"
