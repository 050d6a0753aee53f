"""Raw access to the SeaweedFS bucket of the s3:// tests (never through the tier under test)."""

from __future__ import annotations

import datetime
from typing import Any

import obstore
from obstore.store import S3Store

from lmcache_async.encryption import RecordCipher
from lmcache_async.records import decode_header, verify_payload
from lmcache_async.testing.servers import SeaweedServer


def raw_store(srv: SeaweedServer, prefix: str = "") -> Any:
    """An obstore S3Store on ``srv``'s bucket (below ``prefix``)."""
    return S3Store(
        srv.bucket,
        prefix=prefix or None,
        endpoint=srv.endpoint,
        region="us-east-1",
        skip_signature=True,
        client_options={"allow_http": True, "timeout": datetime.timedelta(seconds=30)},
    )


def objects(srv: SeaweedServer, prefix: str) -> dict[str, bytes]:
    """Every object below ``prefix``: path to bytes."""
    store = raw_store(srv)
    out: dict[str, bytes] = {}
    for batch in obstore.list(store, prefix=f"{prefix}/"):
        for meta in batch:
            out[meta["path"]] = bytes(obstore.get(store, meta["path"]).bytes())
    return out


def records(srv: SeaweedServer, prefix: str, cipher: RecordCipher | None = None) -> dict[str, bytes]:
    """Every record below ``prefix``, checked: key string to the entry's bytes (opened with
    ``cipher`` when sealed). An object that is not a whole record raises AssertionError."""
    found: dict[str, bytes] = {}
    for path, data in objects(srv, prefix).items():
        try:
            hdr = decode_header(data)
            assert len(data) == hdr.total_len, f"{path}: {len(data)} bytes, header says {hdr.total_len}"
            stored = data[hdr.header_len :]
            verify_payload(hdr, stored)
        except ValueError as exc:
            raise AssertionError(f"{path} is not a valid record: {exc}") from exc
        if hdr.seal is not None:
            assert cipher is not None, f"{path} is sealed"
            plain = bytearray(hdr.plain_len)
            cipher.open_into(hdr, memoryview(stored), memoryview(plain))
            found[hdr.key] = bytes(plain)
        else:
            found[hdr.key] = stored
    return found
