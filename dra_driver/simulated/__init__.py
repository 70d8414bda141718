"""Everything that is not real: the stand-ins for the GPUs and for NVIDIA's programs.

What a test or ``make demo`` runs instead of hardware. ``grep -r dra_driver.simulated dra_driver``
lists every place real code can reach a stand-in (tests/test_layers.py keeps that list short):

- :mod:`.gpus`: simulated GPUs behind the ``Backend`` interface, their MIG and injected faults;
- :mod:`.health`: those faults as a health source, as NVML's events are on a real node;
- :mod:`.nodes`: the node profiles ``--simulate`` accepts; :mod:`.state`: their shared state file;
- :mod:`.sysfs`: a sysfs tree and kernel for passthrough (vfio-pci binding);
- :mod:`.mps_daemons` and :mod:`.mps_control`: MPS control daemons as local processes;
- :mod:`.imex_daemon`: the IMEX daemon of a ComputeDomain.

The NVML backend's stand-in is not here: it is a mock ``libnvidia-ml.so.1`` (and its ``nvidia-smi``)
built from NVIDIA's header by hack/build-mock-nvml.sh, loaded as NVML is on a host, so that the
backend under test is the real one.
"""
