"""What the CLI tells the executor (which runs in vLLM's EngineCore process) through the environment."""

# Comma-separated gRPC addresses of the stage workers, in ring order; unset = one local stage.
STAGES_ENV = "METAL_CLUSTER_STAGES"
