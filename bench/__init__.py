"""Benchmarks of the driver daemon against the real control plane (``make bench``; see README.md)."""
