"""The hardware layer: what GPUs a node has and what can be done to them.

Nothing here knows about Kubernetes or CDI.
"""
