"""Tools for a disk-tier directory: ``lmcache-async inspect DIR [--verify] [--purge]``.

* :func:`find_tier_dirs` finds the disk-tier directories at or below a directory (``DIR`` may be
  a tier directory itself or a work directory holding tiers in subdirectories, as the demo's
  does), and says where it looked when there are none.
* :func:`inspect_dir` reads every record header (entries, bytes, models, dtypes, oldest/newest,
  temporary files, what the shared accounting says) and, with ``verify=True``, re-checks every
  payload checksum. It only reads: it is safe next to running processes.
* :func:`purge_dir` empties the directory safely: it deletes entry files and the temporary files
  of writers that are gone, under the directory lock the tier uses (so running processes keep
  an exact budget), and leaves every file that is not ours alone.

The directory layout and record format are described in ``docs/formats.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "SEARCH_DEPTH",
    "SEARCH_MAX_DIRS",
    "InspectReport",
    "ProgressFn",
    "TierSearch",
    "add_inspect_parser",
    "check_entry_file",
    "find_tier_dirs",
    "format_report",
    "inspect_dir",
    "is_tier_dir",
    "purge_dir",
    "run_inspect",
]

_CHUNK = 4 << 20


@dataclass
class InspectReport:
    """What :func:`inspect_dir` found. Times are seconds since the epoch (file mtimes)."""

    path: str
    entries: int = 0
    bytes: int = 0
    payload_bytes: int = 0
    models: dict[str, int] = field(default_factory=dict)
    dtypes: dict[str, int] = field(default_factory=dict)
    oldest: float | None = None
    newest: float | None = None
    temp_files: int = 0
    temp_bytes: int = 0
    accounted_bytes: int | None = None
    accounted_files: int | None = None
    verified: bool = False
    verified_bytes: int = 0
    corrupt: list[tuple[str, str]] = field(default_factory=list)
    """``(path, reason)`` of every damaged entry file (headers always; payloads with verify)."""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


ProgressFn = Callable[[int, int], None]
"""``progress(done, total)`` in files."""


def _model_of(key: str) -> str:
    from lmcache_async.keys import CacheEngineKey

    try:
        return CacheEngineKey.from_string(key).model_name
    except ValueError:
        return key.split("@", 1)[0]


def check_entry_file(path: str, digest: bytes, verify: bool, buf: bytearray) -> tuple[Any, int, str | None]:
    """``(header or None, payload bytes read, problem or None)`` for one entry file."""
    import xxhash

    from lmcache_async.disk.layout import key_digest
    from lmcache_async.records import PROBE_LEN, RecordError, decode_header, peek_header_len

    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        try:
            head = os.pread(f.fileno(), PROBE_LEN, 0)
            hlen = peek_header_len(head)
            if hlen > len(head):
                head = os.pread(f.fileno(), hlen, 0)
            hdr = decode_header(head)
        except RecordError as exc:
            return None, 0, str(exc)
        if key_digest(hdr.key) != digest:
            return hdr, 0, "file name does not match the key it holds"
        if size != hdr.total_len:
            return hdr, 0, "file is truncated" if size < hdr.total_len else "trailing bytes"
        if not verify:
            return hdr, 0, None
        h = xxhash.xxh3_64()
        mv = memoryview(buf)
        f.seek(hdr.header_len)
        left = hdr.payload_len
        while left:
            n = f.readinto(mv[: min(left, len(mv))])
            if not n:
                return hdr, hdr.payload_len - left, "file is truncated"
            h.update(mv[:n])
            left -= n
        if h.intdigest() != hdr.checksum:
            return hdr, hdr.payload_len, "payload checksum mismatch"
        return hdr, hdr.payload_len, None


def inspect_dir(
    path: str | os.PathLike[str], verify: bool = False, progress: ProgressFn | None = None
) -> InspectReport:
    """Survey the disk-tier directory ``path`` (read-only). ``verify`` re-reads every payload and
    checks its xxh3 checksum; ``progress(done, total)`` is called after each file.

    Raises ``FileNotFoundError``/``NotADirectoryError`` when ``path`` is not a directory.
    """
    from lmcache_async.disk.budget import list_shard, read_accounting
    from lmcache_async.disk.layout import NUM_SHARDS, shard_name

    root = os.path.abspath(os.fspath(path))
    if not os.path.isdir(root):
        if not os.path.exists(root):
            raise FileNotFoundError(f"no such directory: {root}")
        raise NotADirectoryError(f"not a directory: {root}")
    t0 = time.perf_counter()
    rep = InspectReport(path=root, verified=verify)
    listings = [list_shard(root, s) for s in range(NUM_SHARDS)]
    total = sum(len(li.entries) for li in listings)
    models: Counter[str] = Counter()
    dtypes: Counter[str] = Counter()
    buf = bytearray(_CHUNK) if verify else bytearray(0)
    done = 0
    for li in listings:
        sdir = f"{root}/{shard_name(li.shard)}"
        for name, _mtime in li.tmps:
            rep.temp_files += 1
            try:
                rep.temp_bytes += os.path.getsize(f"{sdir}/{name}")
            except OSError:
                pass
        for e in li.entries:
            fpath = f"{sdir}/{e.name}"
            size, mtime_ns = e.size, e.mtime_ns
            try:
                hdr, nread, problem = check_entry_file(fpath, e.digest, verify, buf)
            except FileNotFoundError:  # deleted meanwhile by a running process
                done += 1
                continue
            except OSError as exc:
                hdr, nread, problem = None, 0, f"unreadable: {exc.strerror or exc}"
            done += 1
            rep.verified_bytes += nread
            if problem is not None:
                rep.corrupt.append((fpath, problem))
            else:
                rep.entries += 1
                rep.bytes += size
                rep.payload_bytes += hdr.payload_len
                models[_model_of(hdr.key)] += 1
                dtypes[str(hdr.dtype).removeprefix("torch.")] += 1
                mt = mtime_ns / 1e9
                rep.oldest = mt if rep.oldest is None else min(rep.oldest, mt)
                rep.newest = mt if rep.newest is None else max(rep.newest, mt)
            if progress is not None:
                progress(done, total)
    rep.models = dict(models.most_common())
    rep.dtypes = dict(dtypes.most_common())
    acct = read_accounting(root)
    if acct is not None:
        rep.accounted_bytes, rep.accounted_files = acct
    rep.seconds = time.perf_counter() - t0
    return rep


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    age = max(time.time() - t, 0.0)
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t))} ({_size_age(age)} ago)"


def _size_age(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def format_report(report: InspectReport) -> str:
    """Human-readable text of ``report``."""
    r = report
    lines = [
        f"directory   {r.path}",
        f"entries     {r.entries}",
        f"bytes       {_size(r.bytes)} ({r.bytes} B; payload {_size(r.payload_bytes)})",
    ]
    if r.accounted_bytes is not None:
        match = "matches" if (r.accounted_bytes, r.accounted_files) == (r.bytes, r.entries) else "differs"
        lines.append(
            f"accounting  {_size(r.accounted_bytes)} in {r.accounted_files} files ({match}; the "
            "tier repairs it at start)"
        )
    else:
        lines.append("accounting  none (no disk tier has used this directory yet)")
    lines.append(f"oldest      {_when(r.oldest)}")
    lines.append(f"newest      {_when(r.newest)}")
    if r.models:
        lines.append("models")
        lines.extend(f"  {n:>8}  {m}" for m, n in r.models.items())
    if r.dtypes:
        lines.append("dtypes      " + ", ".join(f"{d} x{n}" for d, n in r.dtypes.items()))
    lines.append(f"temp files  {r.temp_files} ({_size(r.temp_bytes)})")
    if r.verified:
        rate = r.verified_bytes / r.seconds / 1e6 if r.seconds > 0 else 0.0
        lines.append(f"verified    {_size(r.verified_bytes)} of payload in {r.seconds:.2f} s ({rate:.0f} MB/s)")
    label = "corrupt" if r.verified else "corrupt (headers only; --verify checks payloads)"
    lines.append(f"{label}  {len(r.corrupt)}")
    lines.extend(f"  {p}: {why}" for p, why in r.corrupt)
    return "\n".join(lines)


def purge_dir(path: str | os.PathLike[str]) -> int:
    """Delete every entry file, and the temporary files whose writer is gone, under the
    directory lock (running processes keep an exact budget). Files that are not ours are left
    alone. Returns how many files were deleted. ``FileNotFoundError`` when ``path`` is missing.
    """
    from lmcache_async.disk.budget import DirBudget, list_shard
    from lmcache_async.disk.layout import ACCT_NAME, NUM_SHARDS, reap_temp, shard_name

    root = os.path.abspath(os.fspath(path))
    if not os.path.isdir(root):
        raise FileNotFoundError(f"no such directory: {root}")
    if not os.path.exists(f"{root}/{ACCT_NAME}") and not any(
        list_shard(root, s).entries or list_shard(root, s).tmps for s in range(NUM_SHARDS)
    ):
        return 0  # not a disk-tier directory (or already empty): leave no trace in it
    budget = DirBudget(root)
    removed = 0
    try:
        for shard in range(NUM_SHARDS):
            sdir = f"{root}/{shard_name(shard)}"
            with budget.locked() as led:
                listing = list_shard(root, shard)
                if listing.entries or led.shard(shard) != (0, 0):
                    removed += led.delete_listed(listing)
                    led.recount(shard)
            now = time.time()
            for name, mtime in listing.tmps:
                removed += reap_temp(f"{sdir}/{name}", mtime, now)
    finally:
        budget.close()
    return removed


# ---- finding tier directories ------------------------------------------------------------------
SEARCH_DEPTH = 3
"""How many directory levels below ``DIR`` ``inspect`` looks for tier directories by default
(the demo's work directory holds ``kv/`` and ``ec/ec-disk/``)."""
SEARCH_MAX_DIRS = 10_000
"""``inspect`` stops looking after this many directories (a mistaken ``DIR`` such as ``/``)."""


def is_tier_dir(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a disk-tier directory: it holds the tier's accounting file, or a
    shard directory (``00`` .. ``ff``) holding an entry file. Reads directory listings only."""
    from lmcache_async.disk.layout import ACCT_NAME, is_shard_name, parse_entry_name

    root = os.fspath(path)
    if os.path.isfile(os.path.join(root, ACCT_NAME)):
        return True
    try:
        with os.scandir(root) as it:
            shards = [e.path for e in it if is_shard_name(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return False
    for sdir in shards:
        try:
            with os.scandir(sdir) as it:
                if any(parse_entry_name(e.name) is not None for e in it):
                    return True
        except OSError:
            continue
    return False


@dataclass
class TierSearch:
    """What :func:`find_tier_dirs` found below ``root`` and where it looked."""

    root: str
    found: list[str] = field(default_factory=list)
    """Absolute paths of the tier directories, in breadth-first, then name order."""
    looked_in: int = 0
    """Directories examined, ``root`` included."""
    depth: int = SEARCH_DEPTH
    stopped_early: bool = False
    """True when :data:`SEARCH_MAX_DIRS` ended the search before every directory was seen."""
    deeper: bool = False
    """True when directories lie below the deepest level searched (``depth`` cut the search)."""
    shard_of: str | None = None
    """The tier directory when ``root`` is one of its shard directories (then it is ``found``)."""

    def where(self) -> str:
        """Where the search looked, in words (for the message that it found nothing)."""
        below = self.looked_in - 1
        levels = "1 level" if self.depth == 1 else f"{self.depth} levels"
        if below <= 0 and not self.deeper:
            text = f"looked in {self.root}, which has no subdirectories"
        elif below <= 0:
            text = f"looked in {self.root} only"
        else:
            text = f"looked in {self.root} and {below} director{'y' if below == 1 else 'ies'} up to {levels} below it"
        if self.deeper:
            text += f"; deeper directories were not searched (--depth {self.depth})"
        if self.stopped_early:
            text += f"; stopped after {self.looked_in} directories"
        return text


def find_tier_dirs(
    path: str | os.PathLike[str], depth: int = SEARCH_DEPTH, max_dirs: int = SEARCH_MAX_DIRS
) -> TierSearch:
    """The disk-tier directories at or below ``path``, at most ``depth`` levels down (breadth
    first, symbolic links not followed, no descent into a tier directory). When ``path`` is a
    shard directory of a tier, that tier is the one found.

    Raises ``FileNotFoundError``/``NotADirectoryError`` when ``path`` is not a directory.
    """
    from lmcache_async.disk.layout import is_shard_name

    root = os.path.abspath(os.fspath(path))
    if not os.path.isdir(root):
        if not os.path.exists(root):
            raise FileNotFoundError(f"no such directory: {root}")
        raise NotADirectoryError(f"not a directory: {root}")
    search = TierSearch(root=root, depth=depth)
    parent = os.path.dirname(root)
    if is_shard_name(os.path.basename(root)) and is_tier_dir(parent):
        search.looked_in = 1
        search.found.append(parent)
        search.shard_of = parent
        return search
    level = [root]
    for d in range(depth + 1):
        below: list[str] = []
        for cur in level:
            if search.looked_in >= max_dirs:
                search.stopped_early = True
                return search
            search.looked_in += 1
            if is_tier_dir(cur):
                search.found.append(cur)
                continue
            try:
                with os.scandir(cur) as it:
                    subdirs = sorted(e.path for e in it if e.is_dir(follow_symlinks=False))
            except OSError:  # unreadable: nothing below it to find
                continue
            if d == depth:
                search.deeper = search.deeper or bool(subdirs)
            else:
                below.extend(subdirs)
        level = below
    return search


# ---- the command -------------------------------------------------------------------------------
def add_inspect_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``inspect`` sub-command to an ``argparse`` sub-parser collection."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "inspect",
        help="survey, verify or empty a disk-tier directory",
        description="Entries, bytes, models and ages of a disk-tier directory (local_disk); --verify "
        "re-checks every checksum; --purge empties it safely (entries and dead writers' temp files "
        "only). DIR may also be a work directory holding tier directories below it (such as the "
        "demo's, with --keep): each one found is reported. Exit status: 0 fine, 1 corrupt entries "
        "found, 2 no tier directory found or DIR unusable.",
    )
    p.add_argument("dir", metavar="DIR", help="a disk-tier directory, or a directory with tier directories below it")
    p.add_argument("--verify", action="store_true", help="re-read every payload and check its checksum")
    p.add_argument("--purge", action="store_true", help="delete every entry (safe next to running processes)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--depth",
        type=int,
        default=SEARCH_DEPTH,
        help=f"how many levels below DIR to look for tier directories (default {SEARCH_DEPTH})",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (none is drawn off a terminal)")
    p.set_defaults(func=run_inspect)
    return p


def _error(message: str) -> int:
    print(f"lmcache-async inspect: {message}", file=sys.stderr)
    return 2


def run_inspect(args: argparse.Namespace) -> int:
    """Run ``inspect``: 0 when fine, 1 when corrupt entries were found, 2 on errors (one line on
    stderr), including when no tier directory is at or below ``args.dir``.

    JSON: the report object when ``DIR`` is a tier directory; ``{"searched": DIR, "directories":
    [report, ...]}`` when the tiers were found below it.
    """
    from lmcache_async.cli.progress import Progress

    depth = getattr(args, "depth", SEARCH_DEPTH)
    if depth < 0:
        return _error(f"--depth must be >= 0, got {depth}")
    try:
        search = find_tier_dirs(args.dir, depth=depth)
    except OSError as exc:
        return _error(str(exc))
    if not search.found:
        return _error(
            f"no disk-tier directory at or below {search.root}: {search.where()}; a disk-tier directory "
            "holds .lmcache-disk.acct and shard directories 00..ff"
        )
    nested = search.found != [search.root] and search.shard_of is None
    names = [os.path.relpath(d, search.root) for d in search.found]
    if search.shard_of is not None and not args.json:
        print(f"{search.root} is a shard directory of the disk tier {search.shard_of}")
    if nested and not args.json:
        kind = "directory" if len(names) == 1 else "directories"
        cut = f" (deeper directories were not searched: --depth {search.depth})" if search.deeper else ""
        print(f"{len(names)} disk-tier {kind} below {search.root}: {', '.join(names)}{cut}")
    reports: list[InspectReport] = []
    try:
        for tier, name in zip(search.found, names, strict=True):
            if args.purge:
                n = purge_dir(tier)
                print(f"purged {tier}: {n} files deleted")
                continue
            what = "verify" if args.verify else "read"
            desc = f"{what} {name}" if nested else what
            with Progress(0, desc, "file", enabled=not args.no_progress, delay=0.5) as bar:
                reports.append(inspect_dir(tier, verify=args.verify, progress=bar.update_to))
    except OSError as exc:
        return _error(str(exc))
    if args.purge:
        return 0
    if args.json:
        if nested:
            print(json.dumps({"searched": search.root, "directories": [r.to_dict() for r in reports]}, indent=2))
        else:
            print(json.dumps(reports[0].to_dict(), indent=2))
    else:
        print("\n\n".join(format_report(r) for r in reports))
    return 1 if any(r.corrupt for r in reports) else 0
