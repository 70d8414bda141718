"""ComputeDomains: multi-node NVLink (IMEX) for workloads that span nodes, as NVIDIA's driver ships them.

- :mod:`.api`: the ComputeDomain and ComputeDomainClique resources, shared by every part below;
- :mod:`.dnsnames`: the IMEX daemons' fixed DNS names;
- :mod:`.node` and :mod:`.plugin`: the node's second driver (``compute-domain.nvidia.com``),
  run inside the GPU kubelet plugin: channels and daemon claims, prepared into CDI specs;
- :mod:`.controller`: the cluster-level program that reconciles domains;
- :mod:`.cli`: the ``compute-domain-controller`` and ``compute-domain-daemon`` commands.

The IMEX daemon itself is NVIDIA's ``nvidia-imex``; its stand-in is
:mod:`dra_driver.simulated.imex_daemon`.
"""
