"""A real node for the end-to-end tests and the demo: kubelet + containerd + runc on this machine.

Shell: `make cluster-up NODE=real` (python -m e2e.cluster up --node real).
pytest: the fixtures in e2e/real_node/conftest.py (marker `real_node`).
"""
