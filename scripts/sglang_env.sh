#!/usr/bin/env bash
# Build (or reuse) the virtual environment in which the SGLang HiCache storage backend is tested.
#
# SGLang's wheel pins a long list of serving dependencies, so it is installed with --no-deps,
# followed by the packages that importing its HiCache storage interface, its storage-backend
# factory and its host KV pools needs. Its host-pool modules import sglang.srt.configs, which
# imports torchvision unconditionally; the registry's torchvision is built against the regular
# (CUDA-enabled) torch and fails to load beside the "+cpu" build (`torchvision::nms does not
# exist`). So this venv uses SGLang's own pin, the regular torch 2.14.1 with torchvision 0.29.1:
# both run on a machine without a GPU. The environment (about 5 GiB) is kept apart from the
# project's main venv on purpose.
#
# The venv lives under ~/.cache/lmcache-async/ and is named by a hash of the pins and of this
# recipe; a stamp file written after a successful build lets later runs reuse it. The project is
# reinstalled (editable) on every run so the tests always run this checkout.
#
# Usage: scripts/sglang_env.sh [VENV_DIR]   prints the venv's python path on the last line of stdout
# Env:   LMCACHE_SGLANG_REBUILD=1 forces a rebuild; PYTHON picks the interpreter for the venv.
# Exit status: 0 when SGLang's HiCache storage interface, storage factory and host pools import
# afterwards (`import sglang.srt.mem_cache.hicache_storage` and its neighbours), else non-zero.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
TORCH_PIN="${SGLANG_ENV_TORCH:-torch==2.14.1}"
TORCHVISION_PIN="${SGLANG_ENV_TORCHVISION:-torchvision==0.29.1}"
SGLANG_PIN="${SGLANG_ENV_SGLANG:-sglang==0.5.23}"
# What `sglang.srt.mem_cache.storage.backend_factory` imports (first line), and what its host KV
# pools (`sglang.srt.mem_cache.pool_host.mha`/`.mla`) import on top of it (second line).
DEPS=(
  "numpy" "orjson" "psutil" "pybase64" "requests" "triton" "packaging" "pillow" "starlette"
  "msgspec" "pydantic" "pyzmq" "tqdm" "IPython" "aiohttp"
  "transformers" "dill" "apache-tvm-ffi" "sentencepiece" "compressed-tensors" "gguf"
)
RECIPE=2  # bump when the steps below change
PY_VERSION="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
PINS="$SGLANG_PIN $TORCH_PIN $TORCHVISION_PIN ${DEPS[*]} python$PY_VERSION recipe$RECIPE"
HASH="$(printf '%s' "$PINS" | sha256sum | cut -c1-12)"
VENV="${1:-$HOME/.cache/lmcache-async/sglang-venv-$HASH}"
STAMP="$VENV/.lmcache-sglang-stamp"
VPY="$VENV/bin/python"

start=$SECONDS
log() { echo "[sglang_env] $*" >&2; }

source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/pip_filter.sh"  # resolver_filter
pip_install() {
  "$VPY" -m pip install -q "$@" 2>&1 | resolver_filter >&2
}

if [ "${LMCACHE_SGLANG_REBUILD:-0}" != "1" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PINS" ] \
   && [ -x "$VPY" ]; then
  log "reusing $VENV"
else
  start=$SECONDS
  log "building $VENV ($PINS)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  "$VPY" -m pip install -q --upgrade pip >&2 || true
  pip_install "$TORCH_PIN" "$TORCHVISION_PIN"
  pip_install --no-deps "$SGLANG_PIN"
  # torch is named again so the resolver keeps it while it adds the import deps.
  pip_install "${DEPS[@]}" "$TORCH_PIN" "$TORCHVISION_PIN"
  printf '%s' "$PINS" > "$STAMP.pending"
fi

# The project itself, editable, with what its tests need (cheap when already present).
pip_install -e "$ROOT[test]" "$TORCH_PIN" "$TORCHVISION_PIN"
# The benchmark suite (its own distribution) for the suites that run in this environment.
pip_install --no-deps -e "$ROOT/bench"

# Fail here, not in the tests, when SGLang's storage interface or its factory cannot be imported.
"$VPY" - >&2 <<'PYEOF'
import warnings

warnings.simplefilter("ignore")  # SGLang warns about GPU-only features on a CPU host
import torch
import sglang
import sglang.srt.mem_cache.hicache_storage  # noqa: F401
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: F401
import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
import lmcache_async
print(f"sglang {sglang.__version__} with torch {torch.__version__} and lmcache_async ready")
PYEOF
if [ -f "$STAMP.pending" ]; then
  mv "$STAMP.pending" "$STAMP"
  log "built in $((SECONDS - start)) s"
fi
echo "$VPY"
