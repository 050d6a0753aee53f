"""The ``lmcache-async`` command speaks to people: one-line errors with the right exit status,
output paths checked before work starts, tier directories found below a work directory,
``config --explain``, bench tables and plots that say which way is better.

The main behaviours run the installed command in a subprocess; their variations call
:func:`lmcache_async.cli.main` in-process (each subprocess pays the torch import)."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmcache_async.cli import build_parser, check_output_file, check_work_dir, main
from lmcache_async.cli.progress import Progress, bars_wanted
from lmcache_async_bench.common import Result, format_series_summary, format_table

ROOT = Path(__file__).resolve().parents[2]


def _command() -> list[str]:
    exe = shutil.which("lmcache-async", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "lmcache_async.cli"]


def _run(*argv: str, env: dict[str, str] | None = None, tmp: Path | None = None) -> subprocess.CompletedProcess[str]:
    own = ("LMCACHE_", "LMCACHE_ASYNC_")
    full = {k: v for k, v in os.environ.items() if not (k.startswith(own[0]) and not k.startswith(own[1]))}
    if tmp is not None:
        full["XDG_STATE_HOME"] = str(tmp / "state")
    full.update(env or {})
    return subprocess.run([*_command(), *argv], capture_output=True, text=True, env=full, timeout=120, cwd=ROOT)


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> subprocess.CompletedProcess[str]:
    """``main(argv)`` in-process, its exit status and output shaped like a subprocess run."""
    rc = main(list(argv))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(argv), rc, out.out, out.err)


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


# ---- errors ------------------------------------------------------------------------------------
def test_invalid_config_value_is_one_line_naming_key_value_and_source(tmp_path: Path) -> None:
    proc = _run("config", env={"LMCACHE_CHUNK_SIZE": "abc"}, tmp=tmp_path)
    assert proc.returncode == 1  # config checks the configuration: one that does not load fails the check
    line = _one_error_line(proc)
    assert line.startswith("lmcache-async config: error:")
    assert "chunk_size" in line and "'abc'" in line and "env LMCACHE_CHUNK_SIZE" in line


def test_unreadable_config_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [\n")  # a YAML error whose message spans several lines
    proc = _main(capsys, "config", "--file", str(bad))
    assert proc.returncode == 1
    assert str(bad) in _one_error_line(proc)


@pytest.mark.slow  # a CLI subprocess; test_bad_option_value_is_one_usage_line checks the usage line in-process
def test_unknown_option_is_one_usage_line(tmp_path: Path) -> None:
    proc = _run("bench", "--no-such-option", tmp=tmp_path)
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert "--no-such-option" in line and "--help" in line


def test_bad_option_value_is_one_usage_line(capsys: pytest.CaptureFixture[str]) -> None:
    proc = _main(capsys, "bench", "--reps", "0")
    assert proc.returncode == 2
    assert "--reps" in _one_error_line(proc)


@pytest.mark.slow  # several CLI subprocesses
def test_unexpected_error_is_one_line_naming_the_traceback_file(tmp_path: Path) -> None:
    code = (
        "import sys, lmcache_async.cli as cli\n"
        "def boom(args):\n"
        "    raise ZeroDivisionError('the divisor was zero')\n"
        "cli._cmd_config = boom\n"
        "sys.exit(cli.main(['config']))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1
    line = _one_error_line(proc)
    assert "ZeroDivisionError: the divisor was zero" in line
    logs = list((tmp_path / "state" / "lmcache-async").glob("error-*.log"))
    assert len(logs) == 1 and str(logs[0]) in line
    text = logs[0].read_text()
    assert "Traceback" in text and "the divisor was zero" in text


def test_version_names_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    from lmcache_async import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"lmcache-async {__version__}")


def test_every_subcommand_has_a_description_and_a_help_line() -> None:
    parser = build_parser()
    assert parser.description
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {a.dest: a.help for a in sub._choices_actions}
    assert set(sub.choices) == {"demo", "config", "bench", "inspect", "serve", "status", "keygen", "keys"}
    for name, p in sub.choices.items():
        assert p.description and len(p.description) > 40, name
        assert helps[name], name


# ---- output paths are checked before long work -------------------------------------------------
@pytest.mark.slow  # several CLI subprocesses
def test_bench_json_in_a_missing_directory_fails_before_any_suite_runs(tmp_path: Path) -> None:
    target = tmp_path / "missing" / "out.json"
    proc = _run("bench", "--suite", "cpu", "--json", str(target), tmp=tmp_path)
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert "--json" in line and str(tmp_path / "missing") in line and "does not exist" in line
    assert "suite cpu" not in proc.stderr and proc.stdout == ""


def test_bench_plot_that_is_a_directory_or_an_unknown_format_is_rejected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    proc = _main(capsys, "bench", "--suite", "cpu", "--plot", str(tmp_path))
    assert proc.returncode == 2
    assert "is a directory" in _one_error_line(proc)
    proc = _main(capsys, "bench", "--suite", "cpu", "--plot", str(tmp_path / "out.notanimage"))
    assert proc.returncode == 2
    assert "unknown image format" in _one_error_line(proc)


def test_demo_workdir_that_is_a_file_is_rejected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "a-file"
    f.write_text("x")
    proc = _main(capsys, "demo", "--workdir", str(f))
    assert proc.returncode == 2
    assert "not a directory" in _one_error_line(proc)


def test_output_checks_accept_new_files_and_creatable_directories(tmp_path: Path) -> None:
    assert check_output_file(str(tmp_path / "new.json"), "--json") == str(tmp_path / "new.json")
    assert check_work_dir(str(tmp_path / "a" / "b"), "--workdir") == str(tmp_path / "a" / "b")
    assert not (tmp_path / "a").exists()  # checking creates nothing


# ---- inspect finds tier directories below a work directory -------------------------------------
def _tier(path: Path, items: int) -> None:
    """A real disk tier at ``path`` holding ``items`` encoder outputs."""
    from lmcache_async.config import LMCacheEngineConfig
    from lmcache_async.engines.encoder_cache import ECCacheEngine
    from lmcache_async.metadata import LMCacheEngineMetadata

    cfg = LMCacheEngineConfig.from_defaults(
        max_local_cpu_size=1 / 64, staging_size=1 / 256, local_disk=str(path), max_local_disk_size=0.1
    )
    with ECCacheEngine(cfg, LMCacheEngineMetadata(model_name="cli/test"), torch.float16) as engine:
        for i in range(items):
            assert engine.put(f"item-{i}", torch.full((16, 64), float(i), dtype=torch.float16))
        engine.flush(timeout=60)


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Laid out like the demo's work directory: ``kv/`` and ``ec/ec-disk/``."""
    root = tmp_path_factory.mktemp("work")
    _tier(root / "kv", 3)
    _tier(root / "ec" / "ec-disk", 2)
    return root


@pytest.mark.slow  # several CLI subprocesses
def test_inspect_of_a_work_dir_reports_every_tier_below_it(work_dir: Path, tmp_path: Path) -> None:
    proc = _run("inspect", str(work_dir), tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"2 disk-tier directories below {work_dir}: kv, ec/ec-disk" in proc.stdout
    assert "entries     3" in proc.stdout and "entries     2" in proc.stdout


def test_inspect_json_of_a_work_dir_lists_every_tier(work_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = _main(capsys, "inspect", str(work_dir), "--json", "--verify")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["searched"] == str(work_dir)
    assert {d["path"]: d["entries"] for d in out["directories"]} == {
        str(work_dir / "kv"): 3,
        str(work_dir / "ec" / "ec-disk"): 2,
    }


def test_inspect_of_a_tier_dir_prints_its_report_alone(work_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = _main(capsys, "inspect", str(work_dir / "kv"), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["entries"] == 3


@pytest.mark.slow  # several CLI subprocesses
def test_inspect_says_where_it_looked_when_it_finds_nothing(tmp_path: Path) -> None:
    (tmp_path / "empty" / "a" / "b").mkdir(parents=True)
    proc = _run("inspect", str(tmp_path / "empty"), tmp=tmp_path)
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert f"no disk-tier directory at or below {tmp_path / 'empty'}" in line
    assert "looked in" in line and "2 directories" in line


def test_inspect_depth_bounds_the_search_and_says_so(work_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = _main(capsys, "inspect", str(work_dir), "--depth", "0")
    assert proc.returncode == 2
    assert "--depth 0" in _one_error_line(proc)


def test_inspect_of_a_missing_directory_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = _main(capsys, "inspect", str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert "no such directory" in _one_error_line(proc)


# ---- config --explain --------------------------------------------------------------------------
@pytest.mark.slow  # several CLI subprocesses
def test_config_explain_prints_meaning_default_value_and_source(tmp_path: Path) -> None:
    proc = _run("config", "--explain", "chunk_size", env={"LMCACHE_CHUNK_SIZE": "512"}, tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "Tokens per KV/HS chunk." in out
    assert "default   256" in out and "value     512" in out and "source    env LMCACHE_CHUNK_SIZE" in out


def test_config_explain_accepts_the_environment_variable_name_and_prints_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    proc = _main(capsys, "config", "--explain", "LMCACHE_METRICS_PORT", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["key"] == "metrics_port" and out["default"] is None and out["source"] == "default"
    assert out["bounds"] == ">= 0, <= 65535"


@pytest.mark.slow  # several CLI subprocesses
def test_config_explain_of_an_unknown_key_names_close_matches(tmp_path: Path) -> None:
    proc = _run("config", "--explain", "chunk_sise", tmp=tmp_path)
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert "'chunk_sise'" in line and "chunk_size" in line


# ---- bench tables, plots and progress ----------------------------------------------------------
def _curve() -> list[Result]:
    return [
        Result("sweep", f"put {s}", v, "GB/s", "copy_", b, True, params={"size": s, "series": "put", "panel": "cpu"})
        for s, v, b in ((1 << 16, 1.0, 2.0), (1 << 20, 3.0, 4.0))
    ]


def test_bench_table_says_which_way_is_better_and_gives_value_targets_units() -> None:
    rs = [Result("cpu", "contains", 0.5, "µs", target=3.0), Result("disk", "write", 9.0, "files/s", "file", 10.0, True)]
    header, _, first, second = format_table(rs).splitlines()
    assert "better" in header
    assert "lower" in first and "<= 3 µs" in first
    assert "higher" in second


def test_series_summary_gives_min_max_of_values_baselines_and_ratios() -> None:
    text = format_series_summary(_curve())
    assert "cpu / put" in text
    assert "1\u20133 GB/s" in text and "2\u20134 GB/s" in text and "0.500\u20130.750" in text and "higher" in text
    assert format_series_summary([Result("cpu", "a", 1.0, "µs")]) == ""


def test_plot_bars_say_values_units_and_direction_and_curves_and_bars_share_one_file(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from lmcache_async_bench.plot import bar_label, plot_results

    r = Result("cpu", "put_sync 1 MiB", 9312.0, "µs", "copy_", 3424.0, target=1.25)
    label = bar_label(r)
    assert "9312 µs" in label and "3424 µs" in label and "lower is better" in label
    assert "(target <= 3 µs)" in bar_label(Result("cpu", "hit", 0.3, "µs", target=3.0))
    out = tmp_path / "bench.png"
    plot_results([*_curve(), r, Result("cpu", "hit", 0.3, "µs", target=3.0), Result("x", "y", 1.0, "B")], str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_progress_bar_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    stream = io.StringIO()
    assert not bars_wanted(stream)
    with Progress(3, "bench", "suite", stream=stream) as bar:
        assert not bar.drawn
        bar.advance()
        bar.write("a line")
    assert stream.getvalue() == "a line\n"


def test_no_progress_bar_on_a_dumb_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert bars_wanted(Tty()) or os.environ.get("TERM") == "dumb"
    monkeypatch.setenv("TERM", "dumb")
    assert not bars_wanted(Tty())
    assert not bars_wanted(Tty(), enabled=False)
