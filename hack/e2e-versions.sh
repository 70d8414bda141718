#!/usr/bin/env bash
# Runs the e2e tests against each older supported Kubernetes release, KUBE_MATRIX_VERSIONS in
# hack/versions.env (the pinned KUBE_VERSION is what `make e2e` runs). Each release's control plane and
# kubelet harness are built into the version-keyed cache first, only when missing (hack/build-kube.sh;
# about 15 minutes per release on two cores, cold), so no test waits on a build.
#
# Usage: hack/e2e-versions.sh [--subset] [PYTEST-ARGS...]
#   --subset  only the tests marked kube_versions: the CI-sized subset `make test` runs
#   default   the whole e2e suite but e2e/real_node (which runs the pinned release's real kubelet)
# e.g. KUBE_MATRIX_VERSIONS=v1.34.4 hack/e2e-versions.sh -x -k admin
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=versions.env
source hack/versions.env
PYTHON=${PYTHON:-.venv/bin/python}

selection=(e2e --ignore=e2e/real_node)
if [[ ${1:-} == --subset ]]; then
  selection+=(-m kube_versions)
  shift
fi

failed=()
for version in $KUBE_MATRIX_VERSIONS; do
  printf '==> Kubernetes %s: building what is missing\n' "$version" >&2
  started=$SECONDS
  KUBE_VERSION=$version hack/build-kube.sh kube harness etcd >/dev/null
  printf '    built in %ds; pytest %s\n' $((SECONDS - started)) "${selection[*]} $*" >&2
  started=$SECONDS
  KUBE_VERSION=$version "$PYTHON" -m pytest "${selection[@]}" "$@" || failed+=("$version")
  printf '    Kubernetes %s: tests took %ds\n' "$version" $((SECONDS - started)) >&2
done
if ((${#failed[@]} > 0)); then
  printf 'e2e-versions: tests failed against Kubernetes %s\n' "${failed[*]}" >&2
  exit 1
fi
