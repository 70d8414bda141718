"""The node layer: what has been prepared on this node, and how to prepare more."""
