"""The GPU kubelet plugin, as a program: ``dra-driver kubelet-plugin``.

- :mod:`.launch`: the kubelet's sockets first, then everything behind them;
- :mod:`.startup`: the checks a user's settings get before anything opens;
- :mod:`.app`: the wiring of the layers below into one daemon;
- :mod:`.policies`: the pure functions from settings and inventory to slices, taints, labels and CDI edits;
- :mod:`.watches`: the inventory, health and binding-condition watches;
- :mod:`.tuning`: the start-up and memory policy (garbage collector, heap trimming);
- :mod:`.http` and :mod:`.metrics`: probes and Prometheus metrics;
- :mod:`.state_command`: ``dra-driver state``, the node's store as an operator reads it.
"""
