"""A test connector: our connector plus measurement and fault injection inside real vLLM.

Loaded by vLLM with ``ec_connector_module_path="probe_connector"`` (``tests/e2e`` on
``PYTHONPATH``). ``LMCACHE_E2E_PROBE`` holds a JSON object:

* ``out``: a file the scheduler-side connector rewrites after every step with its counters and
  the time its scheduler hooks took per step;
* ``delete_promised``: delete the disk records of the items promised this step right after the
  metadata is built (the window between ``has_cache_item`` and the worker's load);
* ``delete_promised_server``: a cache-server socket; remove the entries of the items promised
  this step from that server (through a client of its own) right after the metadata is built;
* ``blocking``: do not forward ``ensure_cache_available`` (the connector then looks items up
  synchronously in ``has_cache_item``, as with vLLM releases without that hook).
"""

from __future__ import annotations

import gc
import json
import os
import time
from typing import Any

from lmcache_async.integration.vllm import LMCacheECConnector

_SETTINGS: dict[str, Any] = json.loads(os.environ.get("LMCACHE_E2E_PROBE", "{}") or "{}")


class ProbeECConnector(LMCacheECConnector):
    """See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._step_s = 0.0
        self._steps: list[float] = []
        self._slowest: list[tuple[float, str, int]] = []  # (seconds, hook, collections during it)
        self._deleted = 0
        self._collections = 0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._collections += 1

    def _timed(self, fn: Any, *args: Any) -> Any:
        collections = self._collections
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            dt = time.perf_counter() - t0
            self._step_s += dt
            if dt > 2e-4:
                self._slowest.append((dt, getattr(fn, "__name__", "?"), self._collections - collections))
                self._slowest = sorted(self._slowest, reverse=True)[:10]

    def has_cache_item(self, identifier: str) -> bool:
        return bool(self._timed(super().has_cache_item, identifier))

    def ensure_cache_available(self, request: Any, num_computed_tokens: int = 0, *args: Any, **kw: Any) -> bool:
        if _SETTINGS.get("blocking"):
            return True
        return bool(self._timed(super().ensure_cache_available, request, num_computed_tokens))

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        self._timed(super().update_state_after_alloc, request, index)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = self._timed(super().build_connector_meta, scheduler_output)
        if self._step_s > 0:
            self._steps.append(self._step_s)
        self._step_s = 0.0
        if _SETTINGS.get("delete_promised") and meta.mm_hashes:
            from lmcache_async.disk.layout import entry_path, key_digest

            root = os.path.abspath(self.impl.engine.config.local_disk or "")
            for h in meta.mm_hashes:
                try:
                    os.unlink(entry_path(root, key_digest(self.impl.engine.key(h).to_string())))
                    self._deleted += 1
                except OSError:
                    pass
        server_socket = _SETTINGS.get("delete_promised_server")
        if server_socket and meta.mm_hashes:
            from lmcache_async.server.client import ServerClient

            cfg = self.impl.engine.config
            client = ServerClient(server_socket, cfg.cache_server_namespace or "default", timeout_s=10.0)
            removed = client.remove([self.impl.engine.key(h).to_string().encode() for h in meta.mm_hashes])
            self._deleted += sum(bool(r) for r in removed or ())
            client.close()
        out = _SETTINGS.get("out")
        if out and self.role.name == "SCHEDULER":
            stats = self.impl.stats()
            stats.pop("engine", None)
            data = {
                "steps_s": self._steps,
                "slowest": self._slowest,
                "deleted": self._deleted,
                "stats": stats,
                "pid": os.getpid(),
            }
            tmp = f"{out}.tmp"
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, out)
        return meta
