"""End-to-end tests and the machinery they run on (a real local control plane: e2e.cluster)."""
