"""What the SGLang backend reads from SGLang: our config from the extra config, and page keys.

**Config.** SGLang hands its ``--hicache-storage-backend-extra-config`` JSON to the backend as
``HiCacheStorageConfig.extra_config``. :func:`load_hicache_config` builds our
:class:`LMCacheEngineConfig` from it: the YAML named by ``config_file`` (else
``$LMCACHE_CONFIG_FILE``), then ``LMCACHE_<KEY>`` env vars, then every other key of the extra
config that is a config key (inline keys win). The factory's own keys (``backend_name``,
``module_path``, ``class_name``, ``interface_v1``) and ours (``config_file``, ``namespace``) are
taken out first; any other unknown key is logged once and dropped.

**Keys.** One record per page, keyed by SGLang's page hash inside a namespace
(:class:`PageNamespace`): the model (``namespace`` from the extra config, else SGLang's
``model_name``), the TP size and rank (MLA: a page is the same on every rank, so the rank is
0 and the size 1 — one writer, :attr:`HiCacheStorageConfig.is_storage_writer`), pipeline and
context-parallel shards when there are several, the page size, the KV dtype and the record's
byte order (:attr:`HostPoolPages.record_order`). The page hash itself is in the key twice: as
the 64-bit ``chunk_hash`` (first 8 bytes of its SHA-256, :func:`stable_u64_from_str`) and in
full as a tag, so two pages never share a record even if their 64-bit hashes collide.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_async.config import CONFIG_FILE_ENV, LMCacheEngineConfig, load_engine_config
from lmcache_async.keys import TAG_PREFIX, CacheEngineKey, stable_u64_from_str
from lmcache_async.metadata import LMCacheEngineMetadata

logger = logging.getLogger(__name__)

__all__ = [
    "CONFIG_FILE_KEY",
    "FACTORY_KEYS",
    "NAMESPACE_KEY",
    "SOURCE",
    "PageNamespace",
    "load_hicache_config",
]

SOURCE = "hicache_storage_backend_extra_config"
CONFIG_FILE_KEY = "config_file"
"""Extra-config key naming a YAML config file (else ``$LMCACHE_CONFIG_FILE``)."""
NAMESPACE_KEY = "namespace"
"""Extra-config key pinning the model identity of keys (default: SGLang's ``model_name``)."""
FACTORY_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
"""Keys SGLang's storage factory reads from the same extra config."""

_warned_unknown: set[str] = set()


def load_hicache_config(extra_config: Mapping[str, Any] | None) -> LMCacheEngineConfig:
    """Our engine config from SGLang's extra config (see the module docstring).

    ``TypeError`` when ``extra_config`` is not a mapping or ``config_file`` not a path; invalid
    values raise the config's error naming the key and ``hicache_storage_backend_extra_config``.
    """
    if extra_config is not None and not isinstance(extra_config, Mapping):
        raise TypeError(f"extra_config must be a mapping, got {type(extra_config).__name__}")
    extra = {k: v for k, v in (extra_config or {}).items() if k not in FACTORY_KEYS and k != NAMESPACE_KEY}
    path = extra.pop(CONFIG_FILE_KEY, None)
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{SOURCE}[{CONFIG_FILE_KEY!r}] must be a path, got {type(path).__name__}")
    config = load_engine_config(path if path else os.environ.get(CONFIG_FILE_ENV) or None)
    fields = LMCacheEngineConfig.model_fields
    for key, value in extra.items():
        if key in fields:
            config.set(key, value, SOURCE)
        elif key not in _warned_unknown:
            _warned_unknown.add(key)
            logger.warning("SGLang backend: unknown %s key %r dropped", SOURCE, key)
    return config


def _opt_int(cfg: Any, name: str, default: int) -> int:
    value = getattr(cfg, name, default)
    return default if value is None else int(value)


@dataclass(frozen=True)
class PageNamespace:
    """The identity every page key of one backend shares (see the module docstring).

    Build it with :meth:`from_storage_config` once the host pool is known. :meth:`key` is
    thread-safe (the object is immutable).
    """

    model_name: str
    world_size: int
    worker_id: int
    dtype: torch.dtype
    scope: str
    """``<record order>.p<page size>`` plus ``.pp<rank>of<size>`` / ``.cp<rank>of<size>`` shards."""

    @classmethod
    def from_storage_config(
        cls,
        storage_config: Any,
        *,
        record_order: str,
        page_size: int,
        dtype: torch.dtype,
        is_mla: bool,
        namespace: str | None = None,
    ) -> PageNamespace:
        """The namespace of a backend built with SGLang's ``HiCacheStorageConfig``.

        ``namespace`` (the extra config's ``namespace``) overrides SGLang's ``model_name``;
        without either the model is ``"sglang"``. ``ValueError`` for an empty namespace.
        """
        model = namespace if namespace is not None else getattr(storage_config, "model_name", None)
        if model is None:
            model = "sglang"
        if not isinstance(model, str) or not model:
            raise ValueError(f"{SOURCE}[{NAMESPACE_KEY!r}] must be a non-empty string, got {model!r}")
        tp_rank = _opt_int(storage_config, "tp_rank", 0)
        tp_size = _opt_int(storage_config, "tp_size", 1)
        if is_mla:
            # MLA's latent KV is the same on every TP rank: one record per page for all ranks.
            tp_rank, tp_size = 0, 1
        scope = f"{record_order}.p{page_size}"
        pp_size = _opt_int(storage_config, "pp_size", 1)
        if pp_size > 1:
            scope += f".pp{_opt_int(storage_config, 'pp_rank', 0)}of{pp_size}"
        cp_size = _opt_int(storage_config, "attn_cp_size", 1)
        if cp_size > 1:
            scope += f".cp{_opt_int(storage_config, 'attn_cp_rank', 0)}of{cp_size}"
        return cls(model, tp_size, tp_rank, dtype, scope)

    def key(self, page_hash: str) -> CacheEngineKey:
        """The key of the page SGLang names ``page_hash``; ``TypeError`` for a non-string,
        ``ValueError`` for an empty one."""
        if type(page_hash) is not str:
            raise TypeError(f"page keys must be str, got {type(page_hash).__name__}")
        if not page_hash:
            raise ValueError("page keys must be non-empty strings")
        return CacheEngineKey(
            self.model_name,
            self.world_size,
            self.worker_id,
            stable_u64_from_str(page_hash),
            self.dtype,
            {TAG_PREFIX + "sglang": self.scope, TAG_PREFIX + "page": page_hash},
        )

    def metadata(self) -> LMCacheEngineMetadata:
        """Engine metadata of this identity (what tiers use for their own namespaces)."""
        return LMCacheEngineMetadata(
            model_name=self.model_name, world_size=self.world_size, worker_id=self.worker_id, kv_dtype=self.dtype
        )
