#!/usr/bin/env bash
# Builds the Go reference driver that `make bench-go` measures beside ours into the cache, only when
# it is missing, and prints where it is:
#   GO_REFERENCE_DRIVER_BIN=/root/.cache/dra-driver/dra-example-driver-v0.4.0/bin/dra-example-kubeletplugin
# progress and errors go to stderr.
#
# The reference is the kubelet plugin of sigs.k8s.io/dra-example-driver (Apache-2.0), the upstream
# example built on k8s.io/dynamic-resource-allocation's kubeletplugin helper, the same helper
# NVIDIA's Go driver uses. Its source comes from the Go module proxy into the Go module cache (the
# module's own go.mod and go.sum pin every dependency); nothing of it is committed here. The module
# proxy serves tagged versions of it only, so GO_REFERENCE_DRIVER_VERSION (hack/versions.env) is a tag.
set -euo pipefail
shopt -s inherit_errexit

readonly HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$HACK_DIR/versions.env"
readonly MODULE=sigs.k8s.io/dra-example-driver
readonly RECIPE_REVISION=1
# The module's own go.sum decides every dependency; CGO is not needed by the plugin.
export GOWORK=off GOFLAGS=-mod=readonly CGO_ENABLED=0

log() { printf '%s\n' "$*" >&2; }
die() {
  printf 'build-go-reference: error: %s\n' "$*" >&2
  exit 1
}

command -v go >/dev/null 2>&1 || die "the Go toolchain ('go') is not on PATH; install Go 1.26 or newer"

readonly OUT_DIR="$DRA_CACHE_DIR/dra-example-driver-$GO_REFERENCE_DRIVER_VERSION"
readonly BIN="$OUT_DIR/bin/dra-example-kubeletplugin"
stamp=$(printf '%s\n' "$RECIPE_REVISION $MODULE@$GO_REFERENCE_DRIVER_VERSION $(go env GOVERSION)" | sha256sum | cut -d' ' -f1)

built() { [[ -x $BIN && -f $OUT_DIR/.stamp && $(<"$OUT_DIR/.stamp") == "$stamp" ]]; }
if built; then
  printf 'GO_REFERENCE_DRIVER_BIN=%s\n' "$BIN"
  exit 0
fi

mkdir -p "$OUT_DIR"
exec {lock_fd}>"$OUT_DIR/.build.lock"
flock "$lock_fd"
if built; then
  printf 'GO_REFERENCE_DRIVER_BIN=%s\n' "$BIN" # built by another caller while this one waited
  exit 0
fi

log "building the Go reference driver ($MODULE@$GO_REFERENCE_DRIVER_VERSION) into $OUT_DIR"
module_dir=$(cd "$OUT_DIR" && go mod download -json "$MODULE@$GO_REFERENCE_DRIVER_VERSION" |
  sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[[ -n $module_dir && -f $module_dir/go.mod ]] ||
  die "could not fetch $MODULE@$GO_REFERENCE_DRIVER_VERSION through the Go module proxy ($(go env GOPROXY))"
# The module cache is read-only and `go build` needs a main module: build in a copy of it.
build="$OUT_DIR/src"
rm -rf "$build"
cp -r "$module_dir" "$build"
chmod -R u+w "$build"
(cd "$build" && go build -trimpath -buildvcs=false -o "$BIN.tmp" ./cmd/dra-example-kubeletplugin) ||
  die "go build of $MODULE@$GO_REFERENCE_DRIVER_VERSION failed (see above)"
mv "$BIN.tmp" "$BIN"
rm -rf "$build"
printf '%s\n' "$stamp" >"$OUT_DIR/.stamp"
log "built $BIN"
printf 'GO_REFERENCE_DRIVER_BIN=%s\n' "$BIN"
