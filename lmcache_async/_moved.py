"""Module paths that moved in 0.2.0, kept importable for one release (see CHANGELOG.md,
"Deprecation policy").

Importing an old path (``lmcache_async.backends.disk``, ``lmcache_async.integration.vllm.kv_connector``,
``lmcache_async.cli_bench``, ...) warns with a ``DeprecationWarning`` naming the new path and
yields the very module object the new path names (same classes, same module state), so
``isinstance`` checks and patches keep working. :func:`install` puts the finder first on
``sys.meta_path`` once; :mod:`lmcache_async` calls it on import. The old paths go away in 0.3.0.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Final

__all__ = ["MOVED", "OLD_PACKAGES", "install"]

MOVED: Final[dict[str, str]] = {
    "lmcache_async.backends.cpu": "lmcache_async.cpu.tier",
    "lmcache_async.backends.disk": "lmcache_async.disk.tier",
    "lmcache_async.backends.disk_budget": "lmcache_async.disk.budget",
    "lmcache_async.backends.disk_layout": "lmcache_async.disk.layout",
    "lmcache_async.backends.disk_leases": "lmcache_async.disk.leases",
    "lmcache_async.backends.disk_store": "lmcache_async.disk.store",
    "lmcache_async.backends.disk_tools": "lmcache_async.disk.tools",
    "lmcache_async.backends.keys_tool": "lmcache_async.cli.keys",
    "lmcache_async.backends.nixl": "lmcache_async.nixl.tier",
    "lmcache_async.backends.nixl_agent": "lmcache_async.nixl.agent",
    "lmcache_async.backends.nixl_index": "lmcache_async.nixl.index",
    "lmcache_async.backends.nixl_io": "lmcache_async.nixl.io",
    "lmcache_async.backends.nixl_jobs": "lmcache_async.nixl.jobs",
    "lmcache_async.backends.nixl_transfer": "lmcache_async.nixl.transfer",
    "lmcache_async.backends.nixl_work": "lmcache_async.nixl.work",
    "lmcache_async.backends.remote": "lmcache_async.remote",
    "lmcache_async.backends.remote.checks": "lmcache_async.remote.checks",
    "lmcache_async.backends.remote.cluster": "lmcache_async.remote.cluster",
    "lmcache_async.backends.remote.codec": "lmcache_async.remote.codec",
    "lmcache_async.backends.remote.connector": "lmcache_async.remote.connector",
    "lmcache_async.backends.remote.fs": "lmcache_async.remote.fs",
    "lmcache_async.backends.remote.mooncake": "lmcache_async.remote.mooncake",
    "lmcache_async.backends.remote.mooncake_calls": "lmcache_async.remote.mooncake_calls",
    "lmcache_async.backends.remote.mooncake_record": "lmcache_async.remote.mooncake_record",
    "lmcache_async.backends.remote.mooncake_store": "lmcache_async.remote.mooncake_store",
    "lmcache_async.backends.remote.naming": "lmcache_async.remote.naming",
    "lmcache_async.backends.remote.redis_conn": "lmcache_async.remote.redis_conn",
    "lmcache_async.backends.remote.redis_internals": "lmcache_async.remote.redis_internals",
    "lmcache_async.backends.remote.redis_wire": "lmcache_async.remote.redis_wire",
    "lmcache_async.backends.remote.s3": "lmcache_async.remote.s3",
    "lmcache_async.backends.remote.url": "lmcache_async.remote.url",
    "lmcache_async.backends.server_leases": "lmcache_async.server.leases",
    "lmcache_async.backends.server_tier": "lmcache_async.server.tier",
    "lmcache_async.cli_bench": "lmcache_async.cli.bench",
    "lmcache_async.cli_progress": "lmcache_async.cli.progress",
    "lmcache_async.demo": "lmcache_async.cli.demo",
    "lmcache_async.demo_ec": "lmcache_async.cli.demo_ec",
    "lmcache_async.demo_hs": "lmcache_async.cli.demo_hs",
    "lmcache_async.front": "lmcache_async._manager.front",
    "lmcache_async.integration.vllm.connector": "lmcache_async.integration.vllm.ec.connector",
    "lmcache_async.integration.vllm.ec_config": "lmcache_async.integration.vllm.ec.config",
    "lmcache_async.integration.vllm.ec_counters": "lmcache_async.integration.vllm.ec.counters",
    "lmcache_async.integration.vllm.ec_engines": "lmcache_async.integration.vllm.ec.engines",
    "lmcache_async.integration.vllm.ec_scheduler": "lmcache_async.integration.vllm.ec.scheduler",
    "lmcache_async.integration.vllm.ec_server_leases": "lmcache_async.integration.vllm.ec.server_leases",
    "lmcache_async.integration.vllm.ec_vllm_objects": "lmcache_async.integration.vllm.ec.vllm_objects",
    "lmcache_async.integration.vllm.ec_worker": "lmcache_async.integration.vllm.ec.worker",
    "lmcache_async.integration.vllm.impl": "lmcache_async.integration.vllm.ec.impl",
    "lmcache_async.integration.vllm.kv_connector": "lmcache_async.integration.vllm.kv.connector",
    "lmcache_async.integration.vllm.kv_costs": "lmcache_async.integration.vllm.kv.costs",
    "lmcache_async.integration.vllm.kv_engine": "lmcache_async.integration.vllm.kv.store",
    "lmcache_async.integration.vllm.kv_event_reports": "lmcache_async.integration.vllm.kv.event_reports",
    "lmcache_async.integration.vllm.kv_events": "lmcache_async.integration.vllm.kv.events",
    "lmcache_async.integration.vllm.kv_gather": "lmcache_async.integration.vllm.kv.gather",
    "lmcache_async.integration.vllm.kv_groups": "lmcache_async.integration.vllm.kv.groups",
    "lmcache_async.integration.vllm.kv_hidden": "lmcache_async.integration.vllm.kv.hidden",
    "lmcache_async.integration.vllm.kv_hs_connector": "lmcache_async.integration.vllm.kv.hs_connector",
    "lmcache_async.integration.vllm.kv_hs_group": "lmcache_async.integration.vllm.kv.hs_group",
    "lmcache_async.integration.vllm.kv_layout": "lmcache_async.integration.vllm.kv.layout",
    "lmcache_async.integration.vllm.kv_lookup": "lmcache_async.integration.vllm.kv.lookup",
    "lmcache_async.integration.vllm.kv_metadata": "lmcache_async.integration.vllm.kv.metadata",
    "lmcache_async.integration.vllm.kv_metrics": "lmcache_async.integration.vllm.kv.metrics",
    "lmcache_async.integration.vllm.kv_request_keys": "lmcache_async.integration.vllm.kv.request_keys",
    "lmcache_async.integration.vllm.kv_scheduler": "lmcache_async.integration.vllm.kv.scheduler",
    "lmcache_async.integration.vllm.kv_worker": "lmcache_async.integration.vllm.kv.worker",
    "lmcache_async.integration.vllm.leases": "lmcache_async.integration.vllm.ec.leases",
    "lmcache_async.local_answers": "lmcache_async._manager.local_answers",
    "lmcache_async.loop_work": "lmcache_async._manager.loop_work",
    "lmcache_async.lower_tiers": "lmcache_async._manager.lower_tiers",
    "lmcache_async.manager_lifecycle": "lmcache_async._manager.lifecycle",
    "lmcache_async.manager_parts": "lmcache_async._manager.parts",
    "lmcache_async.manager_stats": "lmcache_async._manager.stats",
    "lmcache_async.put_path": "lmcache_async._manager.put_path",
    "lmcache_async.read_into": "lmcache_async._manager.read_into",
    "lmcache_async.staging": "lmcache_async._manager.staging",
    "lmcache_async.tier_access": "lmcache_async._manager.tier_access",
    "lmcache_async.tier_guard": "lmcache_async._manager.tier_guard",
    "lmcache_async.tier_stack": "lmcache_async._manager.tier_stack",
    "lmcache_async.where": "lmcache_async._manager.where",
    "lmcache_async.write_through": "lmcache_async._manager.write_through",
    "lmcache_async.config_check": "lmcache_async.config.check",
    "lmcache_async.record_files": "lmcache_async.records.files",
    "lmcache_async.record_sections": "lmcache_async.records.sections",
}
"""Old module path → the module that took its place."""

OLD_PACKAGES: Final = frozenset({"lmcache_async.backends"})
"""Old packages that no longer exist at all: importing one gives an empty package whose
submodules are the entries of :data:`MOVED`."""


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers for the old paths only; every other import goes on to the usual finders.

    The import system stamps the old path's spec on the module it loads (``__spec__``, always
    overwritten), which here is the new module itself: :meth:`exec_module` puts the module's own
    spec back, so its relative imports and ``__spec__.parent`` stay those of its new path."""

    def __init__(self) -> None:
        self._own_specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: object = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in MOVED or fullname in OLD_PACKAGES:
            return importlib.util.spec_from_loader(fullname, self, is_package=fullname in OLD_PACKAGES)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if spec.name in OLD_PACKAGES:
            package = types.ModuleType(spec.name, f"Deprecated: {spec.name} moved (see lmcache_async._moved).")
            package.__path__ = []
            return package
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes away in 0.3.0", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run (the module is the new one, already imported) but to give it back its
        own ``__spec__``, which loading it under the old path replaced."""
        stamped = module.__spec__
        if stamped is not None and stamped.name in self._own_specs:
            module.__spec__ = self._own_specs.pop(stamped.name)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent), so an old path never loads a
    second copy of a moved file through its old package."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
