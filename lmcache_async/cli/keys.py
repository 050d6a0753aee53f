"""``lmcache-async keys list|show|delete``: the entries of a node-server namespace or of a
disk-tier directory, one command for both (``--socket``/``--namespace`` or ``--dir``).

Filters: ``--model`` (the key's model name, exactly) and ``--hash`` (a prefix of the chunk hash
in hex, as keys print it). ``list`` prints one line per entry (key, payload size, shape and
dtype, tier), ``show`` every field, ``delete`` removes the matching entries (a filter or
``--all`` is required) and says how many. ``--json`` prints JSON instead. A server namespace is
read page by page with ``LIST`` (behind the same token as every message; recency untouched); a
disk directory's record headers are read without taking any lock, and deletions run under the
directory lock the tier uses, as ``inspect --purge`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["KeyInfo", "add_keys_parser", "disk_entries", "run_keys", "server_entries"]


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """One entry as the tool reports it. ``stored_bytes``: the pool block or the file;
    ``where``: ``server:<namespace>`` or the file's path; ``pinned``: a lease or hold pins it
    (server only); ``mtime``: the file's (disk only)."""

    key: str
    model: str
    hash: str
    dtype: str
    shape: tuple[int, ...]
    payload_bytes: int
    stored_bytes: int
    tier: str
    where: str
    pinned: bool | None = None
    mtime: float | None = None


def _parts(key: str) -> tuple[str, str]:
    """(model, chunk hash in hex) of a key string; the text before the first ``@`` and "" for
    a key that does not parse."""
    from lmcache_async.keys import CacheEngineKey

    try:
        k = CacheEngineKey.from_string(key)
    except (ValueError, TypeError):
        return key.split("@", 1)[0], ""
    return k.model_name, f"{k.chunk_hash:x}"


def _matches(info: KeyInfo, model: str | None, hash_prefix: str | None) -> bool:
    return (model is None or info.model == model) and (hash_prefix is None or info.hash.startswith(hash_prefix))


def server_entries(client: Any, namespace: str, model: str | None, hash_prefix: str | None) -> Iterator[KeyInfo]:
    """The matching entries of ``client``'s namespace (a :class:`ServerClient`), in key order;
    ``ConnectionError`` when the server does not answer."""
    for e in client.entries():
        key = e.key.decode("utf-8", "replace")
        m, h = _parts(key)
        info = KeyInfo(
            key, m, h, str(e.meta.dtype).removeprefix("torch."), tuple(e.meta.shape), e.meta.nbytes,
            e.block_bytes, "server", f"server:{namespace}", pinned=e.pinned,
        )  # fmt: skip
        if _matches(info, model, hash_prefix):
            yield info


def disk_entries(root: str, model: str | None, hash_prefix: str | None) -> Iterator[tuple[int, Any, KeyInfo]]:
    """(shard, entry file, info) of the matching, readable entries of disk-tier directory
    ``root`` (read-only, no lock; damaged files are skipped: ``inspect`` reports them)."""
    from lmcache_async.disk.budget import list_shard
    from lmcache_async.disk.layout import NUM_SHARDS, shard_name
    from lmcache_async.disk.tools import check_entry_file

    for shard in range(NUM_SHARDS):
        listing = list_shard(root, shard)
        for e in listing.entries:
            path = f"{root}/{shard_name(shard)}/{e.name}"
            try:
                hdr, _n, problem = check_entry_file(path, e.digest, False, bytearray(0))
            except OSError:
                continue
            if hdr is None or problem is not None:
                continue
            m, h = _parts(hdr.key)
            info = KeyInfo(
                hdr.key, m, h, str(hdr.dtype).removeprefix("torch."), tuple(hdr.shape), hdr.plain_len, e.size,
                "disk", path, mtime=e.mtime_ns / 1e9,
            )  # fmt: skip
            if _matches(info, model, hash_prefix):
                yield shard, e, info


def _delete_disk(root: str, doomed: list[tuple[int, Any]]) -> int:
    """Delete entry files under the directory lock, keeping the shared accounting exact."""
    from lmcache_async.disk.budget import DirBudget, ShardListing

    by_shard: dict[int, list[Any]] = {}
    for shard, e in doomed:
        by_shard.setdefault(shard, []).append(e)
    budget = DirBudget(root)
    removed = 0
    try:
        for shard, files in by_shard.items():
            with budget.locked() as led:
                removed += led.delete_listed(ShardListing(shard, files))
                led.recount(shard)
    finally:
        budget.close()
    return removed


def add_keys_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``keys`` on the CLI's subparsers."""
    from lmcache_async.cli.serve import add_server_options

    p: argparse.ArgumentParser = subparsers.add_parser(
        "keys",
        help="list, show or delete entries of a node-server namespace or a disk-tier directory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("action", choices=["list", "show", "delete"])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--dir", help="a disk-tier directory")
    src.add_argument("--namespace", help="a node-server namespace (on the server --socket names)")
    add_server_options(p, token=True)
    p.add_argument("--model", help="only entries of this model")
    p.add_argument("--hash", dest="hash_prefix", help="only entries whose chunk hash (hex) starts with this")
    p.add_argument("--all", action="store_true", help="delete: every entry (no filter needed)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per server call (default 10)")
    p.set_defaults(func=run_keys)
    return p


def run_keys(args: argparse.Namespace) -> int:
    """Run ``keys``; 0 on success, 1 when the source cannot be read, 2 for a usage mistake."""
    prog = "lmcache-async keys"
    if args.hash_prefix is not None:
        args.hash_prefix = args.hash_prefix.lower().removeprefix("0x")
    if args.action == "delete" and not (args.all or args.model or args.hash_prefix):
        print(f"{prog}: error: delete needs --model, --hash or --all", file=sys.stderr)
        return 2
    if args.dir is not None:
        return _run_disk(args, prog)
    return _run_server(args, prog)


def _run_disk(args: argparse.Namespace, prog: str) -> int:
    root = os.path.abspath(args.dir)
    if not os.path.isdir(root):
        print(f"{prog}: error: no such directory: {root}", file=sys.stderr)
        return 1
    found = list(disk_entries(root, args.model, args.hash_prefix))
    infos = [info for _s, _e, info in found]
    if args.action == "delete":
        n = _delete_disk(root, [(s, e) for s, e, _i in found])
        return _report_deleted(args, n, root)
    return _print(args, infos)


def _run_server(args: argparse.Namespace, prog: str) -> int:
    from lmcache_async.cli.serve import server_settings
    from lmcache_async.server.client import ServerClient

    settings = server_settings(args)  # --socket/--token, else the configuration's, as clients have them
    sock = settings.socket
    client = ServerClient(
        sock, args.namespace, token=settings.token, timeout_s=args.timeout, server_uid=settings.server_uid
    )
    try:
        try:
            infos = list(server_entries(client, args.namespace, args.model, args.hash_prefix))
        except ConnectionError as exc:
            print(f"{prog}: cannot list namespace {args.namespace!r} on {sock}: {exc}", file=sys.stderr)
            return 1
        if args.action == "delete":
            got = client.remove([i.key.encode() for i in infos]) if infos else []
            if got is None:
                print(f"{prog}: the server on {sock} did not answer REMOVE", file=sys.stderr)
                return 1
            return _report_deleted(args, sum(got), f"namespace {args.namespace!r}")
        return _print(args, infos)
    finally:
        client.close()


def _report_deleted(args: argparse.Namespace, n: int, where: str) -> int:
    if args.json:
        print(json.dumps({"deleted": n, "from": where}))
    else:
        print(f"deleted {n} entries from {where}")
    return 0


def _print(args: argparse.Namespace, infos: list[KeyInfo]) -> int:
    from lmcache_async.config.units import human_bytes

    if args.json:
        print(json.dumps([asdict(i) for i in infos], indent=2))
        return 0
    for i in infos:
        if args.action == "show":
            print(i.key)
            for k, v in asdict(i).items():
                if k != "key" and v is not None:
                    print(f"  {k:14} {v}")
        else:
            shape = "x".join(map(str, i.shape))
            print(f"{i.key}  {human_bytes(i.payload_bytes)}  {shape} {i.dtype}  {i.tier}")
    total = sum(i.payload_bytes for i in infos)
    print(f"{len(infos)} entries, {human_bytes(total)}")
    return 0
