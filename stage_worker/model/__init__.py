"""Loading a stage's layers into MLX: where a model is, GGUF reading, dtypes, the layer range."""
