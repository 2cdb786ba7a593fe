"""The CLI's commands behind `metal-cluster`: serve, up, generate, status, doctor, services."""
