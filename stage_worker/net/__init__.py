"""How a worker is found and trusted: Bonjour adverts, the cluster token, TLS, MLX's ring."""
