"""The Kubernetes view of the node's GPUs: devices, MIG partitions as counters, ResourceSlices.

Everything here is pure except :mod:`publisher` and :mod:`slice_api`, the I/O edge that keeps
the pool on the API server equal to what the pure functions computed.
"""
