#!/usr/bin/env bash
# Create (or refresh) the virtual environment in which LMCache 0.5.6 runs for the side-by-side
# benchmarks (`nox -s compare`, `python -m lmcache_async_bench.compare`).
#
# LMCache's wheel pins a CUDA build of torch, so it is installed with --no-deps next to the CPU
# torch, followed by the small packages its import needs. LMCache then runs on CPU with plain
# host memory. The project itself is NOT installed here: the LMCache side of the comparison is a
# standalone module executed by path with this venv's python.
#
# Usage: scripts/lmcache_env.sh [VENV_DIR]      (default: .venv-lmcache at the repository root)
# Environment: PYTHON (interpreter for the venv, default python3), LMCACHE_ENV_TORCH,
#              LMCACHE_ENV_LMCACHE (pip requirement strings).
# Exit status: 0 when `import lmcache.v1.ec_engine` works in the venv afterwards, non-zero otherwise.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$ROOT/.venv-lmcache}"
PY="${PYTHON:-python3}"
TORCH="${LMCACHE_ENV_TORCH:-torch==2.13.0}"
LMCACHE="${LMCACHE_ENV_LMCACHE:-lmcache==0.5.6}"

# What `import lmcache.v1...` needs on a CPU-only host (its full dependency list pulls CUDA).
DEPS=(
  "numpy<=2.2.6" "pyyaml" "cachetools" "numba" "requests" "sortedcontainers" "prometheus_client"
  "py-cpuinfo" "psutil" "aiohttp" "aiofile" "msgspec" "pyzmq" "transformers" "cryptography"
)

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" "$TORCH"
"${PIP[@]}" "${DEPS[@]}"
if ! "$VENV/bin/python" -c "import lmcache" >/dev/null 2>&1; then
  "${PIP[@]}" --no-deps "$LMCACHE"
fi
"$VENV/bin/python" - <<'PYEOF'
import torch
import lmcache
from lmcache.v1.ec_engine import ECCacheEngine  # noqa: F401
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: F401
print(f"lmcache {getattr(lmcache, '__version__', '?')} with torch {torch.__version__} ready")
PYEOF
