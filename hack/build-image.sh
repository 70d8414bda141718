#!/usr/bin/env bash
# Builds container images as OCI archives, without Docker, a daemon or a registry (make image).
#
# Usage: hack/build-image.sh [--output-dir DIR] [--tag TAG] [IMAGE...]
#   IMAGE (default: all three)
#     driver    the kubelet plugin: Debian's Python, the wheel's dependencies from the hashed lock
#               requirements/runtime.txt (the versions the tests run with), and the project's wheel;
#               entry point `dra-driver kubelet-plugin`
#     pause     the pod sandbox: a busybox shell that sleeps until it is stopped
#     workload  a shell and coreutils (busybox), for test pods that print what they see
#   --output-dir  where IMAGE.oci.tar goes (default: _output/images)
#   --tag         the tag inside each archive (default: the chart's appVersion)
#
# Each archive is an OCI image layout in a tar with one tagged image, which
#   skopeo copy oci-archive:_output/images/driver.oci.tar:TAG docker://REGISTRY/dra-driver-gpu:TAG
# pushes to a registry, and `ctr images import --base-name NAME` loads into containerd.
#
# How: umoci (Debian) makes the layout and the layers; mmdebstrap (Debian) makes the driver's root
# file system, whose result -- Debian plus the Python dependencies, the slow part -- is cached in
# $DRA_CACHE_DIR/images keyed by everything it is made from, so a warm build only adds the wheel.
# Needs root (mmdebstrap's root mode, chroot, files owned by root in the image).
#
# What went in is recorded for audit: the driver image holds /usr/share/dra-driver-gpu/packages.txt,
# every Debian package with its version and the Python lock it was installed from, whose sha256 its
# manifest carries as annotations (dev.dra-driver.packages.sha256, dev.dra-driver.python-lock.sha256)
# next to the Debian suite and the date of the Debian release it was built from. The same list is
# written beside the archive (driver.packages.txt) and compared with the committed one,
# hack/image/driver-packages.txt: a difference (a Debian point release, a new lock) is shown, to be
# reviewed and committed.
set -euo pipefail
shopt -s inherit_errexit

readonly HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly REPO_ROOT="$(dirname "$HACK_DIR")"
# shellcheck source=versions.env
source "$HACK_DIR/versions.env"

# Bump when the recipe of the cached driver base changes.
readonly RECIPE_REVISION=3
readonly DRIVER_PACKAGES=python3,python3-venv
readonly VENV=/opt/dra-driver
readonly LOCK=$REPO_ROOT/requirements/runtime.txt
readonly AUDITED_PACKAGES=$REPO_ROOT/hack/image/driver-packages.txt
# Inside the image: what it was built from.
readonly RECORD_DIR=/usr/share/dra-driver-gpu
# Debian $DEBIAN_SUITE's Python, which the lock's wheels are downloaded for.
readonly IMAGE_PYTHON_VERSION=3.11
readonly PYTHON=${PYTHON_FOR_IMAGE:-$REPO_ROOT/.venv/bin/python}
# Commands inside the image's root file system get a clean environment: none of this machine's
# PIP_* or proxy settings, which name paths that do not exist there.
readonly CLEAN_ENV="/usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8"

log() { printf '%s\n' "$*" >&2; }
die() {
  printf 'build-image: error: %s\n' "$*" >&2
  exit 1
}

output_dir=$REPO_ROOT/_output/images
tag=
images=()
while (($# > 0)); do
  case $1 in
  --output-dir) output_dir=$(realpath -m "$2") && shift 2 ;;
  --tag) tag=$2 && shift 2 ;;
  -h | --help)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
    ;;
  driver | pause | workload) images+=("$1") && shift ;;
  *) die "unknown image or option '$1'; images: driver pause workload (see --help)" ;;
  esac
done
((${#images[@]} > 0)) || images=(driver pause workload)
[[ -n $tag ]] || tag=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$REPO_ROOT/charts/dra-driver-gpu/Chart.yaml")
[[ $tag =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || die "'$tag' is not a valid image tag"

((EUID == 0)) || die "building images needs root (mmdebstrap, chroot and root-owned files); run as root"
for tool in umoci busybox mmdebstrap; do
  command -v "$tool" >/dev/null 2>&1 ||
    die "'$tool' is not installed; run hack/install-deps.sh (as root) first"
done
# The image has no C library: only a static busybox runs there.
[[ $(ldd /bin/busybox 2>&1 || true) == *"not a dynamic executable"* ]] ||
  die "/bin/busybox is not the static busybox; install busybox-static (hack/install-deps.sh)"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/dra-build-image.XXXXXX")
cleanup() { rm -rf "$WORK"; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The tag's image in the layout, as a tar at $2; written aside and renamed, so a failed build
# never leaves an archive that looks finished.
write_archive() {
  local layout=$1 out=$2
  umoci gc --layout "$layout"
  mkdir -p "$(dirname "$out")"
  tar --sort=name --owner=0 --group=0 --numeric-owner -C "$layout" -cf "$out.partial" .
  mv -f "$out.partial" "$out"
  log "    wrote $out ($(du -h "$out" | cut -f1))"
}

# A busybox root file system: /bin/busybox and a link per applet (sh, ls, cat, sleep, ...).
busybox_rootfs() {
  local rootfs=$1
  mkdir -p "$rootfs"/{bin,dev,etc,proc,sys,tmp,var,run}
  chmod 1777 "$rootfs/tmp"
  cp /bin/busybox "$rootfs/bin/busybox"
  chroot "$rootfs" /bin/busybox --install -s /bin
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$rootfs/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' >"$rootfs/etc/group"
}

# busybox_image NAME ENTRYPOINT...
busybox_image() {
  local name=$1
  shift
  local layout=$WORK/$name-layout bundle=$WORK/$name-bundle
  log "==> image $name:$tag (busybox $(dpkg-query -W -f='${Version}' busybox-static))"
  umoci init --layout "$layout"
  umoci new --image "$layout:$tag"
  umoci unpack --image "$layout:$tag" "$bundle" >/dev/null
  busybox_rootfs "$bundle/rootfs"
  umoci repack --image "$layout:$tag" "$bundle"
  local entrypoint=() arg
  for arg in "$@"; do entrypoint+=(--config.entrypoint "$arg"); done
  umoci config --image "$layout:$tag" "${entrypoint[@]}" --config.workingdir / \
    --config.env PATH=/bin --author dra-driver-gpu
  write_archive "$layout" "$output_dir/$name.oci.tar"
}

# record_packages ROOTFS RELEASE_DATE LOCK: ROOTFS$RECORD_DIR/packages.txt, what the image is made of:
# the Debian suite and the date of its release, every Debian package with its version, and every
# Python package with the version the lock pinned (and pip checked the hash of).
record_packages() {
  local rootfs=$1 release_date=$2 lock=$3
  mkdir -p "$rootfs$RECORD_DIR"
  {
    printf '# Debian %s from %s, release of %s\n' "$DEBIAN_SUITE" "$DEBIAN_MIRROR" "$release_date"
    chroot "$rootfs" $CLEAN_ENV dpkg-query -W -f='deb ${Package}=${Version}\n' | LC_ALL=C sort
    printf '# Python packages of %s, from requirements/runtime.txt\n' "$VENV"
    sed -n 's/^\([A-Za-z0-9][A-Za-z0-9._-]*==[^ ;\\]*\).*/pypi \1/p' "$lock" | LC_ALL=C sort
  } >"$rootfs$RECORD_DIR/packages.txt"
}

# The driver's base layout: Debian $DEBIAN_SUITE with Python and a virtualenv holding the wheel's
# dependencies, and the record of both. Cached by a digest of the recipe, the suite, the packages
# and the lock.
driver_base() {
  local requirements=$1 key base
  key=$( {
    printf '%s\n' "$RECIPE_REVISION $DEBIAN_SUITE $DEBIAN_MIRROR $DRIVER_PACKAGES $VENV"
    cat "$requirements"
  } | sha256sum | cut -c1-16)
  base=$DRA_CACHE_DIR/images/driver-base-$key
  if [[ -f $base/index.json ]]; then
    log "    driver base cached: $base"
    printf '%s\n' "$base"
    return
  fi
  log "==> driver base: Debian $DEBIAN_SUITE + $DRIVER_PACKAGES + the wheel's dependencies (cached in $base)"
  local layout=$WORK/base-layout bundle=$WORK/base-bundle wheels=$WORK/wheels
  # Every file's sha256 is checked against the lock, here and again when the image installs it.
  "$PYTHON" -m pip download --quiet --require-hashes --no-deps --only-binary=:all: \
    --python-version "$IMAGE_PYTHON_VERSION" --dest "$wheels" -r "$requirements" >&2 ||
    die "pip could not download the driver's dependencies (locked in $requirements); check that PyPI is reachable"
  cp "$requirements" "$wheels/requirements.txt"
  umoci init --layout "$layout"
  umoci new --image "$layout:base"
  umoci unpack --image "$layout:base" "$bundle" >/dev/null
  rmdir "$bundle/rootfs"
  # minbase: essential packages only. Documentation, man pages and locales are left out; apt's
  # lists and caches are removed by mmdebstrap itself.
  mmdebstrap --quiet --mode=root --variant=minbase --include="$DRIVER_PACKAGES" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook="copy-in $wheels /tmp" \
    --customize-hook="chroot \"\$1\" $CLEAN_ENV python3 -m venv $VENV" \
    --customize-hook="chroot \"\$1\" $CLEAN_ENV $VENV/bin/pip install --quiet --require-hashes --no-deps --no-index --find-links /tmp/wheels -r /tmp/wheels/requirements.txt" \
    --customize-hook="sed -n 's/^Date: //p' \"\$1\"/var/lib/apt/lists/*_InRelease | head -n1 >$WORK/debian-release-date" \
    --customize-hook='rm -rf "$1/tmp/wheels" "$1/root/.cache"' \
    "$DEBIAN_SUITE" "$bundle/rootfs" "$DEBIAN_MIRROR" >&2 ||
    die "mmdebstrap could not build the Debian root file system ($DEBIAN_SUITE from $DEBIAN_MIRROR); its error is above"
  record_packages "$bundle/rootfs" "$(cat "$WORK/debian-release-date")" "$requirements"
  umoci repack --image "$layout:base" "$bundle"
  mkdir -p "$(dirname "$base")"
  rm -rf "$base.partial"
  cp -a "$layout" "$base.partial"
  mv "$base.partial" "$base"
  rm -rf "$bundle"
  printf '%s\n' "$base"
}

driver_image() {
  log "==> image driver:$tag (the project's wheel on Debian $DEBIAN_SUITE)"
  [[ -x $PYTHON ]] || die "no $PYTHON; run make venv first"
  local base layout=$WORK/driver-layout bundle=$WORK/driver-bundle record
  base=$(driver_base "$LOCK")
  # Only the wheel's files: what pyproject.toml packages, as `pip wheel` builds it.
  "$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$WORK/wheel" "$REPO_ROOT" >&2 ||
    die "pip could not build the project's wheel; its error is above"
  cp -a "$base" "$layout"
  umoci unpack --image "$layout:base" "$bundle" >/dev/null
  cp "$WORK"/wheel/*.whl "$bundle/rootfs/tmp/"
  chroot "$bundle/rootfs" $CLEAN_ENV /bin/sh -c "$VENV/bin/pip install --quiet --no-index --no-deps /tmp/*.whl && rm -f /tmp/*.whl"
  rm -rf "$bundle/rootfs/root/.cache"
  record=$WORK/driver.packages.txt
  cp "$bundle/rootfs$RECORD_DIR/packages.txt" "$record"
  umoci repack --image "$layout:$tag" "$bundle"
  umoci rm --image "$layout:base"
  # Runs as root: the plugin's pod is privileged, to use NVML, create MIG devices and write into
  # the kubelet's and the container runtime's host directories. Settings come from the environment.
  umoci config --image "$layout:$tag" \
    --config.entrypoint "$VENV/bin/dra-driver" --config.entrypoint kubelet-plugin \
    --config.env "PATH=$VENV/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --config.env PYTHONUNBUFFERED=1 --config.workingdir / --author dra-driver-gpu \
    --config.label "org.opencontainers.image.title=dra-driver-gpu" \
    --config.label "org.opencontainers.image.version=$tag" \
    --config.label "org.opencontainers.image.licenses=Apache-2.0" \
    --manifest.annotation "dev.dra-driver.debian.suite=$DEBIAN_SUITE" \
    --manifest.annotation "dev.dra-driver.debian.release-date=$(sed -n '1s/.*, release of //p' "$record")" \
    --manifest.annotation "dev.dra-driver.packages.sha256=$(sha256sum <"$record" | cut -d' ' -f1)" \
    --manifest.annotation "dev.dra-driver.python-lock.sha256=$(sha256sum <"$LOCK" | cut -d' ' -f1)"
  write_archive "$layout" "$output_dir/driver.oci.tar"
  cp "$record" "$output_dir/driver.packages.txt"
  compare_with_audited "$output_dir/driver.packages.txt"
}

# The packages of the image just built against the list last reviewed and committed: a Debian point
# release or a new lock changes them, and the change is shown here for review, not hidden.
compare_with_audited() {
  local built=$1
  if [[ ! -f $AUDITED_PACKAGES ]]; then
    log "    no audited package list yet: review $built and commit it as ${AUDITED_PACKAGES#"$REPO_ROOT/"}"
  elif ! diff -u --label "${AUDITED_PACKAGES#"$REPO_ROOT/"}" --label "$built" \
    <(grep -v '^#' "$AUDITED_PACKAGES") <(grep -v '^#' "$built") >"$WORK/packages.diff"; then
    log "    warning: the image's packages differ from the audited ${AUDITED_PACKAGES#"$REPO_ROOT/"}:"
    sed 's/^/      /' "$WORK/packages.diff" >&2
    log "    review the difference, then: cp $built ${AUDITED_PACKAGES#"$REPO_ROOT/"}"
  else
    log "    packages as audited in ${AUDITED_PACKAGES#"$REPO_ROOT/"} (sha256 in the manifest's annotations)"
  fi
}

for image in "${images[@]}"; do
  case $image in
  driver) driver_image ;;
  # PID 1 ignores SIGTERM without a handler; the trap makes a stop quick.
  pause) busybox_image pause /bin/sh -c 'trap "exit 0" TERM INT; while :; do sleep 3600 & wait $!; done' ;;
  workload) busybox_image workload /bin/sh ;;
  esac
done
