"""Omni stage-connector figures across processes, against same-run baselines (opt-in suite).

The suite starts ``lmcache-async serve`` and a consumer child process (the "talker"); this
process is the producer (the "thinker"). Both use ``LMCacheOmniConnector`` where vllm_omni
imports (the venv of ``scripts/omni_env.sh``), else the framework-free ``OmniStageStore`` it
delegates to (the note says which); their only tier is the node server.

* **16 MiB stage payload put -> get across processes**: the producer puts a 16 MiB tensor
  (``supports_raw_data``) and tells the child its key over a pipe; the child receives it with
  ``get_with_deadline`` and answers. Baseline: the same bytes through the node server's raw
  client (``ServerClient.put`` of a pool block here, ``ServerClient.get`` into a pre-touched
  staging block there), with the same pipe messages. Throughput ratio; target >= 0.7. The same
  figure for a dict payload (16 MiB of bf16 hidden states plus token ids, our record codec) is
  reported beside it.
* **get_with_deadline overshoot** when the producer never writes (deadline 100 ms): median
  and worst time past the deadline; target <= 50 ms. The note carries the overshoot of a bare
  ``time.sleep(0.1)`` measured in the same run (the scheduler's own wake-up latency).

Rounds alternate figure and baseline; each figure is the median of at least 15 warmed rounds (5
with ``--quick``): on a loaded machine a burst of other work can swallow a few rounds whole.
Run ``lmcache-async bench --suite omni`` or ``python -m lmcache_async_bench.omni [--quick]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import IO, Any

import torch

from lmcache_async.keys import CacheEngineKey, stable_u64_from_str
from lmcache_async.memory import PoolAllocator
from lmcache_async.server.client import ServerClient, query_status

from .common import BenchOptions, MiB, Result, alternate

__all__ = ["DEADLINE_S", "PAYLOAD", "RAW_NAMESPACE", "SUITE", "child", "main", "run"]

SUITE = "omni"
PAYLOAD = 16 * MiB
DEADLINE_S = 0.1
RAW_NAMESPACE = "bench-raw"


def _impl() -> str:
    """``connector`` where vllm_omni's connector API imports, else ``store``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from vllm_omni.distributed.omni_connectors import OmniConnectorFactory  # noqa: F401
    except Exception:
        return "store"
    return "connector"


def _extra(sock: str) -> dict[str, Any]:
    return {
        "tier_order": ["server"],
        "local_cpu": False,
        "cache_server_socket": sock,
        "remote_timeout_s": 10.0,
        "blocking_timeout_secs": 30,
        "staging_size": 0.125,
    }


def _build(impl: str, sock: str) -> Any:
    if impl == "connector":
        from vllm_omni.distributed.omni_connectors import ConnectorSpec, OmniConnectorFactory

        from lmcache_async.integration.omni import CONNECTOR_NAME, register

        register()
        return OmniConnectorFactory.create_connector(ConnectorSpec(name=CONNECTOR_NAME, extra=_extra(sock)))
    from lmcache_async.integration.omni import OmniStageStore, load_stage_options

    cfg, opts = load_stage_options(_extra(sock))
    return OmniStageStore(cfg, opts)


def _raw_key(name: str) -> bytes:
    return CacheEngineKey("bench/omni-raw", 1, 0, stable_u64_from_str(name), torch.uint8).to_string().encode()


def child(sock: str, impl: str) -> int:
    """The consumer: one command per stdin line (``omni KEY`` / ``raw KEY``), one answer line each
    on the original stdout; everything else written to fd 1 (vLLM logs there) goes to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    conn = _build(impl, sock)
    client = ServerClient(sock, RAW_NAMESPACE, timeout_s=30.0)
    staging = PoolAllocator(4 * PAYLOAD, name="bench-omni-staging")
    print("ready", file=proto, flush=True)
    try:
        for line in sys.stdin:
            cmd, key = line.split()
            if cmd == "omni":
                got = conn.get_with_deadline("thinker", "talker", key, None, deadline=time.monotonic() + 30)
                print("ok" if got is not None else "miss", file=proto, flush=True)
            elif cmd == "raw":
                objs = client.get([_raw_key(key)], staging.allocate)
                obj = objs[0] if objs else None
                print("ok" if obj is not None else "miss", file=proto, flush=True)
                if obj is not None:
                    obj.ref_count_down()
                client.remove([_raw_key(key)])  # the connector consumes what it reads: so does the baseline
            else:
                break
    finally:
        client.close()
        conn.close()
        proto.close()
    return 0


class _Pair:
    """The producer's side of the rounds: the connector, the raw client and the child's pipes."""

    def __init__(self, sock: str, impl: str, proc: subprocess.Popen[str]) -> None:
        self.conn = _build(impl, sock)
        self.client = ServerClient(sock, RAW_NAMESPACE, timeout_s=30.0)
        self.pool = PoolAllocator(2 * PAYLOAD, name="bench-omni-src")
        src = self.pool.allocate([PAYLOAD], torch.uint8)
        assert src is not None
        src.tensor.copy_(torch.randint(0, 255, (PAYLOAD,), dtype=torch.uint8))
        self.src = src
        self.tensor = torch.randn(PAYLOAD // 4)
        self.tree = {"hidden_states": torch.randn(PAYLOAD // 2).to(torch.bfloat16), "token_ids": list(range(512))}
        self.proc = proc
        self.n = itertools.count()
        assert proc.stdin is not None and proc.stdout is not None
        self.stdin: IO[str] = proc.stdin
        self.stdout: IO[str] = proc.stdout

    def _ask(self, cmd: str, key: str) -> None:
        self.stdin.write(f"{cmd} {key}\n")
        self.stdin.flush()
        reply = self.stdout.readline().strip()
        if reply != "ok":
            raise RuntimeError(f"the consumer answered {reply!r} for {cmd} {key}")

    def omni_round(self, data: Any) -> float:
        key = f"req{next(self.n)}_0_0"
        t0 = time.perf_counter()
        ok = self.conn.put("thinker", "talker", key, data)[0]
        if not ok:
            raise RuntimeError("the connector refused the payload")
        self._ask("omni", key)
        return time.perf_counter() - t0

    def raw_round(self) -> float:
        key = f"raw{next(self.n)}"
        t0 = time.perf_counter()
        if self.client.put([(_raw_key(key), self.src)]) != [True]:
            raise RuntimeError("the raw put failed")
        self._ask("raw", key)
        return time.perf_counter() - t0

    def close(self) -> None:
        try:
            self.stdin.write("quit -\n")
            self.stdin.flush()
        except OSError:
            pass
        self.src.ref_count_down()
        self.client.close()
        self.conn.close()


def _overshoot(conn: Any, reps: int) -> tuple[list[float], list[float]]:
    ours: list[float] = []
    sleeps: list[float] = []
    for i in range(reps):
        deadline = time.monotonic() + DEADLINE_S
        conn.get_with_deadline("thinker", "talker", f"never-{i}", None, deadline=deadline)
        ours.append(time.monotonic() - deadline)
        t_end = time.monotonic() + DEADLINE_S
        time.sleep(DEADLINE_S)
        sleeps.append(time.monotonic() - t_end)
    return ours, sleeps


def _figures(opts: BenchOptions, pair: _Pair, impl: str) -> list[Result]:
    reps = max(opts.reps, 5 if opts.quick else 15)
    gib = PAYLOAD / (1 << 30)
    opts.say(f"omni: 16 MiB put -> get across processes ({impl}), {reps} rounds")
    t_tensor, t_tree, t_raw = alternate(
        [lambda: pair.omni_round(pair.tensor), lambda: pair.omni_round(pair.tree), pair.raw_round],
        reps=reps,
        warmup=2,
    )
    note = f"{impl}; node-server tier only; same pipe messages in both"
    out = [
        Result(SUITE, "16 MiB tensor payload put->get, 2 processes", gib / t_tensor, "GiB/s",
               "node server raw put/get, same bytes", gib / t_raw, higher_is_better=True, target=0.7,
               target_kind="min", note=note),
        Result(SUITE, "16 MiB dict payload (record codec) put->get, 2 processes", gib / t_tree, "GiB/s",
               "node server raw put/get, same bytes", gib / t_raw, higher_is_better=True, note=note),
    ]  # fmt: skip
    opts.say("omni: get_with_deadline overshoot")
    ours, sleeps = _overshoot(pair.conn, max(reps, 9))
    sleep_note = f"time.sleep({DEADLINE_S}) overshoot same run: median {statistics.median(sleeps) * 1e3:.2f} ms"
    out += [
        Result(SUITE, "get_with_deadline overshoot, nothing written (median)", statistics.median(ours) * 1e3, "ms",
               target=50.0, note=sleep_note),
        Result(SUITE, "get_with_deadline overshoot, nothing written (worst)", max(ours) * 1e3, "ms",
               target=50.0, note=f"max of {len(ours)}; time.sleep worst {max(sleeps) * 1e3:.2f} ms"),
    ]  # fmt: skip
    return out


def _start_server(work: Path) -> tuple[str, subprocess.Popen[bytes]]:
    sock = str(work / "s" / "cache.sock")
    cfg = work / "server.yaml"
    cfg.write_text("max_local_cpu_size: 0.25\ncache_server_pretouch: true\n")
    server = subprocess.Popen(
        [sys.executable, "-m", "lmcache_async.cli", "serve", "--socket", sock, "--config", str(cfg)],
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            query_status(sock, timeout_s=2.0)
            return sock, server
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError("the cache server did not start") from None
            time.sleep(0.1)


def run(opts: BenchOptions) -> list[Result]:
    """Every Omni figure (see the module docstring)."""
    impl = _impl()
    # A Unix socket path is limited to 107 bytes: keep it in a short temp directory.
    with tempfile.TemporaryDirectory(prefix="lmc-bench-omni-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o700)
        sock, server = _start_server(work)
        proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache_async_bench.omni", "--child", sock, impl],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        pair: _Pair | None = None
        try:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("the consumer process did not start")
            pair = _Pair(sock, impl, proc)
            return _figures(opts, pair, impl)
        finally:
            if pair is not None:
                pair.close()
            for p in (proc, server):
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(20)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lmcache_async_bench.omni", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--child", nargs=2, metavar=("SOCKET", "IMPL"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(*args.child)
    from .common import format_table

    print(format_table(run(BenchOptions(reps=args.reps, quick=args.quick))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
