"""The kubelet adapters: plugin registration, the DRA plugin services and the health stream.

This layer translates protocol messages to and from the domain objects of
:mod:`dra_driver.node.types` and owns the unix sockets; every rule lives below it.
"""
