"""A thinker's payload reaches a talker in another process through a shared tier: the disk
tier, a real node cache server (``lmcache-async serve``) and a real redis-server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from omni.conftest import server_extra
from server.conftest import ServerProcess

WORKER = str(Path(__file__).resolve().parent / "stage_worker.py")
SMALL = {"max_local_cpu_size": 1 / 32, "staging_size": 1 / 32, "blocking_timeout_secs": 20}

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(params=["connector", "store"])
def impl(request: pytest.FixtureRequest) -> str:
    if request.param == "connector":
        request.getfixturevalue("omni")
    return str(request.param)


def run_pair(impl: str, extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start the talker first (it waits with a deadline), then the thinker; both results."""
    rid = f"req-{uuid.uuid4().hex[:12]}"
    cfg = json.dumps(extra)
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_TARGET_DEVICE": "cpu"}
    talker = subprocess.Popen(
        [sys.executable, WORKER, "talker", impl, cfg, rid],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert talker.stdout is not None
        seen = []
        while (line := talker.stdout.readline()) and line.strip() != "ready":
            seen.append(line)  # vLLM may log to stdout before the worker is ready
        assert line.strip() == "ready", "".join(seen)[-3000:]
        thinker = subprocess.run(
            [sys.executable, WORKER, "thinker", impl, cfg, rid], capture_output=True, text=True, timeout=400, env=env
        )
        assert thinker.returncode == 0, thinker.stderr[-3000:]
        out, err = talker.communicate(timeout=400)
        assert talker.returncode == 0, err[-3000:]
    finally:
        if talker.poll() is None:
            talker.kill()
            talker.wait()
    return json.loads(thinker.stdout.strip().splitlines()[-1]), json.loads(out.strip().splitlines()[-1])


def check(thinker: dict[str, Any], talker: dict[str, Any]) -> None:
    assert thinker["payload"][0] is True and thinker["raw"] == [True, 3000]
    assert talker["ok"] is True
    assert talker["again"] is False  # the talker consumed what it read
    assert thinker["health"] == talker["health"] == "healthy"


def test_payload_crosses_processes_through_the_disk_tier(impl: str, tmp_path: Path) -> None:
    extra = {**SMALL, "local_disk": str(tmp_path / "disk"), "max_local_disk_size": 0.1}
    check(*run_pair(impl, extra))


def test_payload_crosses_processes_through_the_node_server(impl: str, cache_server: ServerProcess) -> None:
    check(*run_pair(impl, server_extra(cache_server)))


def test_payload_crosses_processes_through_redis(impl: str, redis_url: str) -> None:
    extra = {**SMALL, "remote_url": redis_url, "namespace": f"omni-{uuid.uuid4().hex[:6]}"}
    check(*run_pair(impl, extra))
