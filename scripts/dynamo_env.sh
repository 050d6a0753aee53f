#!/usr/bin/env bash
# Create (or reuse) the virtual environment in which NVIDIA Dynamo's KV router index runs for the
# KV-event agreement test (tests/events, `nox -s events`).
#
# The `ai-dynamo-runtime` wheel runs on CPU but pins pydantic <= 2.13.5, so it lives apart from
# vLLM's and the project's environments: the test records an event stream with the project, then
# replays it here with a standalone script run by this venv's python (`lmcache_async.events` is
# not imported here). Only the runtime wheel is installed.
#
# Usage: scripts/dynamo_env.sh [VENV_DIR]
#   default VENV_DIR: ~/.cache/lmcache-async/dynamo-venv-<hash of the pins below>
# Exit status: 0 when `from dynamo._core import RadixTree, compute_block_hash_for_seq` works in
# the venv afterwards, non-zero otherwise. The last line on stdout is the venv's python.
set -euo pipefail

PY="${PYTHON:-python3}"
DYNAMO="${DYNAMO_ENV_RUNTIME:-ai-dynamo-runtime==1.6.1}"

PINS="$DYNAMO"
if [ "$#" -ge 1 ]; then
  VENV="$1"
else
  HASH="$(printf '%s' "$PINS" | sha256sum | cut -c1-12)"
  VENV="${HOME}/.cache/lmcache-async/dynamo-venv-${HASH}"
fi

check() {
  "$VENV/bin/python" -c "from dynamo._core import RadixTree, compute_block_hash_for_seq" >/dev/null 2>&1
}

if [ ! -x "$VENV/bin/python" ] || ! check; then
  mkdir -p "$(dirname "$VENV")"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  # pip's output goes to stderr so that the last line on stdout stays the venv's python.
  "$VENV/bin/python" -m pip install -q "$DYNAMO" 1>&2
fi
check
echo "$VENV/bin/python"
