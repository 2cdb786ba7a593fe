"""What metal-cluster adds to vLLM's HTTP server: admission limits, cluster routes, the dashboard."""
