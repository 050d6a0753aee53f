"""The configuration model: :class:`LMCacheEngineConfig`, every key with its type, default,
bounds and description, its validators, and where each value came from.

The model converts (:mod:`lmcache_async.config.convert`) and loads
(:mod:`lmcache_async.config.load`) through those modules, imported when a method needs them
(they read the model's fields). :mod:`lmcache_async.config` is the public face.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, ValidationError, field_validator

from lmcache_async.config.keys import DEFAULT_TIER_ORDER, SIZE_FIELDS, strip_file_scheme
from lmcache_async.errors import ConfigError

__all__ = ["LMCacheEngineConfig"]


class LMCacheEngineConfig(BaseModel):
    """Every configuration key, validated. See ``docs/configuration.md`` for each key.

    Sizes are GiB (floats >= 0). Instances are mutable with validation on assignment; use
    :meth:`set` to record the source of a change and :meth:`clone` for an independent copy.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    # --- LMCache storage keys -----------------------------------------------------------------
    chunk_size: int = Field(256, gt=0, description="Tokens per KV/HS chunk.")
    local_cpu: bool = Field(True, description="Keep a CPU-memory tier.")
    max_local_cpu_size: float = Field(5.0, ge=0, description="CPU tier pool size (GiB).")
    local_disk: str | None = Field(None, description="Directory of the disk tier (file:// accepted).")
    max_local_disk_size: float = Field(
        0.0,
        ge=0,
        description="Disk tier budget for the directory (GiB), shared by its processes; <= 0 builds no disk tier.",
    )
    remote_url: str | None = Field(
        None,
        description="Remote tier URL (redis://, rediss://, unix://, valkey://, redis+cluster://, fs://, mooncake://).",
    )
    remote_serde: str | None = Field(
        "naive", description="Accepted for LMCache compatibility; records are always self-describing."
    )
    save_unfull_chunk: bool = Field(False, description="Also store a trailing partial chunk.")
    cache_policy: Literal["LRU", "FIFO"] = Field("LRU", description="Eviction order of every tier.")
    blocking_timeout_secs: float = Field(10.0, gt=0, description="Bound on one synchronous call (seconds).")
    enable_hidden_state_cache: bool = Field(False, description="Create the hidden-state store.")
    max_hidden_state_cpu_size: float = Field(2.0, ge=0, description="Hidden-state pool size (GiB, > 0 when enabled).")
    hidden_state_layers: list[int] | None = Field(
        None, description="Allowlist of layer_idx values the hidden-state store accepts."
    )
    nixl_backend: str = Field("POSIX", description="NIXL plugin: POSIX, GDS, GDS_MT, OBJ.")
    nixl_backends: list[str] | None = Field(None, description="LMCache spelling; the first entry sets nixl_backend.")
    nixl_path: str | None = Field(None, description="Directory of NIXL file-backed storage; enables the NIXL tier.")
    nixl_pool_size: int = Field(0, ge=0, description="Pre-created NIXL slot files (0 = one file per entry).")
    nixl_max_size: float = Field(16.0, ge=0, description="NIXL tier budget (GiB).")
    nixl_buffer_size: int | None = Field(None, description="Accepted for LMCache compatibility.")
    nixl_buffer_device: str | None = Field(None, description="Accepted for LMCache compatibility.")
    nixl_backend_params: dict[str, str] | None = Field(None, description="Parameters passed to the NIXL plugin.")
    extra_config: dict[str, Any] | None = Field(None, description="Free-form settings for backends and plugins.")
    # --- lmcache_async keys ---------------------------------------------------------------
    remote_timeout_s: float = Field(2.0, gt=0, description="Timeout of every remote/NIXL operation (seconds).")
    local_disk_fsync: Literal["none", "data", "full"] = Field(
        "none", description="Disk durability: none, data (fsync file), full (file + directory)."
    )
    tier_order: list[str] = Field(
        list(DEFAULT_TIER_ORDER), description="Order in which tiers are written and searched."
    )
    tiers: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Per-tier settings by tier name (built-ins map onto their flat keys; other tiers get them "
        "validated by their settings model); a tier named here is searched even when tier_order leaves it out.",
    )
    remote_key_prefix: str = Field("lmcache", description="Namespace prefix of remote keys.")
    remote_part_size: int = Field(
        1024 * 1024, gt=0, description="Remote payloads above this many bytes are split into parts."
    )
    remote_ttl_s: float | None = Field(None, gt=0, description="Optional expiry of remote entries (seconds).")
    ec_model_name: str | None = Field(
        None, description="Model identity in encoder-cache keys (default: vLLM's model_config.model)."
    )
    staging_size: float = Field(0.25, ge=0, description="Staging area for lower-tier reads (GiB).")
    hidden_state_storage_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Dtype hidden states are stored in; retrieve returns float32."
    )
    memory_reserve_size: float | None = Field(
        None, ge=0, description="Memory kept free when sizing pools (GiB; default: 5% of available, 0.5-2 GiB)."
    )
    executor_workers: int = Field(4, gt=0, le=256, description="Threads of each manager's I/O executor.")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Serve Prometheus metrics on this port.")
    metrics_host: str = Field("127.0.0.1", description="Address the metrics server binds (loopback by default).")
    remote_breaker_max_backoff_s: float = Field(
        4.0,
        gt=0,
        description="Longest wait between recovery probes of a failing lower tier (seconds); bounds recovery time.",
    )
    # --- KV connector: load or recompute ------------------------------------------------------
    load_policy: Literal["auto", "always", "never"] = Field(
        "auto",
        description="KV connector: load a cached prefix only when its measured load time beats recomputing it "
        "(auto), every hit (always), or nothing (never); a request's kv_transfer_params may override it.",
    )
    max_load_s: float | None = Field(
        None, gt=0, description="KV connector: most seconds one request's load may take (planned and enforced)."
    )
    load_margin: float = Field(
        0.1, ge=0, description="KV connector (auto): a load is kept when its time x (1 + margin) <= recompute time."
    )
    load_deadline_factor: float = Field(
        3.0, ge=1, description="KV connector: a load running this many times its expected time is abandoned."
    )
    load_cost_file: str | None = Field(
        None,
        description="KV connector: state file of measured load costs and prefill rate, kept across processes "
        "(default: <local_disk>.kv-costs.json beside the disk tier; none without one).",
    )
    # --- Mooncake Store tier (remote_url: mooncake://HOST:PORT, the master) ---------------------
    mooncake_metadata_server: str | None = Field(
        None,
        description="Mooncake metadata server (default: the master's HTTP one, http://<master host>:8080/metadata).",
    )
    mooncake_protocol: str = Field("tcp", description="Mooncake transfer protocol (tcp on CPU-only hosts, rdma).")
    mooncake_device_name: str = Field("", description="Mooncake RDMA device names (empty for tcp).")
    mooncake_local_hostname: str = Field(
        "127.0.0.1", description="Address this client's transfer engine binds and advertises."
    )
    mooncake_local_buffer_size: float = Field(0.0625, ge=0, description="Mooncake client transfer buffer (GiB).")
    mooncake_global_segment_size: float = Field(
        0.0, ge=0, description="Memory this client contributes to the store (GiB); 0 = a pure client."
    )
    mooncake_replica_num: int = Field(1, ge=1, description="Replicas of each object in the Mooncake store.")
    # --- object store tier (remote_url: s3://BUCKET/PREFIX) ----------------------------------------
    s3_endpoint: str | None = Field(None, description="S3 endpoint URL (None: AWS_ENDPOINT_URL, else AWS's own).")
    s3_region: str | None = Field(None, description="S3 region (None: AWS_REGION, AWS_DEFAULT_REGION, us-east-1).")
    s3_access_key_id: SecretStr | None = Field(
        None, description="S3 access key id (None: AWS_ACCESS_KEY_ID; neither: unsigned requests). Never printed."
    )
    s3_secret_access_key: SecretStr | None = Field(
        None, description="S3 secret access key (None: AWS_SECRET_ACCESS_KEY). Never printed."
    )
    s3_allow_http: bool = Field(False, description="Allow a plain-http S3 endpoint (a loopback test server).")
    s3_max_concurrency: int = Field(16, gt=0, description="Most S3 requests of one tier in flight at once.")
    # --- encryption at rest ---------------------------------------------------------------------
    encryption_key_file: str | None = Field(
        None,
        description="AES-256-GCM key file (mode 0600; 'lmcache-async keygen FILE'): seals every record written "
        "outside process memory (disk, fs://, Redis, S3, Mooncake, NIXL files); records under another key are misses, "
        "kept.",
    )
    # --- node cache server (lmcache-async serve; client tier "server") ---------------------------
    cache_server_socket: str | None = Field(
        None,
        description="Unix socket of the node cache server; enables the client tier 'server' (second in the default "
        "tier_order, after cpu).",
    )
    cache_server_namespace: str | None = Field(
        None, description="Namespace on the cache server (default: the metadata's model name, else 'default')."
    )
    cache_server_token: str | None = Field(
        None, description="Shared token a cache-server client must present (server and clients set the same)."
    )
    cache_server_lease_ttl_s: float = Field(
        30.0, gt=0, le=86400, description="Cache server: lifetime of a read lease or uncommitted grant (seconds)."
    )
    cache_server_max_leases: int = Field(
        4096, gt=0, description="Cache server: most leases one client process may hold (all its connections)."
    )
    cache_server_max_grants: int = Field(
        64, gt=0, description="Cache server: most uncommitted write grants one client may hold."
    )
    cache_server_max_namespaces: int = Field(8, gt=0, description="Cache server: most namespaces (one pool each).")
    cache_server_pretouch: bool = Field(
        True,
        description="Cache server: also fault each committed step of a namespace pool (pools grow as they "
        "fill) into the server's mapping, in the background.",
    )
    cache_server_namespaces: dict[str, dict[str, Any]] | None = Field(
        None,
        description="Cache server: namespaces bound to Unix users/groups and/or a token of their own "
        "({name: {uids: [..], gids: [..], token: ..}}); unbound namespaces admit the server's user and root.",
    )
    cache_server_max_holds: int = Field(4096, gt=0, description="Cache server: most holds in one namespace.")
    cache_server_max_client_holds: int = Field(
        1024, gt=0, description="Cache server: most live holds one client process may take (all its connections)."
    )
    cache_server_max_namespace_leases: int = Field(
        16384, gt=0, description="Cache server: most leases all clients of one namespace may hold at once."
    )
    cache_server_max_pinned_fraction: float = Field(
        0.5, gt=0, le=1, description="Cache server: share of a pool one client's leases, and all holds, may pin."
    )
    cache_server_namespace_idle_s: float = Field(
        900.0, gt=0, description="Cache server: a namespace with no client this long is released (pool freed)."
    )
    cache_server_max_connections: int = Field(
        1024, gt=0, description="Cache server: most connections at once (more are answered FULL)."
    )
    cache_server_idle_timeout_s: float = Field(
        3600.0, ge=0, description="Cache server: close a connection idle this long (0: never)."
    )
    cache_server_frame_timeout_s: float = Field(
        10.0, ge=0, description="Cache server: close a connection stalled inside a frame this long (0: never)."
    )
    cache_server_max_buffered_bytes: int = Field(
        64 << 20, gt=0, description="Cache server: bytes of partial frames all connections may hold together."
    )
    cache_server_remember_locations: bool = Field(
        True,
        description="Cache-server client: copy entries read before from where they lie, with no round trip, "
        "while the pool's version table shows them unchanged.",
    )
    cache_server_uid: int | None = Field(
        None,
        ge=0,
        description="Cache-server client: the uid the server may run as besides the client's own (checked with "
        "SO_PEERCRED before anything is sent; e.g. a server run by a service user).",
    )

    _sources: dict[str, str] = PrivateAttr(default_factory=dict)

    # ---- validators ------------------------------------------------------------------------
    @field_validator("cache_policy", mode="before")
    @classmethod
    def _upper_policy(cls, v: Any) -> Any:
        v = v.strip().upper() if isinstance(v, str) else v
        if v in ("LFU", "MRU"):
            raise ValueError(f"LMCache's {v} policy has no equal here: every tier evicts LRU or FIFO")
        return v

    @field_validator("nixl_backend", mode="before")
    @classmethod
    def _upper_nixl(cls, v: Any) -> Any:
        return v.strip().upper() if isinstance(v, str) else v

    @field_validator("local_disk", "nixl_path", mode="before")
    @classmethod
    def _paths(cls, v: Any) -> Any:
        return strip_file_scheme(v) if isinstance(v, str) else v

    @field_validator(*SIZE_FIELDS, "blocking_timeout_secs", "remote_timeout_s", "remote_breaker_max_backoff_s")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("tier_order")
    @classmethod
    def _tiers(cls, v: list[str]) -> list[str]:
        names = [t.strip().lower() for t in v]
        if not names or any(not n for n in names):
            raise ValueError("must list at least one tier name")
        if len(set(names)) != len(names):
            raise ValueError("must not repeat a tier")
        return names

    @field_validator("remote_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is None:
            return None
        v = v.strip()
        if not v:
            return None
        if "://" not in v:
            raise ValueError("must be a URL such as redis://host:port or fs:///shared/dir")
        return v

    # ---- sources -----------------------------------------------------------------------------
    def model_post_init(self, context: Any) -> None:
        for name in self.model_fields_set:
            self._sources.setdefault(name, "init")

    def source_of(self, key: str) -> str:
        """Where ``key``'s value came from: ``default``, ``init``, ``file <path>``, ``env VAR``, ..."""
        return self._sources.get(key, "default")

    def is_set(self, key: str) -> bool:
        """True when some source (not the default) set ``key``."""
        return key in self._sources

    def set(self, key: str, value: Any, source: str = "init") -> None:
        """Assign ``key`` (validated) and record ``source``; ``ConfigError`` when invalid."""
        from lmcache_async.config.convert import convert_value, format_error

        if key not in type(self).model_fields:
            raise ConfigError(f"unknown configuration key {key!r} (from {source})")
        try:
            setattr(self, key, convert_value(key, value, source))
        except ValidationError as exc:
            raise ConfigError(format_error(key, value, source, exc)) from None
        self._sources[key] = source

    def clone(self) -> LMCacheEngineConfig:
        """An independent deep copy (sources included)."""
        new = self.model_copy(deep=True)
        new._sources = dict(self._sources)
        return new

    def describe(self) -> list[tuple[str, Any, str]]:
        """``(key, value, source)`` for every key, in declaration order."""
        return [(k, getattr(self, k), self.source_of(k)) for k in type(self).model_fields]

    def to_dict(self) -> dict[str, Any]:
        """Plain values of every key."""
        return self.model_dump()

    # ---- loaders -----------------------------------------------------------------------------
    @classmethod
    def from_defaults(cls, **overrides: Any) -> LMCacheEngineConfig:
        """Defaults with ``overrides`` (validated; source ``init``).

        ``ConfigError`` naming the key for a key that is neither ours nor one of LMCache's keys
        without effect here (those are accepted with one warning each)."""
        from lmcache_async.config.load import build_config

        return build_config([(k, v, "init") for k, v in overrides.items()])

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> LMCacheEngineConfig:
        """Defaults overridden by the YAML file at ``path`` (no env)."""
        from lmcache_async.config.load import build_config, file_entries

        return build_config(file_entries(path))

    @classmethod
    def from_env(cls) -> LMCacheEngineConfig:
        """Defaults overridden by ``LMCACHE_<KEY>`` environment variables."""
        from lmcache_async.config.load import build_config, env_entries

        return build_config(env_entries(os.environ))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "dict") -> LMCacheEngineConfig:
        """Defaults overridden by ``data`` (unknown keys warned about and dropped; LMCache's keys
        without effect here accepted with one warning each)."""
        from lmcache_async.config.load import build_config, mapping_entries

        return build_config(mapping_entries(data, source))
