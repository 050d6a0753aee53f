#!/usr/bin/env bash
# Create (or refresh) the virtual environment in which the real-vLLM connector test runs.
#
# vLLM's wheel pins a CUDA build of torch, so it is installed with --no-deps next to the CPU
# torch, followed by the small packages its import and a real VllmConfig need. The
# environment (about 3 GiB) is kept apart from the project's main venv on purpose.
#
# Usage: scripts/vllm_env.sh [VENV_DIR]      (default: .venv-vllm at the repository root)
# Exit status: 0 when `import vllm` works in the venv afterwards, non-zero otherwise.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3}"
TORCH="${VLLM_ENV_TORCH:-torch==2.13.0}"
VLLM="${VLLM_ENV_VLLM:-vllm==0.33.0}"

# Packages vLLM 0.33.0 needs to import its EC connector API and build a VllmConfig on CPU.
DEPS=(
  "numpy" "packaging" "psutil" "pyzmq" "urllib3" "regex" "pydantic" "cbor2" "transformers"
  "aiohttp" "requests" "openai-harmony" "openai" "pillow" "pybase64" "cachetools"
  "msgspec" "cloudpickle" "uvloop" "py-cpuinfo" "prometheus_client" "xgrammar" "fastapi"
  "partial-json-parser" "llguidance" "pyyaml" "sentencepiece" "tqdm" "einops"
)

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q)

source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/pip_filter.sh"  # resolver_filter
pip_install() {
  { "${PIP[@]}" "$@" 2>&1 1>&3 3>&- | resolver_filter >&2; } 3>&1
}

pip_install --upgrade pip >/dev/null 2>&1 || true
pip_install "$TORCH"
if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  pip_install --no-deps "$VLLM"
fi
pip_install "${DEPS[@]}"
# The project itself (editable) plus what its tests need.
pip_install -e "$ROOT[test]"
# The benchmark suite (its own distribution) for the suites that run in this environment.
pip_install --no-deps -e "$ROOT/bench"
# A --no-deps install may still have pulled nothing CUDA-specific; check that the CPU torch
# survived and that vLLM imports.
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'PYEOF'
import torch, vllm
print(f"vllm {vllm.__version__} with torch {torch.__version__} ready")
PYEOF
