"""Leased reads of sealed disk records (``encryption_key_file``): a lease opens them with the
disk tier's key; without it, or under another key, it refuses them as foreign, never as
truncated and never with another key's bytes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmcache_async.disk.leases import LeaseDir, read_record
from lmcache_async.encryption import RecordCipher, load_cipher, write_key_file
from lmcache_async.integration.vllm.ec.impl import LMCacheECConnectorImpl
from lmcache_async.memory import MemoryFormat, tensor_byte_view
from lmcache_async.records import ForeignSeal, RecordError, encode_header, payload_checksum
from lmcache_async.testing import make_key

from .helpers import MiB, gib
from .test_connector_impl import Parent, Role, make, request, vllm_config


def _cipher(tmp_path: Path, name: str) -> tuple[str, RecordCipher]:
    path = str(tmp_path / name)
    write_key_file(path)
    return path, load_cipher(path)


def _write_sealed(path: Path, t: torch.Tensor, kstr: str, cipher: RecordCipher, flip: bool = False) -> None:
    """A sealed disk record of ``t`` (as the disk tier writes it); ``flip``: one ciphertext bit
    flipped and the payload checksum fixed up, so only the tag can tell."""
    seal, stored = cipher.seal(kstr, tuple(t.shape), t.dtype, MemoryFormat.UNDEFINED, tensor_byte_view(t))
    body = bytearray(stored)
    if flip:
        body[3] ^= 0x01
    hb = encode_header(kstr, tuple(t.shape), t.dtype, MemoryFormat.UNDEFINED, payload_checksum(body), seal=seal)
    path.write_bytes(hb + bytes(body))


def test_a_sealed_record_reads_through_its_lease_with_the_key(tmp_path: Path) -> None:
    _path, cipher = _cipher(tmp_path, "k")
    t, key = torch.randn(16, 32), make_key(1)
    rec = tmp_path / "r.lease"
    _write_sealed(rec, t, key.to_string(), cipher)
    assert torch.equal(read_record(str(rec), key, cipher), t)
    assert torch.equal(LeaseDir(tmp_path, cipher=cipher).read(str(rec), key), t)


def test_a_sealed_record_without_the_key_or_under_another_key_is_refused_as_foreign(tmp_path: Path) -> None:
    _p, cipher = _cipher(tmp_path, "a")
    _q, other = _cipher(tmp_path, "b")
    t, key = torch.randn(16, 32), make_key(2)
    rec = tmp_path / "r.lease"
    _write_sealed(rec, t, key.to_string(), cipher)
    for reader in (None, other):
        with pytest.raises(ForeignSeal):
            read_record(str(rec), key, reader)


def test_a_plain_record_read_with_a_key_is_refused_as_foreign(tmp_path: Path) -> None:
    _p, cipher = _cipher(tmp_path, "a")
    t, key = torch.randn(4, 4), make_key(3)
    rec = tmp_path / "r.lease"
    view = tensor_byte_view(t)
    rec.write_bytes(encode_header(key.to_string(), (4, 4), t.dtype, MemoryFormat.UNDEFINED, payload_checksum(view))
                    + bytes(view))  # fmt: skip
    assert torch.equal(read_record(str(rec), key), t)
    with pytest.raises(ForeignSeal):
        read_record(str(rec), key, cipher)


def test_a_failing_tag_under_the_key_is_damage_not_foreign(tmp_path: Path) -> None:
    _p, cipher = _cipher(tmp_path, "a")
    t, key = torch.randn(16, 32), make_key(4)
    rec = tmp_path / "r.lease"
    _write_sealed(rec, t, key.to_string(), cipher, flip=True)
    with pytest.raises(RecordError, match="tag") as info:
        read_record(str(rec), key, cipher)
    assert not isinstance(info.value, ForeignSeal)


@pytest.fixture
def connectors() -> Iterator[list[LMCacheECConnectorImpl]]:
    made: list[LMCacheECConnectorImpl] = []
    yield made
    for c in made:
        c.close()


def test_workers_in_other_processes_load_a_deleted_sealed_record_from_its_lease(
    connectors: list[LMCacheECConnectorImpl], tmp_path: Path
) -> None:
    key_file, _cipher_ = _cipher(tmp_path, "k")
    disk = {"local_disk": str(tmp_path / "ec"), "max_local_cpu_size": gib(16 * MiB), "encryption_key_file": key_file}
    producer = make(connectors, vllm_config("ec_producer", {**disk, "chunk_size": 16}), Role.WORKER)
    t = torch.randn(8, 8)
    producer.save_caches({"h": t}, "h")
    producer.engine.flush(timeout=30)
    files = list((tmp_path / "ec").glob("*/*.lmc"))
    assert files and all(bytes(tensor_byte_view(t))[:32] not in f.read_bytes() for f in files)  # sealed
    sched = make(connectors, vllm_config("ec_consumer", {**disk, "chunk_size": 32}), Role.SCHEDULER)
    parent = Parent("ec_consumer")
    worker = make(connectors, vllm_config("ec_consumer", {**disk, "chunk_size": 64}), Role.WORKER, parent)
    assert sched.has_cache_item("h")
    sched.update_state_after_alloc(request("h"), 0)
    meta = sched.build_connector_meta(None)
    assert set(meta.leases) == {"h"}
    for f in files:
        f.unlink()  # deleted between the promise and the load
    parent._connector_metadata = meta
    encoder_cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(encoder_cache)
    assert torch.equal(encoder_cache["h"], t)
    assert worker.stats()["loaded_from_lease"] == 1
