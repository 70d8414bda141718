"""The hardware report: a program of its own, run on a lent GPU machine (hack/hardware-inventory.sh).

It opens the NVML backend read-only and writes what the driver would publish for the GPUs it finds,
beside what the catalog says of those models; the output is kept as a golden file
(tests/devices/golden/).
"""
