#!/usr/bin/env bash
# The main job: every available section on bundled data, written to a report folder.
#   bash scripts/demo.sh [explain demo arguments, e.g. --out DIR --quick]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup-env.sh" ""
cd "$root"
exec "${EXPLAIN_VENV:-$root/.venv}/bin/explain" demo "$@"
