#!/usr/bin/env bash
# The whole test suite, in the project's virtual environment (created or reused).
#   bash scripts/test.sh [pytest arguments]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup-env.sh" dev,graphs,onnx
cd "$root"
exec "${EXPLAIN_VENV:-$root/.venv}/bin/python" -m pytest "$@"
