"""Configuration of the Omni stage connector, built from a connector spec's ``extra`` dict.

Omni's ``OmniConnectorFactory`` calls a connector's constructor with the spec's ``extra``
mapping. It holds our engine config keys inline (``tier_order``, ``cache_server_socket``,
``remote_url``, ...), optionally a ``config_file`` (a YAML of the same keys), the connector's
own keys (:data:`CONNECTOR_DEFAULTS`) and keys Omni adds itself (``stage_id``, ``role``, ...;
:data:`OMNI_KEYS`, ignored). Sources, later wins: the YAML named by ``config_file`` (else
``$LMCACHE_CONFIG_FILE``), then ``LMCACHE_<KEY>`` environment variables, then the inline keys.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmcache_async.config import CONFIG_FILE_ENV, LMCacheEngineConfig, load_engine_config
from lmcache_async.integration.omni.codec import OmniCodec

__all__ = [
    "CONFIG_FILE_KEY",
    "CONNECTOR_DEFAULTS",
    "OMNI_KEYS",
    "StageOptions",
    "load_stage_options",
    "omni_serializer",
]

logger = logging.getLogger(__name__)

CONFIG_FILE_KEY = "config_file"
"""``extra`` key naming a YAML configuration file of engine config keys."""

CONNECTOR_DEFAULTS: dict[str, Any] = {
    "namespace": "omni",
    "serializer": "auto",
    "consume_on_get": True,
    "poll_interval_s": 0.005,
    "max_tracked_keys": 65536,
    "payload_buffer_size": 0.125,
}
"""The connector's own ``extra`` keys and their defaults (see :class:`StageOptions`)."""

OMNI_KEYS = frozenset(
    {"stage_id", "role", "from_stage", "to_stage", "zmq_port", "sender_host", "host", "outgoing", "name"}
)
"""Keys Omni's initialisation writes into ``extra`` for every connector; ignored here."""

SERIALIZERS = ("auto", "omni", "lmcache")


@dataclass(frozen=True)
class StageOptions:
    """What the connector reads from ``extra`` besides the engine config.

    * ``namespace``: first part of every key (``<namespace>/<from>-><to>``), so several
      pipelines can share one tier;
    * ``serializer``: ``"auto"`` (our pickle-free tree codec, Omni's msgpack serializer for
      types it cannot carry), ``"omni"`` (Omni's serializer for every non-raw payload) or
      ``"lmcache"`` (the tree codec only);
    * ``consume_on_get``: a successful ``get`` removes the entry from every tier (the consumer
      deletes what it read, so no process has to remember keys it never saw);
    * ``poll_interval_s``: longest sleep between two polls of ``get_with_deadline``;
    * ``max_tracked_keys``: bound on the keys remembered for ``cleanup`` (oldest forgotten first;
      forgetting never deletes an entry);
    * ``payload_buffer_size``: GiB of pre-touched memory per store for the records a put
      encodes and the tensors a get returns (their memory returns when the caller frees them;
      see :mod:`~lmcache_async.integration.omni.buffers`); 0 allocates every buffer afresh.
    """

    namespace: str = "omni"
    serializer: str = "auto"
    consume_on_get: bool = True
    poll_interval_s: float = 0.005
    max_tracked_keys: int = 65536
    payload_buffer_size: float = 0.125

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ValueError(f"namespace must be a non-empty str, got {self.namespace!r}")
        if self.serializer not in SERIALIZERS:
            raise ValueError(f"serializer must be one of {SERIALIZERS}, got {self.serializer!r}")
        if not isinstance(self.consume_on_get, bool):
            raise TypeError(f"consume_on_get must be a bool, got {type(self.consume_on_get).__name__}")
        if isinstance(self.poll_interval_s, bool) or not isinstance(self.poll_interval_s, (int, float)):
            raise TypeError(f"poll_interval_s must be a number, got {type(self.poll_interval_s).__name__}")
        if not 0 < self.poll_interval_s <= 1.0:
            raise ValueError(f"poll_interval_s must be in (0, 1], got {self.poll_interval_s!r}")
        if isinstance(self.max_tracked_keys, bool) or not isinstance(self.max_tracked_keys, int):
            raise TypeError(f"max_tracked_keys must be an int, got {type(self.max_tracked_keys).__name__}")
        if self.max_tracked_keys < 1:
            raise ValueError(f"max_tracked_keys must be >= 1, got {self.max_tracked_keys}")
        size = self.payload_buffer_size
        if isinstance(size, bool) or not isinstance(size, (int, float)):
            raise TypeError(f"payload_buffer_size must be a number (GiB), got {type(size).__name__}")
        if not 0 <= size <= 64:
            raise ValueError(f"payload_buffer_size must be in [0, 64] GiB, got {size!r}")


def load_stage_options(extra: Mapping[str, Any] | None) -> tuple[LMCacheEngineConfig, StageOptions]:
    """The engine config and the connector options of ``extra`` (see the module docstring).

    Unknown keys are logged and dropped; Omni's own keys are ignored quietly. Raises
    ``TypeError`` for an ``extra`` that is not a mapping or a ``config_file`` that is not a
    path, ``ValueError``/``TypeError`` for a bad connector option and
    :class:`~lmcache_async.errors.ConfigError` for a bad engine config value.
    """
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a mapping, got {type(extra).__name__}")
    items = dict(extra)
    path = items.pop(CONFIG_FILE_KEY, None)
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"extra[{CONFIG_FILE_KEY!r}] must be a path, got {type(path).__name__}")
    config = load_engine_config(path if path else os.environ.get(CONFIG_FILE_ENV) or None)
    fields = LMCacheEngineConfig.model_fields
    own: dict[str, Any] = {}
    for key, value in items.items():
        if key in CONNECTOR_DEFAULTS:
            own[key] = value
        elif key in fields:
            config.set(key, value, "Omni connector extra")
        elif key not in OMNI_KEYS:
            logger.warning("unknown Omni connector extra key %r dropped", key)
    return config, StageOptions(**own)


def omni_serializer() -> OmniCodec | None:
    """Omni's msgpack serializer as ``(serialize, deserialize)``, or None where vllm_omni does
    not import. It is pickle-free (msgspec msgpack with tensors as dtype/shape/bytes)."""
    try:
        from vllm_omni.distributed.omni_connectors.utils.serialization import OmniSerializer
    except Exception:  # ImportError, or vLLM failing to import in this environment
        return None
    return OmniSerializer.serialize, OmniSerializer.deserialize
