#!/usr/bin/env bash
# The main job: every available section on bundled data, written to a report folder
# (demo-output/report.html with its pictures, report.md and summary.json).
#   bash scripts/demo.sh [explain demo arguments, e.g. --out DIR --quick --no-cache]
# Installs the extras the demo needs: data (the digits), metrics (SSIM), plots, capsules
# (compaction), graphs (parse-tree pictures; setup-env.sh also installs graphviz's dot program
# where it can) and onnx (export parity and latency), i.e. `all`. Where the gpu extra
# (onnxruntime-gpu) is already installed, it is kept instead of onnx: both provide onnxruntime.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${EXPLAIN_VENV:-$root/.venv}
extras=all
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c \
    "import importlib.metadata as m; m.version('onnxruntime-gpu')" >/dev/null 2>&1; then
    extras=data,metrics,plots,capsules,graphs,gpu
fi
bash "$root/scripts/setup-env.sh" "$extras"
cd "$root"
exec "$venv/bin/explain" demo "$@"
