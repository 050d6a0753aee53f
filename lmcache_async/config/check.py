"""What a configuration will do, checked before anything is built from it.

:func:`check_config` answers, for a loaded :class:`~lmcache_async.config.LMCacheEngineConfig`,
the questions a manager would otherwise answer with a traceback at start-up: are the tier names
known (with "did you mean" for a typo), does ``remote_url`` parse with a supported scheme, is a
tier enabled by its key but left out of ``tier_order``, can the pools ever fit in this machine's
memory, can the disk budget ever fit on its filesystem. ``lmcache-async config`` prints the
findings; :class:`~lmcache_async.storage_manager.StorageManager` raises the errors as one
:class:`~lmcache_async.errors.ConfigError` line and logs the warnings once.

Pure: reads the configuration and the machine (``/proc/meminfo``, ``statvfs``), changes nothing.
"""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass
from typing import Literal

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.config.units import human_bytes
from lmcache_async.memory import memory_total_bytes
from lmcache_async.tiers import BUILTIN_TIER_KEYS

logger = logging.getLogger(__name__)

__all__ = ["Finding", "check_config", "raise_or_warn", "redacted"]

TIER_KEYS = {tier: key for tier, key in BUILTIN_TIER_KEYS.items() if tier != "cpu"}
"""The key that enables each built-in lower tier (``cpu`` is on by ``local_cpu``)."""

_SECRET_WORDS = ("token", "secret", "password")
GIB = 1 << 30


@dataclass(frozen=True)
class Finding:
    """One problem: ``level`` ``error`` (the manager refuses to start) or ``warning`` (it starts;
    the value has no effect or will not do what its key says); ``key`` is the configuration key."""

    level: Literal["error", "warning"]
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.level}: {self.key}: {self.message}"


def _tier_names(config: LMCacheEngineConfig) -> list[Finding]:
    from lmcache_async.tiers import known_backends

    known = known_backends()
    out = []
    named = [("tier_order", n) for n in config.tier_order] + [(f"tiers.{n}", n) for n in config.tiers]
    for where, name in named:
        if name in known:
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        out.append(Finding("error", where, f"unknown tier {name!r}; {hint}known: {', '.join(known)}"))
    return out


def _tier_checks(config: LMCacheEngineConfig) -> list[Finding]:
    from lmcache_async.tiers import known_backends, tier_config_errors

    known = set(known_backends())
    out = []
    for name in dict.fromkeys([*config.tier_order, *config.tiers]):
        if name in known:
            out += [Finding("error", TIER_KEYS.get(name, name), msg) for msg in tier_config_errors(name, config)]
    return out


def _unlisted_tiers(config: LMCacheEngineConfig) -> list[Finding]:
    out = []
    for tier, key in TIER_KEYS.items():
        if getattr(config, key, None) and tier not in config.tier_order:
            if tier == "disk" and config.max_local_disk_size <= 0:
                continue
            out.append(
                Finding(
                    "warning",
                    key,
                    f"{key} is set but tier_order {list(config.tier_order)} lacks {tier!r}: the {tier} tier "
                    f"is not used (add {tier!r} to tier_order, or unset {key})",
                )
            )
    return out


def _sizes(config: LMCacheEngineConfig) -> list[Finding]:
    out = []
    total = memory_total_bytes()
    if total is not None:
        pools = [("max_local_cpu_size", config.max_local_cpu_size if config.local_cpu else 0.0)]
        if config.enable_hidden_state_cache:
            pools.append(("max_hidden_state_cpu_size", config.max_hidden_state_cpu_size))
        if any(getattr(config, k, None) for k in TIER_KEYS.values()):  # staging backs lower-tier I/O
            pools.append(("staging_size", config.staging_size))
        need = sum(v for _, v in pools) * GIB
        used = [(k, v) for k, v in pools if v > 0]
        if need > total and used:
            # the finding names the first pool as its key; the message names the others beside it
            (key, first), rest = used[0], used[1:]
            named = f"{first:g} GiB" + "".join(f" + {k} {v:g} GiB" for k, v in rest)
            what = "of pools" if rest else "pool"
            out.append(
                Finding(
                    "error",
                    key,
                    f"{named} {what} can never fit in this machine's {human_bytes(total)} of memory",
                )
            )
    disk = config.local_disk
    if disk and config.max_local_disk_size > 0:
        probe = os.path.abspath(disk)
        while not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        try:
            st = os.statvfs(probe)
        except OSError:
            return out
        capacity = st.f_blocks * st.f_frsize
        if config.max_local_disk_size * GIB > capacity:
            out.append(
                Finding(
                    "warning",
                    "max_local_disk_size",
                    f"{human_bytes(config.max_local_disk_size * GIB)} budget on a filesystem of "
                    f"{human_bytes(capacity)} "
                    f"({probe}): writes will fail for lack of space (counted as no_space) long before the "
                    "budget evicts anything",
                )
            )
    return out


def check_config(config: LMCacheEngineConfig) -> list[Finding]:
    """Every finding for ``config`` (errors first), as the manager would meet them; ``[]`` when
    nothing is wrong. ``TypeError`` for anything but a config."""
    if not isinstance(config, LMCacheEngineConfig):
        raise TypeError(f"config must be an LMCacheEngineConfig, got {type(config).__name__}")
    found = _tier_names(config) + _tier_checks(config) + _unlisted_tiers(config) + _sizes(config)
    return sorted(found, key=lambda f: f.level != "error")


_warned: set[str] = set()


def raise_or_warn(config: LMCacheEngineConfig, what: str = "cache") -> None:
    """Raise the errors of :func:`check_config` as one :class:`~lmcache_async.errors.ConfigError`
    (one line per error) and log each warning once per process."""
    from lmcache_async.errors import ConfigError

    found = check_config(config)
    errors = [f for f in found if f.level == "error"]
    if errors:
        raise ConfigError(f"{what}: " + "; ".join(f"{f.key}: {f.message}" for f in errors))
    for f in found:
        if f.message not in _warned:
            _warned.add(f.message)
            logger.warning("%s: %s", f.key, f.message)


def redacted(key: str, value: object) -> object:
    """``value`` as it may be printed: secrets (tokens, passwords, the password of a URL) masked."""
    if value is None:
        return None
    if isinstance(value, str) and "://" in value:
        return _redact_url(value)
    if any(w in key for w in _SECRET_WORDS) and not hasattr(value, "get_secret_value"):
        return "********"
    return value


def _redact_url(url: str) -> str:
    scheme, _, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    if "@" not in netloc:
        return url
    userinfo, _, host = netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return f"{scheme}://{user + ':' if user else ':'}********@{host}{slash}{tail}"
