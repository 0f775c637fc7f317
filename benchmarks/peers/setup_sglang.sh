#!/usr/bin/env bash
# Build the virtual environment that runs sglang_host.py (SGLang 0.5.23 on a CPU).
#
#   benchmarks/peers/setup_sglang.sh VENV_DIR
#
# 1. torch==2.13.0, the CPU build (TORCH_REQUIREMENT overrides it: a wheel file, say);
# 2. sglang==0.5.23 with --no-deps: its declared dependencies are a GPU server's;
# 3. requirements-sglang.txt with --no-deps: exactly what the harness imports, pinned.
# Every pip call carries constraints.txt, so nothing can replace torch. triton and torchvision
# are not installed: import_stubs.py stands in for them. PYTHON picks the interpreter (3.11).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${1:?usage: setup_sglang.sh VENV_DIR}"
PYTHON="${PYTHON:-python3}"
TORCH_REQUIREMENT="${TORCH_REQUIREMENT:-torch==2.13.0}"
start=$SECONDS
say() { echo "[setup_sglang ${SECONDS}s] $*" >&2; }

if [ -e "$VENV" ]; then
    echo "setup_sglang.sh: $VENV exists; remove it or name another folder" >&2
    exit 1
fi
say "venv $VENV ($("$PYTHON" --version 2>&1))"
"$PYTHON" -m venv "$VENV"
pip_install() {  # quiet; pip's notes about unused local index folders are dropped
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q -c "$HERE/constraints.txt" \
        "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
    return "${PIPESTATUS[0]}"
}
say "$TORCH_REQUIREMENT"
pip_install "$TORCH_REQUIREMENT"
say "sglang==0.5.23 --no-deps"
pip_install --no-deps "sglang==0.5.23"
say "requirements-sglang.txt --no-deps"
pip_install --no-deps -r "$HERE/requirements-sglang.txt"
say "import check"
(cd "$HERE" && "$VENV/bin/python" - <<'PY'
import import_stubs
import torch

import_stubs.install()
import sglang
import sglang.srt.managers.scheduler  # noqa: F401  (the deepest import the harness makes)

assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
assert sglang.__version__ == "0.5.23", sglang.__version__
print(f"ok: torch {torch.__version__}, sglang {sglang.__version__}")
PY
)
say "smoke run of sglang_host.py (one tiny churned run)"
(cd "$HERE" && "$VENV/bin/python" sglang_host.py --iters 3 --warmup 1 \
    --repeats 1 --batch-sizes 2 --page-sizes 16 >/dev/null)
say "done in $((SECONDS - start)) s: $(du -sh "$VENV" | cut -f1)"
