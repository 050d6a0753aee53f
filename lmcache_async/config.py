"""Configuration: one pydantic model, YAML/env loaders and the encoder-cache overlay.

Precedence for the base config: defaults < ``LMCACHE_CONFIG_FILE`` YAML < ``LMCACHE_<KEY>`` env.
Every value remembers where it came from (``describe()``), and an invalid value raises one
:class:`~lmcache_async.errors.ConfigError` naming key, value and source. Loading reads files
synchronously: do it before any loop starts, never on a manager's loop.
"""

from __future__ import annotations

import ast
import difflib
import json
import logging
import math
import os
import types
import typing
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, ValidationError, field_validator

from lmcache_async.errors import ConfigError
from lmcache_async.tiers.registry import TIER_NAMES, flatten_tiers_section

logger = logging.getLogger(__name__)

ENV_PREFIX = "LMCACHE_"
EC_ENV_PREFIX = "LMCACHE_EC_"
CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"
DEFAULT_TIER_ORDER = TIER_NAMES  # the one list of built-in tier names (lmcache_async.tiers.registry)

# LMCache keys accepted from every source without acting on them: a migrating user's YAML and
# environment load unchanged, with one warning per key per load saying it has no effect here.
LMCACHE_KEYS_WITHOUT_EFFECT = frozenset(
    [
        "local_cpu_use_hugepages",
        "reserve_local_cpu_size",
        "local_disk_path_sharding",
        "use_layerwise",
        "save_decode_cache",
        "pre_caching_hash_algorithm",
        "enable_blending",
        "blend_recompute_ratios",
        "blend_thresholds",
        "blend_check_layers",
        "blend_min_tokens",
        "blend_special_str",
        "retrieve_locations",
        "store_location",
        "enable_p2p",
        "p2p_host",
        "p2p_init_ports",
        "p2p_lookup_ports",
        "mp_host",
        "mp_port",
        "enable_controller",
        "lmcache_instance_id",
        "controller_pull_url",
        "controller_reply_url",
        "lmcache_worker_ports",
        "lmcache_worker_ids",
        "lmcache_worker_heartbeat_delay_time",
        "lmcache_worker_heartbeat_time",
        "enable_pd",
        "pd_role",
        "pd_buffer_size",
        "pd_buffer_device",
        "pd_peer_host",
        "pd_peer_init_port",
        "pd_peer_alloc_port",
        "pd_peer_query_port",
        "pd_proxy_host",
        "pd_proxy_port",
        "pd_allocation_timeout_sec",
        "pd_shutdown_timeout_sec",
        "pd_condition_poll_interval_sec",
        "pd_max_prefill_len",
        "pd_backend_mode",
        "pd_skip_proxy_notification",
        "pd_bidirectional",
        "transfer_channel",
        "gds_path",
        "gds_path_sharding",
        "gds_buffer_size",
        "maru_path",
        "maru_pool_size",
        "use_gds",
        "gds_backend",
        "audit_actual_remote_url",
        "internal_api_server_host",
        "external_lookup_client",
        "py_enable_gc",
        "numa_mode",
        "enable_async_loading",
        "internal_api_server_enabled",
        "internal_api_server_port_start",
        "priority_limit",
        "internal_api_server_include_index_list",
        "internal_api_server_socket_path_prefix",
        "runtime_plugin_locations",
        "storage_plugins",
        "remote_storage_plugins",
        "lookup_timeout_ms",
        "min_retrieve_tokens",
        "hit_miss_ratio",
        "lookup_server_worker_ids",
        "enable_scheduler_bypass_lookup",
        "script_allowed_imports",
        "run_script_api_enabled",
        "enable_lazy_memory_allocator",
        "lazy_memory_initial_ratio",
        "lazy_memory_expand_trigger_ratio",
        "lazy_memory_step_ratio",
        "lazy_memory_safe_size",
        "enable_chunk_statistics",
        "chunk_statistics_auto_start_statistics",
        "chunk_statistics_auto_exit_timeout_hours",
        "chunk_statistics_auto_exit_target_unique_chunks",
        "chunk_statistics_strategy",
        "enable_kv_events",
        "use_gpu_connector_v3",
        "pin_timeout_sec",
        "pin_check_interval_sec",
        "remote_config_url",
        "app_id",
        "hidden_states_retrieve_mode",
    ]
)

_SIZE_FIELDS = (
    "max_local_cpu_size",
    "max_local_disk_size",
    "max_hidden_state_cpu_size",
    "staging_size",
    "nixl_max_size",
    "mooncake_local_buffer_size",
    "mooncake_global_segment_size",
)


def _strip_file_scheme(v: str | None) -> str | None:
    if v is None:
        return None
    v = v.strip()
    if v.startswith("file://"):
        v = v[len("file://") :]
    return v or None


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
    mooncake_local_buffer_size: float = Field(
        0.0625, ge=0, description="Mooncake client transfer buffer (GiB)."
    )
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
    cache_server_max_leases: int = Field(4096, gt=0, description="Cache server: most leases one client may hold.")
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
        1024, gt=0, description="Cache server: most live holds one client connection may take."
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
        return _strip_file_scheme(v) if isinstance(v, str) else v

    @field_validator(*_SIZE_FIELDS, "blocking_timeout_secs", "remote_timeout_s", "remote_breaker_max_backoff_s")
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
        if key not in type(self).model_fields:
            raise ConfigError(f"unknown configuration key {key!r} (from {source})")
        try:
            setattr(self, key, convert_value(key, value, source))
        except ValidationError as exc:
            raise ConfigError(_format_error(key, value, source, exc)) from None
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
        return build_config([(k, v, "init") for k, v in overrides.items()])

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> LMCacheEngineConfig:
        """Defaults overridden by the YAML file at ``path`` (no env)."""
        return build_config(_file_entries(path))

    @classmethod
    def from_env(cls) -> LMCacheEngineConfig:
        """Defaults overridden by ``LMCACHE_<KEY>`` environment variables."""
        return build_config(_env_entries(os.environ))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "dict") -> LMCacheEngineConfig:
        """Defaults overridden by ``data`` (unknown keys warned about and dropped; LMCache's keys
        without effect here accepted with one warning each)."""
        return build_config(_mapping_entries(data, source))


# ---- conversion -------------------------------------------------------------------------------
_TRUE = {"true", "1", "yes", "y", "on"}
_FALSE = {"false", "0", "no", "n", "off"}
_NONE = {"", "none", "null", "~"}


def _field_kind(key: str) -> tuple[str, bool]:
    """('bool'|'int'|'float'|'str'|'list_int'|'list_str'|'dict'|'literal', optional)."""
    ann = LMCacheEngineConfig.model_fields[key].annotation
    optional = False
    origin = typing.get_origin(ann)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        optional = True
        ann = args[0]
        origin = typing.get_origin(ann)
    if origin is Literal:
        return "literal", optional
    if origin is list:
        (item,) = typing.get_args(ann)
        return ("list_int" if item is int else "list_str"), optional
    if origin is dict:
        return "dict", optional
    kinds: dict[Any, str] = {bool: "bool", int: "int", float: "float", str: "str"}
    return kinds.get(ann, "str"), optional


def _unquote(v: str) -> str:
    """A raw text value read the way LMCache reads environment values.

    Surrounding whitespace goes. A value wrapped in matching quotes is read as a Python string
    literal, so its escapes are honoured (``"{\\"a\\": 1}"`` is the JSON text ``{"a": 1}``);
    when it is not a valid literal only the outer quotes go, and when it is some other literal
    (``'a', 'b'``) it stays as it is. The content of a quoted value keeps its inner whitespace.
    """
    v = v.strip()
    if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
        try:
            with warnings.catch_warnings():  # "C:\dir" keeps its backslash, whatever the warning filters
                warnings.simplefilter("ignore")
                parsed = ast.literal_eval(v)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return v[1:-1]
        return parsed if isinstance(parsed, str) else v
    return v


def _clean_str(v: str) -> str:
    return _unquote(v).strip()


def convert_value(key: str, value: Any, source: str) -> Any:
    """Convert a raw value (env string, YAML scalar) to ``key``'s type; pydantic validates after.

    Raises :class:`ConfigError` naming key, value and source when the text cannot be converted.
    """
    if key not in LMCacheEngineConfig.model_fields:
        raise ConfigError(_unknown_key_message(key, source))
    kind, optional = _field_kind(key)
    if not isinstance(value, str):
        if kind == "list_int" and isinstance(value, int) and not isinstance(value, bool):
            return [value]
        if kind == "list_str" and isinstance(value, str):
            return [value]
        return value
    text = _unquote(value)
    if kind != "str":  # a string keeps what its quotes enclosed; other kinds ignore the spaces
        text = text.strip()

    def bad(why: str) -> ConfigError:
        return ConfigError(f"invalid value for {key}: {value!r} (from {source}): {why}")

    if optional and text.strip().lower() in _NONE:
        return None
    if kind == "bool":
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise bad("expected a boolean (true/false/1/0)")
    if kind == "int":
        try:
            return int(text, 0) if text.lower().startswith(("0x", "0o", "0b")) else int(text)
        except ValueError:
            raise bad("expected an integer") from None
    if kind == "float":
        try:
            return float(text)
        except ValueError:
            raise bad("expected a number") from None
    if kind in ("list_int", "list_str"):
        if text.startswith("["):
            try:
                try:
                    parsed = json.loads(text)
                except json.JSONDecodeError:
                    parsed = yaml.safe_load(text)
            except (yaml.YAMLError, RecursionError, ValueError):  # unparsable or absurdly nested
                raise bad("expected a list") from None
            if not isinstance(parsed, list):
                raise bad("expected a list")
            items = parsed
        else:
            items = [_clean_str(p) for p in text.split(",") if p.strip()]
        if kind == "list_int":
            try:
                return [int(i) for i in items]
            except (TypeError, ValueError):
                raise bad("expected a comma-separated list of integers") from None
        return [str(i) for i in items]
    if kind == "dict":
        try:
            parsed = json.loads(text)
        except (ValueError, RecursionError):  # malformed, absurdly nested, or a > 4300-digit int
            raise bad("expected a JSON object") from None
        if not isinstance(parsed, dict):
            raise bad("expected a JSON object")
        return parsed
    return text


def _did_you_mean(key: str, prefix: str = "") -> str:
    """``"; did you mean 'chunk_size'?"`` for a key close to one of ours (spelled with ``prefix``
    and upper case for a variable), else ``""``."""
    close = difflib.get_close_matches(key, LMCacheEngineConfig.model_fields, n=1)
    if not close:
        return ""
    name = f"{prefix}{close[0].upper()}" if prefix else close[0]
    return f"; did you mean {name!r}?"


def _unknown_key_message(key: str, source: str) -> str:
    close = difflib.get_close_matches(key, LMCacheEngineConfig.model_fields, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown configuration key {key!r} (from {source}){hint}"


def _format_error(key: str, value: Any, source: str, exc: ValidationError) -> str:
    msgs = "; ".join(e["msg"] for e in exc.errors())
    return f"invalid value for {key}: {value!r} (from {source}): {msgs}"


# ---- sources ------------------------------------------------------------------------------------
Entry = tuple[str, Any, str]  # key, raw value, source


def _is_overlay_key(key: str) -> bool:
    return key == "ec" or key.startswith("ec_")


def _mapping_entries(data: Mapping[str, Any], source: str) -> list[Entry]:
    fields = LMCacheEngineConfig.model_fields
    out: list[Entry] = []
    for key, value in data.items():
        if not isinstance(key, str):
            logger.warning("configuration key %r (from %s) is not a string; dropped", key, source)
            continue
        if key in fields or key in LMCACHE_KEYS_WITHOUT_EFFECT:  # build_config warns about the latter
            out.append((key, value, source))
        elif _is_overlay_key(key):
            continue  # the encoder-cache overlay reads these
        else:
            logger.warning("unknown configuration key %r (from %s) dropped%s", key, source, _did_you_mean(key))
    return out


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML mapping; ``ConfigError`` for unreadable files and non-mapping documents."""
    p = Path(_strip_file_scheme(os.fspath(path)) or "")
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read configuration file {p}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"configuration file {p} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: e.g. an integer of > 4300 digits
        raise ConfigError(f"configuration file {p} is not valid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"configuration file {p} nests too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"configuration file {p} must hold a mapping, got {type(data).__name__}")
    return data


def _file_entries(path: str | os.PathLike[str]) -> list[Entry]:
    return _mapping_entries(read_yaml(path), f"file {os.fspath(path)}")


def _env_entries(environ: Mapping[str, str]) -> list[Entry]:
    fields = LMCacheEngineConfig.model_fields
    out: list[Entry] = []
    for var, value in environ.items():
        if not var.startswith(ENV_PREFIX) or var == CONFIG_FILE_ENV or var.startswith(EC_ENV_PREFIX):
            continue
        key = var[len(ENV_PREFIX) :].lower()
        if key in fields or key in LMCACHE_KEYS_WITHOUT_EFFECT:  # build_config warns about the latter
            out.append((key, value, f"env {var}"))
        elif not var.startswith(_OTHER_ENV_PREFIXES) and var not in _warned_env:
            _warned_env.add(var)  # once per process: configurations are loaded more than once
            logger.warning("unknown configuration variable %s ignored%s", var, _did_you_mean(key, ENV_PREFIX))
    return out


# LMCACHE_* variables that are not configuration keys: this project's tools and tests, and
# LMCache's own process settings a migrating user may still export.
_OTHER_ENV_PREFIXES = (
    "LMCACHE_ASYNC_",
    "LMCACHE_E2E_",
    "LMCACHE_VLLM_",
    "LMCACHE_SGLANG_",
    "LMCACHE_ENV_",
    "LMCACHE_PYTHON",
    "LMCACHE_LOG_LEVEL",
    "LMCACHE_TRACK_USAGE",
    "LMCACHE_USE_EXPERIMENTAL",
)
_warned_env: set[str] = set()


def build_config(entries: Iterable[Entry], base: LMCacheEngineConfig | None = None) -> LMCacheEngineConfig:
    """Apply ``entries`` in order over ``base`` (or the defaults); later entries win.

    An entry of one of LMCache's keys without effect here (``LMCACHE_KEYS_WITHOUT_EFFECT``) is
    dropped with one warning per key, naming the key and its first source. Raises one
    :class:`ConfigError` for the first unknown key or invalid value, naming key, value and source.
    """
    fields = LMCacheEngineConfig.model_fields
    values: dict[str, tuple[Any, Any, str]] = {}
    without_effect: dict[str, str] = {}
    for key, raw, source in _expand_tiers(entries):
        if key not in fields and key in LMCACHE_KEYS_WITHOUT_EFFECT:
            without_effect.setdefault(key, source)
            continue
        values[key] = (convert_value(key, raw, source), raw, source)
    serde = values.get("remote_serde")
    if serde is not None and serde[0] not in (None, "naive"):
        logger.warning(
            "remote_serde %r (from %s) has no effect here: records are stored as they are, self-describing "
            "(LMCache's serializers such as cachegen are not used)",
            serde[0],
            serde[2],
        )
    for key, source in without_effect.items():
        logger.warning(
            "configuration key %r (from %s) is an LMCache setting with no effect in lmcache_async; ignored",
            key,
            source,
        )
    data = base.model_dump() if base is not None else {}
    data.update({k: v[0] for k, v in values.items()})
    backends = values["nixl_backends"][0] if "nixl_backends" in values else None
    if "nixl_backend" not in values and isinstance(backends, list) and backends and isinstance(backends[0], str):
        data["nixl_backend"] = backends[0]  # anything else is reported by the validation below
    try:
        cfg = LMCacheEngineConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = str(err["loc"][0]) if err["loc"] else "?"
        raw, source = (values[key][1], values[key][2]) if key in values else (data.get(key), "base")
        raise ConfigError(f"invalid value for {key}: {raw!r} (from {source}): {err['msg']}") from None
    cfg._sources = dict(base._sources) if base is not None else {}
    for key, (_, _, source) in values.items():
        cfg._sources[key] = source
    return cfg


def _expand_tiers(entries: Iterable[Entry]) -> list[Entry]:
    """``entries`` with each ``tiers`` entry split: built-in sections become flat entries in its
    place (so later entries still win), the other tiers' sections merge into one ``tiers`` entry."""
    out: list[Entry] = []
    for key, raw, source in entries:
        if key != "tiers":
            out.append((key, raw, source))
            continue
        section = convert_value(key, raw, source)
        if not isinstance(section, Mapping):
            raise ConfigError(f"invalid value for tiers: {raw!r} (from {source}): expected a mapping")
        flat, rest = flatten_tiers_section(section, source)
        out += flat
        merged = dict(next((v for k, v, _ in reversed(out) if k == "tiers"), {}))
        merged.update(rest)
        out.append(("tiers", merged, source))
    return out


def load_engine_config(path: str | os.PathLike[str] | None = None) -> LMCacheEngineConfig:
    """The base config: defaults, then the YAML at ``path`` (or ``$LMCACHE_CONFIG_FILE``), then
    ``LMCACHE_<KEY>`` environment variables. The EC overlay keys are ignored here."""
    entries: list[Entry] = []
    file_path = path if path is not None else os.environ.get(CONFIG_FILE_ENV) or None
    if file_path is not None:
        entries.extend(_file_entries(file_path))
    entries.extend(_env_entries(os.environ))
    return build_config(entries)


# ---- encoder-cache overlay -----------------------------------------------------------------------
EC_DEFAULT_CPU_SIZE = 1.0
EC_DEFAULT_DISK_SIZE = 64.0


def _ec_entries(data: Mapping[str, Any], path: str) -> list[Entry]:
    fields = LMCacheEngineConfig.model_fields
    prefixed: list[Entry] = []
    mapped: list[Entry] = []
    for key, value in data.items():
        if not isinstance(key, str):
            continue
        if key.startswith("ec_"):
            sub = key[3:]
            if sub in fields:
                prefixed.append((sub, value, f"file {path} key {key}"))
            elif key in fields:  # a key of the encoder cache's own (ec_model_name)
                prefixed.append((key, value, f"file {path} key {key}"))
            else:
                logger.warning("unknown encoder-cache key %r (from file %s) dropped", key, path)
    ec_map = data.get("ec")
    if ec_map is not None:
        if not isinstance(ec_map, dict):
            raise ConfigError(f"invalid value for ec: {ec_map!r} (from file {path}): must be a mapping")
        for sub, value in ec_map.items():
            if isinstance(sub, str) and sub in fields:
                mapped.append((sub, value, f"file {path} map ec.{sub}"))
            else:
                logger.warning("unknown encoder-cache key ec.%s (from file %s) dropped", sub, path)
    return prefixed + mapped  # the ec: map wins over ec_ keys


def _ec_env_entries(environ: Mapping[str, str]) -> list[Entry]:
    fields = LMCacheEngineConfig.model_fields
    out: list[Entry] = []
    for var, value in environ.items():
        if not var.startswith(EC_ENV_PREFIX):
            continue
        key = var[len(EC_ENV_PREFIX) :].lower()
        if key not in fields and f"ec_{key}" in fields:  # LMCACHE_EC_MODEL_NAME: ec_model_name
            key = f"ec_{key}"
        if key in fields:
            out.append((key, value, f"env {var}"))
        else:
            logger.warning("unknown encoder-cache variable %s dropped", var)
    return out


def load_ec_engine_config(
    base_config: LMCacheEngineConfig | None = None,
    config_file_path: str | os.PathLike[str] | None = None,
) -> LMCacheEngineConfig:
    """The encoder-cache config: a clone of the base with the EC overlay and EC defaults.

    Base: ``base_config`` (never modified) or :func:`load_engine_config` of ``config_file_path``.
    Overlay, later wins: YAML ``ec_<key>`` keys, the YAML ``ec:`` map, ``LMCACHE_EC_<KEY>``
    env. Unknown overlay keys are logged and dropped; invalid values raise ``ConfigError``.
    Defaults: ``local_cpu`` on; ``max_local_cpu_size`` 1 GiB when no source set it or it is
    <= 0; ``max_local_disk_size`` 64 GiB when ``local_disk`` is set and the size is <= 0.
    """
    base = base_config.clone() if base_config is not None else load_engine_config(config_file_path)
    file_path = config_file_path if config_file_path is not None else os.environ.get(CONFIG_FILE_ENV) or None
    entries: list[Entry] = []
    if file_path is not None:
        entries.extend(_ec_entries(read_yaml(file_path), os.fspath(file_path)))
    entries.extend(_ec_env_entries(os.environ))
    cfg = build_config(entries, base=base)
    if not cfg.local_cpu:
        cfg.set("local_cpu", True, "encoder-cache default")
    if not cfg.is_set("max_local_cpu_size") or cfg.max_local_cpu_size <= 0:
        cfg.set("max_local_cpu_size", EC_DEFAULT_CPU_SIZE, "encoder-cache default")
    if cfg.local_disk and cfg.max_local_disk_size <= 0:
        cfg.set("max_local_disk_size", EC_DEFAULT_DISK_SIZE, "encoder-cache default")
    return cfg
