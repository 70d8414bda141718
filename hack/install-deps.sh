#!/usr/bin/env bash
# Installs the Debian packages that the real node (`make cluster-up NODE=real`, the real_node tests)
# and `make image` need, and only those that are missing. Idempotent: a machine that has them all
# is left untouched, without even an `apt-get update`.
#
# Usage: hack/install-deps.sh [--check]
#   --check  only say what is missing (exit 1 when something is); never installs.
#
#   runc                          the OCI runtime containerd's shim starts containers with
#   containernetworking-plugins   the CNI `loopback` plugin (in /usr/lib/cni)
#   umoci, busybox-static         OCI images without Docker or a registry (hack/build-image.sh)
#   mmdebstrap                    the Debian root file system of the driver's image
#   iproute2                      `ip`, which the project's CNI plugin configures `lo` of a pod with
#
# --no-install-recommends: runc recommends criu, and the CNI plugins bring iptables and nftables
# along otherwise; none of them is used.
set -euo pipefail

readonly PACKAGES=(runc containernetworking-plugins umoci busybox-static mmdebstrap iproute2)

missing=()
for package in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null || true)
  [[ $status == "install ok installed" ]] || missing+=("$package")
done

if ((${#missing[@]} == 0)); then
  exit 0
fi
if [[ ${1:-} == --check ]]; then
  printf 'install-deps: missing Debian packages: %s (run hack/install-deps.sh as root)\n' "${missing[*]}" >&2
  exit 1
fi
if ((EUID != 0)); then
  printf 'install-deps: error: the Debian packages %s are missing and installing them needs root; run as root: hack/install-deps.sh\n' "${missing[*]}" >&2
  exit 1
fi
command -v apt-get >/dev/null 2>&1 || {
  printf 'install-deps: error: no apt-get here; install these packages (or their equivalents) yourself: %s\n' "${missing[*]}" >&2
  exit 1
}
printf '==> installing Debian packages: %s\n' "${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >&2
apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
