#!/usr/bin/env bash
# Regenerates the hashed lock files every install of the project reads (make lock):
#   requirements/runtime.txt  pyproject.toml's dependencies: the driver's image installs these
#   requirements/dev.txt      the same pins, plus the dev extra, pip and the build backend
#                             (requirements/build.in): make venv and CI install these
# Every pin carries the sha256 of each of its files on PyPI; installs pass --require-hashes, so a
# file that differs from the one locked is refused. Existing pins are kept while they still satisfy
# pyproject.toml; `hack/lock.sh --upgrade` moves every pin to the newest version allowed.
# Resolved with the Python that runs it (3.11, the image's), for linux x86_64.
# hack/check-lock.py (make gen-check) fails when pyproject.toml asks for something the lock lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
upgrade=()
case ${1:-} in
--upgrade) upgrade=(--upgrade) ;;
"") ;;
*) echo "usage: hack/lock.sh [--upgrade]" >&2 && exit 2 ;;
esac
[[ -x .venv/bin/pip-compile ]] || { echo "error: no .venv/bin/pip-compile; run make venv first" >&2 && exit 1; }
compile=(.venv/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links
  --resolver=backtracking "${upgrade[@]}")
# The header of each file names the command that regenerates it.
export CUSTOM_COMPILE_COMMAND="make lock"
"${compile[@]}" --output-file requirements/runtime.txt pyproject.toml
# The runtime pins constrain the dev lock, so the tests run exactly what the image ships.
"${compile[@]}" --extra dev --constraint requirements/runtime.txt --output-file requirements/dev.txt \
  pyproject.toml requirements/build.in
