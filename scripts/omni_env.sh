#!/usr/bin/env bash
# Create (or refresh) the virtual environment in which the vLLM-Omni stage-connector tests run.
#
# vllm-omni 0.30.0 imports names that only vLLM 0.30 has, and both wheels pin CUDA builds, so
# vLLM and vLLM-Omni are installed with --no-deps next to the CPU torch, followed by the small
# packages the import of Omni's connector modules needs. The environment is kept apart from the
# project's main venv and from the vLLM 0.33 venv on purpose.
#
# Usage: scripts/omni_env.sh [VENV_DIR]
#   default VENV_DIR: ~/.cache/lmcache-async/omni-venv-<hash of the pins below>
# Exit status: 0 when OmniConnectorBase and OmniConnectorFactory import in the venv afterwards,
# non-zero otherwise. The last line on stdout is the venv's python.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
TORCH="${OMNI_ENV_TORCH:-torch==2.13.0}"
VLLM="${OMNI_ENV_VLLM:-vllm==0.30.0}"
OMNI="${OMNI_ENV_OMNI:-vllm-omni==0.30.0}"

# Packages the import of vllm_omni.distributed.omni_connectors needs (vllm_omni's package
# __init__ patches vLLM's engine classes and registers its HF configs on import).
DEPS=(
  "numpy" "packaging" "psutil" "pyzmq" "urllib3" "regex" "pydantic" "pydantic-settings" "cbor2"
  "transformers>=5.13,<5.15" "aiohttp" "requests" "openai-harmony" "openai" "pillow" "pybase64"
  "cachetools" "msgspec" "msgpack" "cloudpickle" "uvloop" "py-cpuinfo" "prometheus_client"
  "fastapi" "partial-json-parser" "pyyaml" "sentencepiece" "tqdm" "einops" "aenum" "omegaconf"
  "janus" "blake3" "gguf" "setproctitle" "diskcache" "lark" "tiktoken" "depyf" "watchfiles"
  "python-json-logger" "ijson" "mistral_common" "compressed-tensors" "lm-format-enforcer"
  "outlines_core" "xgrammar" "llguidance" "scipy" "safetensors" "prettytable"
)

PINS="$TORCH $VLLM $OMNI ${DEPS[*]}"
if [ "$#" -ge 1 ]; then
  VENV="$1"
else
  HASH="$(printf '%s' "$PINS" | sha256sum | cut -c1-12)"
  VENV="${HOME}/.cache/lmcache-async/omni-venv-${HASH}"
fi

if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q)

source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/pip_filter.sh"  # resolver_filter
# pip's stdout goes to stderr so that the last line on stdout stays the venv's python.
pip_install() {
  { "${PIP[@]}" "$@" 2>&1 1>&3 3>&- | resolver_filter >&2; } 3>&2
}

pip_install --upgrade pip >/dev/null 2>&1 || true
pip_install "$TORCH"
if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  pip_install --no-deps "$VLLM"
fi
if ! "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm_omni') is None)"; then
  pip_install --no-deps "$OMNI"
fi
pip_install "${DEPS[@]}"
# The project itself (editable) plus what its tests need.
pip_install -e "$ROOT[test]"
# The benchmark suite (its own distribution) for the suites that run in this environment.
pip_install --no-deps -e "$ROOT/bench"
# The CPU torch must have survived the --no-deps installs, and Omni's connector API must import.
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - >&2 <<'PYEOF'
import torch, vllm, vllm_omni
from vllm_omni.distributed.omni_connectors import OmniConnectorBase, OmniConnectorFactory  # noqa: F401
print(f"vllm-omni {vllm_omni.__version__} with vllm {vllm.__version__} and torch {torch.__version__} ready")
PYEOF
echo "$VENV/bin/python"
