#!/usr/bin/env bash
# Builds the upstream programs that the tests and the demo run, from their Go modules, into a cache
# outside the repository keyed by component and version -- and only when they are missing or stale.
#
# Usage: hack/build-kube.sh [COMPONENT...]
#        hack/build-kube.sh --update-wrappers [COMPONENT...]
#
# COMPONENT (default: all; harness only once hack/kube/cmd/kubelet-harness exists):
#   kube     kube-apiserver, kube-scheduler, kube-controller-manager, kubectl   (k8s.io/kubernetes)
#   harness  kubelet-harness, hack/kube/cmd/kubelet-harness built in the same wrapper module
#   etcd     etcd                                                              (go.etcd.io/etcd/server/v3)
#   helm     helm                                                              (helm.sh/helm/vN/cmd/helm)
#   kubelet  kubelet, for the real node (NODE=real); not built by default        (k8s.io/kubernetes)
#   containerd  containerd, containerd-shim-runc-v2, ctr; not built by default   (github.com/containerd/containerd/v2)
# Versions come from hack/versions.env and can be overridden from the environment.
#
# stdout carries only NAME=VALUE lines, for callers to parse or eval, e.g.
#   KUBE_VERSION=v1.37.2
#   KUBE_BIN_DIR=/root/.cache/dra-driver/k8s-v1.37.2/bin
# progress and errors go to stderr.
#
# --update-wrappers regenerates the committed wrapper modules hack/{kube,kubelet,etcd,helm,containerd}/go.{mod,sum}
# for the pinned versions (all of them, or those of the components named); run it after changing a
# pin in hack/versions.env.
#
# Why wrapper modules: k8s.io/kubernetes requires its staging modules (k8s.io/api, ...) at v0.0.0 and
# maps them to ./staging with replace directives, which a dependent module ignores, so
# `go install k8s.io/kubernetes/cmd/...@v1.X.Y` is refused. A module of our own that replaces each of
# them with its published v0.X.Y tag builds. `go install` also refuses etcd, whose go.mod carries
# replace directives; helm's does not, but it gets a wrapper module too, so that every build here
# resolves its dependencies from a committed go.sum.
set -euo pipefail
shopt -s inherit_errexit # a failure inside $(...) stops the script too

readonly HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$HACK_DIR/versions.env"

# Bump when the way binaries are built changes (flags, ldflags), so cached binaries are rebuilt.
readonly RECIPE_REVISION=2
readonly GO_BUILD_FLAGS=(-trimpath -buildvcs=false)
readonly HEARTBEAT_SECONDS=30
readonly KUBE_PROGRAMS=(kube-apiserver kube-scheduler kube-controller-manager kubectl)
readonly CONTAINERD_PROGRAMS=(containerd containerd-shim-runc-v2 ctr)
# Leaves out the snapshotters that need C libraries or kernel features no test uses; overlayfs and
# native stay.
readonly CONTAINERD_TAGS=no_btrfs,no_devmapper,no_zfs
readonly HARNESS_SOURCES="$HACK_DIR/kube/cmd/kubelet-harness"
export CGO_ENABLED=0 # static binaries; no C toolchain needed
export GOWORK=off    # a go.work somewhere above must not change what gets built

log() { printf '%s\n' "$*" >&2; }
die() {
  printf 'build-kube: error: %s\n' "$*" >&2
  exit 1
}
elapsed_since() { printf '%dm%02ds' $(((SECONDS - $1) / 60)) $(((SECONDS - $1) % 60)); }

require_go() {
  command -v go >/dev/null 2>&1 ||
    die "the Go toolchain ('go') is not on PATH. Install Go 1.26 or newer (https://go.dev/doc/install) and run this again."
}

# Runs a go command that may need the module proxy. On failure prints ONE message naming what could
# not be fetched, go's own reason, and what to do; stdout passes through to the caller.
go_online() {
  local what=$1
  shift
  local out err status=0
  out=$(mktemp) err=$(mktemp)
  "$@" >"$out" 2>"$err" || status=$?
  if ((status != 0)); then
    local reason
    # go mod download -json reports in a JSON string on stdout, everything else on stderr.
    reason=$({
      sed -n 's/^[[:space:]]*"Error": "\(.*\)",\{0,1\}$/\1/p' "$out" | sed 's/\\"/"/g; s/\\[nt]/ /g'
      grep -v '^go: downloading' "$err" || true
    } | head -n 3)
    rm -f "$out" "$err"
    die "could not fetch $what through the Go module proxy (GOPROXY=$(go env GOPROXY)):
${reason}
Check that this machine reaches the proxy (or point GOPROXY at one it reaches) and that the version exists."
  fi
  cat "$out"
  rm -f "$out" "$err"
}

# The field $2 ("GoMod", "Info") of `go mod download -json $1`, which also fetches the module.
module_field() {
  local json
  json=$(cd / && go_online "$1" go mod download -json "$1")
  sed -n "s/^[[:space:]]*\"$2\": \"\(.*\)\",\{0,1\}\$/\1/p" <<<"$json"
}

# The version of $2 that the go.mod file $1 requires, whether on a `require` line or in a block.
required_version() {
  [[ -f $1 ]] || return 0
  awk -v m="$2" '$1 == "require" && $2 == m { print $3; exit } $1 == m && $2 ~ /^v/ { print $2; exit }' "$1"
}

# `godebug` settings of a go.mod file, one key=value per line (single-line or block form).
godebug_settings() {
  awk '$1 == "godebug" && $2 != "(" { print $2 } $1 == "godebug" && $2 == "(" { block = 1; next }
       block && $1 == ")" { block = 0 } block { print $1 }' "$1"
}

# Modules a go.mod file requires at v0.0.0: k8s.io/kubernetes's staging modules.
staging_modules() {
  awk '$1 == "require" && $2 == "(" { block = 1; next } block && $1 == ")" { block = 0 }
       block && $2 == "v0.0.0" { print $1 } $1 == "require" && $3 == "v0.0.0" { print $2 }' "$1"
}

# Writes the wrapper module in directory $1 (Go sources already there are kept and tidied in):
# module $2 requiring $3 at version $4 with the dependency's `go` and `godebug` lines, a replace of
# each staging module with its tag $5 (empty: none), and a `tool` line per remaining argument.
write_wrapper_module() {
  local dir=$1 name=$2 dependency=$3 version=$4 staging_version=$5
  shift 5
  log "==> writing the wrapper module for $dependency@$version in $dir"
  local gomod
  gomod=$(module_field "$dependency@$version" GoMod)
  [[ -f $gomod ]] || die "go mod download printed no go.mod file for $dependency@$version"
  mkdir -p "$dir"
  rm -f "$dir/go.sum"
  {
    printf 'module %s\n\ngo %s\n' "$name" "$(awk '$1 == "go" { print $2; exit }' "$gomod")"
    godebug_settings "$gomod" | awk 'NR == 1 { print "" } { print "godebug " $0 }'
    printf '\nrequire %s %s\n' "$dependency" "$version"
    if [[ -n $staging_version ]]; then
      printf '\nreplace (\n'
      staging_modules "$gomod" | LC_ALL=C sort | awk -v v="$staging_version" '{ print "\t" $1 " => " $1 " " v }'
      printf ')\n'
    fi
    printf '\ntool (\n'
    printf '\t%s\n' "$@"
    printf ')\n'
  } >"$dir/go.mod"
  tidy_module "$dir" "$dependency@$version"
}

tidy_module() {
  log "    go mod tidy in $1"
  (cd "$1" && go_online "the modules that $2 needs" go mod tidy)
}

# The committed wrapper module $1 when it pins $2 at $3, else a module generated in the cache dir $4.
# $5... are the arguments write_wrapper_module needs after the directory.
wrapper_module_dir() {
  local committed=$1 dependency=$2 version=$3 generated=$4
  shift 4
  if [[ $(required_version "$committed/go.mod" "$dependency") == "$version" ]]; then
    printf '%s\n' "$committed"
    return
  fi
  if [[ ! -f $generated/go.mod ]]; then
    require_go
    # Written aside and moved into place, so a failed attempt never looks like a finished module.
    rm -rf "$generated.partial"
    write_wrapper_module "$generated.partial" "$@" >&2
    mv "$generated.partial" "$generated"
  fi
  printf '%s\n' "$generated"
}

# A digest of everything a binary is built from: a changed module, source or recipe rebuilds it.
# File contents only, not their paths, so another checkout of the same sources reuses the cache.
build_stamp() {
  local recipe=$1 file
  shift
  {
    printf '%s\n' "$RECIPE_REVISION $recipe ${GO_BUILD_FLAGS[*]}"
    for file in "$@"; do sha256sum <"$file"; done
  } | sha256sum | cut -d' ' -f1
}

is_fresh() { # name bin_dir stamp
  [[ -x $2/$1 && -f $2/.$1.stamp && $(<"$2/.$1.stamp") == "$3" ]]
}

# NAME=VALUE pairs for stdout, printed once all requested components are built.
declare -A RESULTS=()
emit() {
  while (($# >= 2)); do
    RESULTS[$1]=$2
    shift 2
  done
}

declare -A MODULES_DOWNLOADED=()
# Downloads a module's dependencies before building, so an unreachable proxy gives one clear message
# instead of a compiler log; a no-op when the module cache already holds them.
download_dependencies() {
  [[ -n ${MODULES_DOWNLOADED[$1]:-} ]] && return
  log "    checking the Go module cache for $1"
  (cd "$1" && go_online "the dependencies of $1" go mod download) >&2
  MODULES_DOWNLOADED[$1]=1
}

BUILD_PID=
PARTIAL_BINARY=
cleanup() {
  if [[ -n $BUILD_PID ]]; then kill "$BUILD_PID" 2>/dev/null || true; fi
  if [[ -n $PARTIAL_BINARY ]]; then rm -f "$PARTIAL_BINARY"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# build_program NAME BIN_DIR STAMP MODULE_DIR PACKAGE LDFLAGS [TAGS]
# Builds into a partial file renamed into place, so an interrupted build never looks finished.
build_program() {
  local name=$1 bin_dir=$2 stamp=$3 module_dir=$4 package=$5 ldflags=$6 tags=${7:-}
  is_fresh "$name" "$bin_dir" "$stamp" && return
  # etcd and helm are shared by every KUBE_VERSION, whose builds may run at once: one builds, the
  # other finds the binary fresh once the lock is free.
  mkdir -p "$bin_dir"
  local binary_lock
  exec {binary_lock}>"$bin_dir/.$name.lock"
  flock "$binary_lock"
  if is_fresh "$name" "$bin_dir" "$stamp"; then
    exec {binary_lock}>&-
    return
  fi
  require_go
  download_dependencies "$module_dir"
  log "==> building $name ($package) into $bin_dir"
  local started=$SECONDS next_report=$((SECONDS + HEARTBEAT_SECONDS))
  PARTIAL_BINARY="$bin_dir/.$name.partial"
  (cd "$module_dir" && exec go build "${GO_BUILD_FLAGS[@]}" -tags "$tags" -ldflags "$ldflags" -o "$PARTIAL_BINARY" "$package") &
  BUILD_PID=$!
  while kill -0 "$BUILD_PID" 2>/dev/null; do
    sleep 1
    if ((SECONDS >= next_report)); then
      log "    ... still building $name ($(elapsed_since "$started"))"
      next_report=$((SECONDS + HEARTBEAT_SECONDS))
    fi
  done
  local status=0
  wait "$BUILD_PID" || status=$?
  BUILD_PID=
  ((status == 0)) || die "go build of $name failed (compiler output above); fix it and run this again."
  mv -f "$PARTIAL_BINARY" "$bin_dir/$name"
  PARTIAL_BINARY=
  printf '%s\n' "$stamp" >"$bin_dir/.$name.stamp"
  exec {binary_lock}>&-
  log "    built $name in $(elapsed_since "$started")"
}

kube_module_dir() {
  wrapper_module_dir "$HACK_DIR/kube" k8s.io/kubernetes "$KUBE_VERSION" \
    "$DRA_CACHE_DIR/k8s-$KUBE_VERSION/module" github.com/dra-driver/hack/kube k8s.io/kubernetes \
    "$KUBE_VERSION" "v0.${KUBE_VERSION#v1.}" "${KUBE_PROGRAMS[@]/#/k8s.io/kubernetes/cmd/}"
}

kube_ldflags() {
  local version=${KUBE_VERSION#v} build_date package flags="-s -w"
  # The release's tag time, from the proxy: reproducible, unlike the time of this build.
  build_date=$(sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' "$(module_field "k8s.io/kubernetes@$KUBE_VERSION" Info)")
  local major=${version%%.*} minor=${version#*.}
  minor=${minor%%.*}
  # Both packages answer `/version` and `--version`; unstamped they say v0.0.0-master. The proxy does
  # not say which commit a tag is, so gitCommit is left empty rather than made up.
  for package in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X $package.gitVersion=$KUBE_VERSION -X $package.gitMajor=$major -X $package.gitMinor=$minor"
    flags+=" -X $package.gitCommit= -X $package.gitTreeState=clean -X $package.buildDate=$build_date"
  done
  printf '%s\n' "$flags"
}

build_kube() {
  local bin_dir="$DRA_CACHE_DIR/k8s-$KUBE_VERSION/bin" module_dir stamp program ldflags=
  module_dir=$(kube_module_dir)
  stamp=$(build_stamp "kube $KUBE_VERSION" "$module_dir/go.mod" "$module_dir/go.sum")
  for program in "${KUBE_PROGRAMS[@]}"; do
    if ! is_fresh "$program" "$bin_dir" "$stamp"; then
      [[ -n $ldflags ]] || ldflags=$(kube_ldflags)
      build_program "$program" "$bin_dir" "$stamp" "$module_dir" "k8s.io/kubernetes/cmd/$program" "$ldflags"
    fi
  done
  emit KUBE_VERSION "$KUBE_VERSION" KUBE_BIN_DIR "$bin_dir"
}

build_harness() {
  [[ -d $HARNESS_SOURCES ]] || die "no kubelet harness sources in $HARNESS_SOURCES"
  local bin_dir="$DRA_CACHE_DIR/k8s-$KUBE_VERSION/bin" module_dir stamp
  module_dir=$(kube_module_dir)
  if [[ $module_dir != "$HACK_DIR/kube" ]] && ! diff -rq "$HARNESS_SOURCES" "$module_dir/cmd/kubelet-harness" >/dev/null 2>&1; then
    require_go
    rm -rf "$module_dir/cmd/kubelet-harness"
    mkdir -p "$module_dir/cmd"
    cp -r "$HARNESS_SOURCES" "$module_dir/cmd/kubelet-harness"
    tidy_module "$module_dir" "kubelet-harness" >&2
  fi
  local sources
  mapfile -t sources < <(find "$module_dir/cmd/kubelet-harness" -type f | LC_ALL=C sort)
  stamp=$(build_stamp "harness $KUBE_VERSION" "$module_dir/go.mod" "$module_dir/go.sum" "${sources[@]}")
  build_program kubelet-harness "$bin_dir" "$stamp" "$module_dir" ./cmd/kubelet-harness "-s -w"
  emit KUBE_VERSION "$KUBE_VERSION" KUBE_BIN_DIR "$bin_dir"
}

build_etcd() {
  local bin_dir="$DRA_CACHE_DIR/etcd-$ETCD_VERSION/bin" module_dir stamp
  module_dir=$(wrapper_module_dir "$HACK_DIR/etcd" go.etcd.io/etcd/server/v3 "$ETCD_VERSION" \
    "$DRA_CACHE_DIR/etcd-$ETCD_VERSION/module" github.com/dra-driver/hack/etcd go.etcd.io/etcd/server/v3 \
    "$ETCD_VERSION" "" go.etcd.io/etcd/server/v3)
  stamp=$(build_stamp "etcd $ETCD_VERSION" "$module_dir/go.mod" "$module_dir/go.sum")
  build_program etcd "$bin_dir" "$stamp" "$module_dir" go.etcd.io/etcd/server/v3 "-s -w"
  emit ETCD_VERSION "$ETCD_VERSION" ETCD_BIN_DIR "$bin_dir"
}

# The kubelet gets a wrapper module of its own rather than joining hack/kube: it imports packages
# the control plane does not (their go.sum lines would change hack/kube/go.sum, and with it the
# build stamp of every cached control-plane binary), yet it resolves to the same k8s.io/kubernetes.
kubelet_module_dir() {
  wrapper_module_dir "$HACK_DIR/kubelet" k8s.io/kubernetes "$KUBE_VERSION" \
    "$DRA_CACHE_DIR/k8s-$KUBE_VERSION/kubelet-module" github.com/dra-driver/hack/kubelet k8s.io/kubernetes \
    "$KUBE_VERSION" "v0.${KUBE_VERSION#v1.}" k8s.io/kubernetes/cmd/kubelet
}

build_kubelet() {
  local bin_dir="$DRA_CACHE_DIR/k8s-$KUBE_VERSION/bin" module_dir stamp
  module_dir=$(kubelet_module_dir)
  stamp=$(build_stamp "kubelet $KUBE_VERSION" "$module_dir/go.mod" "$module_dir/go.sum")
  is_fresh kubelet "$bin_dir" "$stamp" ||
    build_program kubelet "$bin_dir" "$stamp" "$module_dir" k8s.io/kubernetes/cmd/kubelet "$(kube_ldflags)"
  emit KUBE_VERSION "$KUBE_VERSION" KUBE_BIN_DIR "$bin_dir"
}

containerd_module_dir() {
  wrapper_module_dir "$HACK_DIR/containerd" github.com/containerd/containerd/v2 "$CONTAINERD_VERSION" \
    "$DRA_CACHE_DIR/containerd-$CONTAINERD_VERSION/module" github.com/dra-driver/hack/containerd \
    github.com/containerd/containerd/v2 "$CONTAINERD_VERSION" "" \
    "${CONTAINERD_PROGRAMS[@]/#/github.com/containerd/containerd/v2/cmd/}"
}

build_containerd() {
  local bin_dir="$DRA_CACHE_DIR/containerd-$CONTAINERD_VERSION/bin" module_dir stamp program
  local version_package=github.com/containerd/containerd/v2/version
  module_dir=$(containerd_module_dir)
  stamp=$(build_stamp "containerd $CONTAINERD_VERSION $CONTAINERD_TAGS" "$module_dir/go.mod" "$module_dir/go.sum")
  # `containerd --version` and the CRI's runtime version say the release, not "v2.x+unknown".
  local ldflags="-s -w -X $version_package.Version=$CONTAINERD_VERSION -X $version_package.Revision="
  for program in "${CONTAINERD_PROGRAMS[@]}"; do
    is_fresh "$program" "$bin_dir" "$stamp" ||
      build_program "$program" "$bin_dir" "$stamp" "$module_dir" \
        "github.com/containerd/containerd/v2/cmd/$program" "$ldflags" "$CONTAINERD_TAGS"
  done
  emit CONTAINERD_VERSION "$CONTAINERD_VERSION" CONTAINERD_BIN_DIR "$bin_dir"
}

helm_module() { printf 'helm.sh/helm/%s\n' "${HELM_VERSION%%.*}"; }

helm_ldflags() {
  local module client_go major minor
  module=$(helm_module)
  # Helm's offline default for .Capabilities.KubeVersion follows the client-go it is built with.
  client_go=$(cd "$1" && go list -m -f '{{.Version}}' k8s.io/client-go)
  minor=${client_go#v0.}
  minor=${minor%%.*}
  major=1
  printf '%s\n' "-s -w -X $module/internal/version.version=$HELM_VERSION -X $module/internal/version.gitTreeState=clean
 -X $module/pkg/chartutil.k8sVersionMajor=$major -X $module/pkg/chartutil.k8sVersionMinor=$minor
 -X $module/pkg/lint/rules.k8sVersionMajor=$major -X $module/pkg/lint/rules.k8sVersionMinor=$minor" | tr -d '\n'
}

build_helm() {
  local bin_dir="$DRA_CACHE_DIR/helm-$HELM_VERSION/bin" module module_dir stamp
  module=$(helm_module)
  module_dir=$(wrapper_module_dir "$HACK_DIR/helm" "$module" "$HELM_VERSION" \
    "$DRA_CACHE_DIR/helm-$HELM_VERSION/module" github.com/dra-driver/hack/helm "$module" \
    "$HELM_VERSION" "" "$module/cmd/helm")
  stamp=$(build_stamp "helm $HELM_VERSION" "$module_dir/go.mod" "$module_dir/go.sum")
  is_fresh helm "$bin_dir" "$stamp" ||
    build_program helm "$bin_dir" "$stamp" "$module_dir" "$module/cmd/helm" "$(helm_ldflags "$module_dir")"
  emit HELM_VERSION "$HELM_VERSION" HELM_BIN_DIR "$bin_dir"
}

update_wrappers() {
  require_go
  local wanted=" ${*:-kube etcd helm kubelet containerd} "
  [[ $wanted == *" kube "* ]] && write_wrapper_module "$HACK_DIR/kube" github.com/dra-driver/hack/kube k8s.io/kubernetes "$KUBE_VERSION" \
    "v0.${KUBE_VERSION#v1.}" "${KUBE_PROGRAMS[@]/#/k8s.io/kubernetes/cmd/}"
  [[ $wanted == *" etcd "* ]] && write_wrapper_module "$HACK_DIR/etcd" github.com/dra-driver/hack/etcd go.etcd.io/etcd/server/v3 \
    "$ETCD_VERSION" "" go.etcd.io/etcd/server/v3
  [[ $wanted == *" helm "* ]] && write_wrapper_module "$HACK_DIR/helm" github.com/dra-driver/hack/helm "$(helm_module)" \
    "$HELM_VERSION" "" "$(helm_module)/cmd/helm"
  [[ $wanted == *" kubelet "* ]] && write_wrapper_module "$HACK_DIR/kubelet" github.com/dra-driver/hack/kubelet k8s.io/kubernetes "$KUBE_VERSION" \
    "v0.${KUBE_VERSION#v1.}" k8s.io/kubernetes/cmd/kubelet
  [[ $wanted == *" containerd "* ]] && write_wrapper_module "$HACK_DIR/containerd" github.com/dra-driver/hack/containerd \
    github.com/containerd/containerd/v2 "$CONTAINERD_VERSION" "" \
    "${CONTAINERD_PROGRAMS[@]/#/github.com/containerd/containerd/v2/cmd/}"
  return 0
}

main() {
  mkdir -p "$DRA_CACHE_DIR"
  # One build at a time per cache and Kubernetes release: the tests, make and the demo may all ask
  # at once, and a test run against one release need not wait for another release's build
  # (hack/e2e-versions.sh). Binaries shared between releases have a lock of their own (build_program).
  local lock_fd
  exec {lock_fd}>"$DRA_CACHE_DIR/.build-$KUBE_VERSION.lock"
  if ! flock -n "$lock_fd"; then
    log "waiting for another hack/build-kube.sh using $DRA_CACHE_DIR to finish"
    flock "$lock_fd"
  fi

  if [[ ${1:-} == --update-wrappers ]]; then
    shift
    update_wrappers "$@"
    return
  fi
  local components=("$@")
  if ((${#components[@]} == 0)); then
    components=(kube etcd helm)
    [[ -d $HARNESS_SOURCES ]] && components+=(harness)
  fi
  local component
  for component in "${components[@]}"; do
    case $component in
    kube) build_kube ;;
    harness) build_harness ;;
    etcd) build_etcd ;;
    helm) build_helm ;;
    kubelet) build_kubelet ;;
    containerd) build_containerd ;;
    *) die "unknown component '$component'; choose from: kube harness etcd helm kubelet containerd" ;;
    esac
  done
  for component in "${!RESULTS[@]}"; do printf '%s=%s\n' "$component" "${RESULTS[$component]}"; done | LC_ALL=C sort
}

main "$@"
