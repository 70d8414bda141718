#!/usr/bin/env bash
# Create .venv and install the package with its development tools, from the project's own files.
# Every dependency comes from the lock, requirements/dev.txt, with its hashes required: pip refuses a
# file whose sha256 is not the one locked, and anything the lock does not pin. The project itself is
# installed editable on top, without dependencies (make lock regenerates the lock).
# Re-runs are cheap: pip is only invoked when pyproject.toml or a lock file changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "error: Python 3.11 or newer is needed (found: $("$python" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.installed-$(cat pyproject.toml requirements/runtime.txt requirements/dev.txt | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  echo ">> installing the locked dependencies (requirements/dev.txt) and the package into .venv" >&2
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps \
    -r requirements/dev.txt
  # The build backend is the locked one in .venv: no isolated build environment fetching unhashed
  # setuptools.
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
  rm -f .venv/.installed-*
  touch "$stamp"
fi
