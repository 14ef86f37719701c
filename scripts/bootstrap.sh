#!/usr/bin/env bash
# Set up Spark from a clean clone: a virtualenv in .venv, Spark itself, and the patched
# llama-cpp-python build (cached in $SPARK_HOME, default ~/.cache/spark). Idempotent: a
# second run takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
.venv/bin/python scripts/build_native.py --venv .venv
