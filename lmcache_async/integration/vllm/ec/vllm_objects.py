"""Reading the vLLM objects the encoder-cache connector is handed, by attribute.

Nothing here imports vLLM: requests, configs and connector parents are read through
``getattr`` so every vLLM encoder-cache API version (0.11.1 onwards) works. Also the plain
metadata type the scheduler sends to the workers each step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache_async.dtypes import dtype_name, parse_dtype

__all__ = [
    "DEFAULT_ENCODER_DTYPE",
    "DEFAULT_MODEL_NAME",
    "ECLoadMetadata",
    "connector_roles",
    "item_count",
    "item_identifier",
    "model_identity",
    "role_name",
    "safe_item_count",
    "worker_device",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "default"
"""Model name used in keys when vLLM's config carries no model config."""
DEFAULT_ENCODER_DTYPE = torch.bfloat16
"""Key dtype used when vLLM's config carries no (resolvable) model dtype."""


@dataclass
class ECLoadMetadata:
    """What the scheduler tells the workers to load this step.

    ``mm_hashes``: sorted; ``leases``: hash → path of its disk lease (workers in other
    processes); ``specs``: hash → ``(shape, dtype name)`` of the verified entry. Plain data, so it
    crosses to worker processes however vLLM serialises it. :mod:`.connector` subclasses it
    together with vLLM's ``ECConnectorMetadata``.
    """

    mm_hashes: list[str] = field(default_factory=list)
    leases: dict[str, str] = field(default_factory=dict)
    specs: dict[str, tuple[list[int], str]] = field(default_factory=dict)


# ---- reading vLLM objects ----
def item_identifier(request: Any, index: int) -> str:
    """The hash of ``request``'s multimodal item ``index``.

    ``request.mm_features[index].identifier`` (vLLM >= 0.11.1), falling back to its
    ``.mm_hash``, then to ``request.mm_hashes[index]`` (0.11.x). ``ValueError`` when none is there.
    """
    feats = getattr(request, "mm_features", None)
    if feats is not None and index < len(feats):
        feat = feats[index]
        for attr in ("identifier", "mm_hash"):
            value = getattr(feat, attr, None)
            if isinstance(value, str) and value:
                return value
    hashes = getattr(request, "mm_hashes", None)
    if hashes is not None and index < len(hashes):
        value = hashes[index]
        if isinstance(value, str) and value:
            return value
    raise ValueError(f"request has no multimodal item hash at index {index}")


def item_count(request: Any) -> int:
    """How many multimodal items ``request`` carries (``mm_features``, else ``mm_hashes``)."""
    feats = getattr(request, "mm_features", None)
    if feats is not None:
        return len(feats)
    hashes = getattr(request, "mm_hashes", None)
    return len(hashes) if hashes is not None else 0


def model_identity(vllm_config: Any, pinned: str | None = None) -> tuple[str, torch.dtype]:
    """``(model name, encoder dtype)`` used in encoder-cache keys.

    Name: ``pinned`` (the ``ec_model_name`` key) when given, else ``model_config.model`` (the
    weights vLLM loads: a hub id or a path), else :data:`DEFAULT_MODEL_NAME`.
    ``served_model_name`` is an API alias and never enters the keys. Dtype:
    ``model_config.dtype`` (a ``torch.dtype`` or a name), else :data:`DEFAULT_ENCODER_DTYPE`.
    """
    mc = getattr(vllm_config, "model_config", None)
    name: str | None = pinned if isinstance(pinned, str) and pinned else None
    dtype: torch.dtype | None = None
    if mc is not None:
        if name is None:
            model = getattr(mc, "model", None)
            if isinstance(model, str) and model:
                name = model
        raw = getattr(mc, "dtype", None)
        if raw is not None:
            try:
                dtype = parse_dtype(raw)
                dtype_name(dtype)
            except ValueError:
                logger.warning(
                    "model dtype %r cannot key the encoder cache; using %s",
                    raw,
                    DEFAULT_ENCODER_DTYPE,
                )
                dtype = None
    if name is None:
        logger.warning("vLLM config has no model name; encoder-cache keys use %r", DEFAULT_MODEL_NAME)
        name = DEFAULT_MODEL_NAME
    return name, dtype if dtype is not None else DEFAULT_ENCODER_DTYPE


def worker_device(vllm_config: Any) -> torch.device:
    """The device loaded entries go to: ``vllm_config.device_config.device`` (or its
    ``device_type``); a CUDA device without an index means the current one."""
    dc = getattr(vllm_config, "device_config", None)
    raw = getattr(dc, "device", None) if dc is not None else None
    if raw is None and dc is not None:
        raw = getattr(dc, "device_type", None)
    dev: torch.device
    try:
        dev = torch.device(raw) if raw is not None else torch.device("cpu")
    except (RuntimeError, TypeError, ValueError):
        logger.warning("unknown vLLM device %r; loading encoder-cache entries to the CPU", raw)
        dev = torch.device("cpu")
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def connector_roles(vllm_config: Any, parent: Any) -> tuple[bool, bool]:
    """``(is_producer, is_consumer)``: each flag from the parent when it has it as a bool (vLLM's
    ``ECConnectorBase``), else from ``ec_transfer_config.ec_role`` (framework-free parents may
    carry one flag, both or none)."""
    tc = getattr(vllm_config, "ec_transfer_config", None)
    role = getattr(tc, "ec_role", None)
    prod = getattr(parent, "is_producer", None)
    cons = getattr(parent, "is_consumer", None)
    if not isinstance(prod, bool):
        prod = role in ("ec_producer", "ec_both")
    if not isinstance(cons, bool):
        cons = role in ("ec_consumer", "ec_both")
    return prod, cons


def role_name(role: Any) -> str:
    """vLLM's ``ECConnectorRole`` (or a plain string) as a lower-case name: ``"scheduler"``/``"worker"``."""
    name = getattr(role, "name", role)
    return str(name).lower()


def safe_item_count(request: Any) -> int:
    """:func:`item_count` of ``request``, 0 when it cannot be read (never raises)."""
    try:
        return item_count(request)
    except Exception:
        return 0
