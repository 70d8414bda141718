#!/usr/bin/env bash
# A read-only report of this host's NVIDIA GPUs, as the driver's NVML backend reads them: one JSON
# with the driver, CUDA and NVML versions, each GPU's inventory and MIG mode (current and pending),
# its GPU-instance profiles and their placements, the MIG devices that exist, and the devices the
# driver would publish. Keep it as tests/devices/golden/<gpu>.json: the unit tests then compare it
# with the GPU catalog and the driver's profile naming (tests/devices/test_hardware_report.py).
#
# It NEVER changes the GPUs: no MIG-mode switch, no reset, no GPU or compute instance created or
# destroyed, no compute mode set (the backend is opened read-only; see dra_driver/hardware_report/report.py).
#
#   hack/hardware-inventory.sh [--driver-root DIR] [--procfs-root DIR] [--sysfs-root DIR] [-o FILE]
#
# --driver-root is where the driver is (/ on a host install, /run/nvidia/driver for the GPU
# operator's driver container). A hung NVML call ends the run after HARDWARE_REPORT_TIMEOUT seconds
# (default 300).
set -euo pipefail

readonly REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$REPO/.venv/bin/python}"
if [[ ! -x $python ]]; then
  printf 'hardware-inventory: error: %s is missing: run `make venv` in %s first (or set PYTHON)\n' \
    "$python" "$REPO" >&2
  exit 1
fi
cd "$REPO"
exec timeout --kill-after=10 "${HARDWARE_REPORT_TIMEOUT:-300}" "$python" -m dra_driver.hardware_report "$@"
