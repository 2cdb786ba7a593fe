"""What runs inside vLLM's engine: the platform plugin, the executor, the scheduler, the KV specs."""
