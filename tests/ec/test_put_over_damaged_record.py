"""A put that returns True leaves a readable entry, also over a damaged lower-tier record.

An earlier run left the record of ``img-1`` on disk (or on an ``fs://`` share) and the record was
damaged afterwards. The lower tier still claims the key (its index, or the file's size), but only
a read can tell the record is bad. A put of ``img-1`` must store the entry anyway: readable at
once from the CPU tier, and after ``flush()`` from the lower tier for a fresh engine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lmcache_async.engines.encoder_cache import ECCacheEngine

from .helpers import KiB, MiB, gib

MakeEngine = Callable[..., ECCacheEngine]


def _tensor() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randn(64 * KiB // 4, generator=g)


def _lower_tier(kind: str, root: Path) -> dict[str, object]:
    if kind == "disk":
        return {"local_disk": str(root), "max_local_disk_size": gib(64 * MiB)}
    return {"remote_url": f"fs://{root}"}


def _record_file(kind: str, root: Path) -> Path:
    suffix = ".lmc" if kind == "disk" else ".rec"
    files = [p for p in root.rglob(f"*{suffix}") if p.is_file() and not p.name.startswith(".")]
    assert len(files) == 1, files
    return files[0]


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _tier_name(kind: str) -> str:
    return "disk" if kind == "disk" else "remote"


@pytest.mark.parametrize(
    ("kind", "local_cpu"),
    [
        pytest.param("disk", True, id="cpu+disk"),
        pytest.param("disk", False, id="disk-only"),
        pytest.param("fs", True, id="cpu+fs"),
    ],
)
def test_put_over_a_damaged_lower_tier_record_is_readable_now_and_after_flush(
    make_engine: MakeEngine, tmp_path: Path, kind: str, local_cpu: bool
) -> None:
    root = tmp_path / kind
    tier = _lower_tier(kind, root)
    t = _tensor()

    first = make_engine(**tier)
    assert first.put("img-1", t)
    first.flush(timeout=30)
    first.close()
    _flip_last_byte(_record_file(kind, root))

    engine = make_engine(local_cpu=local_cpu, **tier)
    assert engine.put("img-1", t)
    out = engine.get("img-1")
    assert out is not None and torch.equal(out, t)
    engine.flush(timeout=30)
    engine.close()

    fresh = make_engine(**tier)  # an empty CPU tier: the bytes can only come from below
    out = fresh.get("img-1")
    assert out is not None and torch.equal(out, t)
    assert fresh.storage_manager.stats()["tiers"][_tier_name(kind)]["hits"] == 1
