"""Medium hooks for tiers that keep one record file per entry (the disk tier, ``fs://``).

:class:`RecordDirectoryMedium` implements :meth:`~lmcache_async.testing.hooks.BackendHooks.medium_keys`
and :meth:`~lmcache_async.testing.hooks.BackendHooks.medium_bytes` by walking the test's
location and decoding every published record with :mod:`lmcache_async.records` — never through
the backend under test — so the suite sees what is really on disk: a record under the wrong
key, a stale file after ``remove``, leftovers after ``clear`` or a payload that differs.
Temporary files (names starting with ``.``) are not entries.
"""

from __future__ import annotations

import os
from pathlib import Path

from lmcache_async.records import decode_header, verify_payload
from lmcache_async.testing.hooks import MediumHooks
from lmcache_async.tiers import StorageBackend

__all__ = ["RecordDirectoryMedium", "read_record_dir"]


def read_record_dir(root: Path, suffix: str) -> dict[str, bytes]:
    """Every published record under ``root`` whose file name ends with ``suffix``: key string
    to payload. A file that does not decode as a whole record raises ``AssertionError`` naming
    it (the medium holds something a reader would have to discard)."""
    found: dict[str, bytes] = {}
    for dirpath, _dirs, files in os.walk(root):
        for fn in files:
            if fn.startswith(".") or not fn.endswith(suffix):
                continue
            path = Path(dirpath, fn)
            data = path.read_bytes()
            try:
                header = decode_header(data)
                payload = data[header.header_len : header.header_len + header.payload_len]
                assert len(data) == header.total_len, f"{path}: {len(data)} bytes, header says {header.total_len}"
                verify_payload(header, payload)
            except ValueError as exc:  # RecordError is a ValueError
                raise AssertionError(f"{path} is not a valid record: {exc}") from exc
            assert header.key not in found, f"two records for {header.key!r} (one is {path})"
            found[header.key] = payload
    return found


class RecordDirectoryMedium(MediumHooks):
    """Mixin for a conformance class whose backend stores one record file per entry under the
    test's ``location``. Set :attr:`record_suffix` to the tier's entry-file suffix."""

    #: How the tier's published entry files end (``.lmc`` for the disk tier, ``.rec`` for fs://).
    record_suffix: str = ".lmc"

    def medium_keys(self, backend: StorageBackend, location: Path) -> set[str] | None:
        """Key strings of the records under ``location``, decoded from the files."""
        return set(read_record_dir(location, self.record_suffix))

    def medium_bytes(self, backend: StorageBackend, location: Path, key: str) -> bytes | None:
        """The payload of ``key``'s record under ``location``, None when there is none."""
        return read_record_dir(location, self.record_suffix).get(key)

    def medium_items(self, backend: StorageBackend, location: Path) -> dict[str, bytes] | None:
        """Every record under ``location`` in one pass: key string to payload."""
        return read_record_dir(location, self.record_suffix)
