"""A Kubernetes DRA driver for NVIDIA GPUs."""

__version__ = "0.1.0"
