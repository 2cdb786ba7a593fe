"""Weights that travel with the plan: manifests, fetching byte ranges, the local cache, the wire."""
