"""Fuzzing: the configuration loaders (YAML, env, EC overlay) and the record parser raise nothing
but their documented validation error and never hang; a short atheris run of the parser.
"""

from __future__ import annotations

import contextlib
import os
import resource
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_async.config import (
    LMCACHE_KEYS_WITHOUT_EFFECT,
    LMCacheEngineConfig,
    load_ec_engine_config,
    load_engine_config,
)
from lmcache_async.dtypes import CODE_TO_DTYPE
from lmcache_async.errors import ConfigError
from lmcache_async.memory import MemoryFormat
from lmcache_async.records import RecordError, decode_header, encode_header, verify_payload

from .chaos_support import record_figures, scaled
from .fuzz_records import check_record_bytes, repair, seed_records

FIELDS = sorted(LMCacheEngineConfig.model_fields)
EXAMPLES = scaled(300)
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,  # a hang is caught by faulthandler_timeout, slowness is not a failure
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    derandomize=False,
)

_text = st.text(st.characters(blacklist_categories=["Cs"]), max_size=40)
_env_text = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=60)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    _text,
    st.sampled_from(["1", "0", "true", "none", "[1, 2]", '{"a": 1}', "cpu,disk", "LRU", "fifo", "redis://h:1", "-1"]),
)
_values = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4), max_leaves=12
)
_keys = st.one_of(
    st.sampled_from(FIELDS),
    st.sampled_from([f"ec_{f}" for f in FIELDS]),
    st.sampled_from(sorted(LMCACHE_KEYS_WITHOUT_EFFECT)[:20]),
    _text,
)
_doc = st.dictionaries(_keys, _values, max_size=8)
_ec_map = st.dictionaries(st.one_of(st.sampled_from(FIELDS), _text), _values, max_size=5)


def _yaml_bytes(data: Any) -> bytes:
    return yaml.safe_dump(data, allow_unicode=True).encode("utf-8")


_files = st.one_of(
    _doc.map(_yaml_bytes),
    st.tuples(_doc, _ec_map).map(lambda d: _yaml_bytes({**d[0], "ec": d[1]})),
    st.binary(max_size=300),
    _text.map(lambda t: t.encode("utf-8")),
    st.sampled_from(
        [
            b"[" * 5000 + b"]" * 5000,
            b"extra_config: {a: " + b"{a: " * 3000 + b"1" + b"}" * 3001,
            b"chunk_size: " + b"9" * 5000,
            b"chunk_size: !!python/object/apply:os.system ['true']",
            b"\xff\xfe\x00bad",
            b"ec: 5",
            b"ec: [1, 2]",
            b"? [1, 2]\n: 3",
            b"a: &a [1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b]\n"
            b"extra_config: {x: [*c,*c,*c,*c,*c,*c,*c,*c]}\nec: {extra_config: {y: [*c,*c,*c]}}",
        ]
    ),
)


@contextlib.contextmanager
def patched_env(values: dict[str, str]) -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith("LMCACHE_") and not k.startswith("LMCACHE_ASYNC_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(values)
    try:
        yield
    finally:
        for k in values:
            os.environ.pop(k, None)
        os.environ.update(saved)


def _only_config_errors(fn: Any, *args: Any, **kw: Any) -> LMCacheEngineConfig | None:
    t0 = time.monotonic()
    try:
        cfg = fn(*args, **kw)
    except ConfigError:
        return None
    finally:
        assert time.monotonic() - t0 < 30, "a configuration loader took over 30 s"
    assert isinstance(cfg, LMCacheEngineConfig)
    return cfg


@FUZZ_SETTINGS
@given(content=_files)
def test_yaml_loaders_raise_only_config_error(content: bytes) -> None:
    record_figures("fuzzing: config loaders (Hypothesis)", yaml_documents=1)
    with tempfile.TemporaryDirectory(prefix="lmcache-async-fuzz-") as d:
        path = Path(d) / "config.yaml"
        path.write_bytes(content)
        with patched_env({}):
            _only_config_errors(load_engine_config, path)
            _only_config_errors(LMCacheEngineConfig.from_file, path)
            base = LMCacheEngineConfig.from_defaults(max_local_cpu_size=1.5)
            before = base.to_dict()
            _only_config_errors(load_ec_engine_config, base, path)
            assert base.to_dict() == before, "the EC overlay modified its base config"
            _only_config_errors(load_ec_engine_config, None, path)


_env_names = st.one_of(
    st.sampled_from([f"LMCACHE_{f.upper()}" for f in FIELDS]),
    st.sampled_from([f"LMCACHE_EC_{f.upper()}" for f in FIELDS]),
    st.text(st.sampled_from("ABCDEFGHIJKLMNOPQRSTUVWXYZ_"), min_size=1, max_size=12).map(lambda s: "LMCACHE_" + s),
)
_env_values = st.one_of(
    _env_text,
    st.sampled_from(["[a, b", "[" * 3000, '{"a":' * 3000, "0x" + "f" * 5000, "9" * 5000, "1e400", "nan", "[[1]]"]),
)


@FUZZ_SETTINGS
@given(env=st.dictionaries(_env_names, _env_values, max_size=6), file_doc=st.none() | _doc)
def test_env_and_ec_overlay_raise_only_config_error(env: dict[str, str], file_doc: dict[str, Any] | None) -> None:
    env.pop("LMCACHE_CONFIG_FILE", None)
    record_figures("fuzzing: config loaders (Hypothesis)", env_sets=1)
    with tempfile.TemporaryDirectory(prefix="lmcache-async-fuzz-") as d:
        if file_doc is not None:
            path = Path(d) / "c.yaml"
            path.write_bytes(_yaml_bytes(file_doc))
            env["LMCACHE_CONFIG_FILE"] = str(path)
        with patched_env(env):
            _only_config_errors(load_engine_config)
            _only_config_errors(LMCacheEngineConfig.from_env)
            _only_config_errors(load_ec_engine_config)


@FUZZ_SETTINGS
@given(data=st.dictionaries(st.one_of(st.sampled_from(FIELDS), _text), _values, max_size=8))
def test_from_dict_and_set_raise_only_config_error(data: dict[str, Any]) -> None:
    record_figures("fuzzing: config loaders (Hypothesis)", mappings=1)
    _only_config_errors(LMCacheEngineConfig.from_dict, data)
    cfg = LMCacheEngineConfig.from_defaults()
    for k, v in data.items():
        try:
            cfg.set(k, v, "fuzz")
        except ConfigError:
            pass


# ---- the record parser ------------------------------------------------------------------------------------
_FIELD_OFFSETS = [(8, "H"), (10, "H"), (12, "I"), (16, "Q"), (24, "Q"), (32, "H"), (34, "H"), (36, "H"), (38, "H"),
                  (40, "I"), (44, "I"), (48, "Q"), (56, "Q")]  # fmt: skip


@st.composite
def _records(draw: st.DrawFn) -> tuple[bytes, str, tuple[int, ...], torch.dtype, MemoryFormat, bytes]:
    key = draw(st.text(st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=200))
    shape = tuple(draw(st.lists(st.integers(0, 6), max_size=5)))
    dtype = draw(st.sampled_from(sorted(CODE_TO_DTYPE.values(), key=str)))
    fmt = draw(st.sampled_from(list(MemoryFormat)))
    n = dtype.itemsize
    for dim in shape:
        n *= dim
    body = draw(st.binary(min_size=n, max_size=n))
    head = encode_header(key, shape, dtype, fmt, xxhash.xxh3_64_intdigest(body))
    return head + body, key, shape, dtype, fmt, body


@FUZZ_SETTINGS
@given(rec=_records())
def test_valid_records_round_trip(rec: Any) -> None:
    data, key, shape, dtype, fmt, body = rec
    record_figures("fuzzing: record parser (Hypothesis)", valid_records=1)
    hdr = decode_header(data, expect_key=key)
    assert (hdr.key, hdr.shape, hdr.dtype, hdr.fmt, hdr.payload_len) == (key, shape, dtype, fmt, len(body))
    verify_payload(hdr, memoryview(data)[hdr.header_len :])
    check_record_bytes(data)


_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("field"), st.sampled_from(_FIELD_OFFSETS), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=40), st.just(0)),
)


@FUZZ_SETTINGS
@given(rec=_records(), mutations=st.lists(_mutation, min_size=1, max_size=4), fix=st.integers(0, 15))
def test_mutated_records_are_rejected_or_consistent(rec: Any, mutations: list[Any], fix: int) -> None:
    record_figures("fuzzing: record parser (Hypothesis)", mutated_records=1)
    data = bytearray(rec[0])
    for kind, a, b in mutations:
        if kind == "flip" and data:
            data[a % len(data)] ^= 1 << b
        elif kind == "field" and len(data) >= 64:
            off, code = a
            struct.pack_into("<" + code, data, off, b % (1 << (8 * struct.calcsize(code))))
        elif kind == "truncate":
            del data[a % (len(data) + 1) :]
        elif kind == "extend":
            data += a
    mutated = repair(fix, bytes(data))
    check_record_bytes(mutated)
    if mutated != rec[0] and (fix & 8) == 0:
        # Without a recomputed payload checksum, changed bytes are never accepted as the entry.
        try:
            hdr = decode_header(mutated, expect_key=rec[1])
            verify_payload(hdr, memoryview(mutated)[hdr.header_len :])
        except RecordError:
            return
        assert bytes(mutated[hdr.header_len :]) == rec[5], "a damaged record was accepted with other bytes"


@FUZZ_SETTINGS
@given(data=st.binary(max_size=600), fix=st.integers(0, 15))
def test_random_bytes_are_rejected_cleanly(data: bytes, fix: int) -> None:
    record_figures("fuzzing: record parser (Hypothesis)", random_inputs=1)
    check_record_bytes(repair(fix, data))


def test_seed_records_are_valid() -> None:
    for rec in seed_records():
        decode_header(rec)


# ---- a short atheris run ---------------------------------------------------------------------------------
ATHERIS_RUNS = scaled(100_000)


@pytest.mark.timeout(900)  # the atheris child alone may take up to 600 s
def test_atheris_record_parser_run(tmp_path, figures):
    pytest.importorskip("atheris", reason="atheris is not installed (pip install atheris)")
    t0 = time.monotonic()
    # Linux keeps a process's peak-RSS mark across exec, and libFuzzer checks that mark: the child
    # starts at this test process's peak. Its RSS limit is therefore set 2 GiB above that, and
    # one allocation of more than 2 GiB still counts as a finding on its own.
    inherited_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    res = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("fuzz_records.py")),
            f"-atheris_runs={ATHERIS_RUNS}",
            f"-rss_limit_mb={inherited_mb + 2048}",
            "-malloc_limit_mb=2048",
        ],
        cwd=tmp_path,  # crash artifacts land here
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"Done {ATHERIS_RUNS} " in res.stderr, res.stderr[-2000:]
    cov = [line for line in res.stderr.splitlines() if " cov: " in line]
    figures(
        "fuzzing: atheris record parser",
        runs=ATHERIS_RUNS,
        crashes=0,
        seconds=round(time.monotonic() - t0, 1),
        last_status=cov[-1].split("\t", 1)[-1][:80] if cov else "",
    )
