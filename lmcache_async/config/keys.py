"""The configuration's fixed names: environment prefixes, the built-in tier order, the LMCache
keys accepted without effect, and the size keys (GiB). No imports of the model, so every other
configuration module may use them (:mod:`lmcache_async.config` is the public face).
"""

from __future__ import annotations

from lmcache_async.tiers.registry import TIER_NAMES

__all__ = [
    "CONFIG_FILE_ENV",
    "DEFAULT_TIER_ORDER",
    "EC_ENV_PREFIX",
    "ENV_PREFIX",
    "LMCACHE_KEYS_WITHOUT_EFFECT",
    "SIZE_FIELDS",
    "strip_file_scheme",
]

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

SIZE_FIELDS = (
    "max_local_cpu_size",
    "max_local_disk_size",
    "max_hidden_state_cpu_size",
    "staging_size",
    "nixl_max_size",
    "mooncake_local_buffer_size",
    "mooncake_global_segment_size",
)
"""The keys that are sizes in GiB (finite floats >= 0)."""


def strip_file_scheme(v: str | None) -> str | None:
    """``v`` stripped of spaces and of a leading ``file://``; None for None or nothing left."""
    if v is None:
        return None
    v = v.strip()
    if v.startswith("file://"):
        v = v[len("file://") :]
    return v or None
