from metal_cluster.coordinator.cli import app

app(prog_name="metal-cluster")
