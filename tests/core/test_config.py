"""Configuration: loaders, precedence, conversion, validation messages, the EC overlay."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from lmcache_async import ConfigError, LMCacheEngineConfig, load_ec_engine_config, load_engine_config


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_match_lmcache():
    c = LMCacheEngineConfig()
    assert c.chunk_size == 256
    assert c.local_cpu is True
    assert c.max_local_cpu_size == 5.0
    assert c.local_disk is None
    assert c.max_local_disk_size == 0.0
    assert c.save_unfull_chunk is False
    assert c.cache_policy == "LRU"
    assert c.enable_hidden_state_cache is False
    assert c.max_hidden_state_cpu_size == 2.0
    assert c.hidden_state_layers is None
    assert c.source_of("chunk_size") == "default"


def test_from_file_reads_yaml_and_records_source(tmp_path):
    p = write(tmp_path, "chunk_size: 512\nlocal_disk: file:///tmp/cache\nmax_local_disk_size: 3\n")
    c = LMCacheEngineConfig.from_file(p)
    assert c.chunk_size == 512
    assert c.local_disk == "/tmp/cache"  # file:// prefix stripped
    assert c.max_local_disk_size == 3.0
    assert c.source_of("chunk_size") == f"file {p}"


def test_env_overrides_file(tmp_path, monkeypatch):
    p = write(tmp_path, "chunk_size: 512\nlocal_cpu: false\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(p))
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "1024")
    c = load_engine_config()
    assert c.chunk_size == 1024
    assert c.source_of("chunk_size") == "env LMCACHE_CHUNK_SIZE"
    assert c.local_cpu is False
    assert c.source_of("local_cpu") == f"file {p}"


def test_explicit_path_argument_beats_env_file(tmp_path, monkeypatch):
    a = write(tmp_path, "chunk_size: 111\n", "a.yaml")
    b = write(tmp_path, "chunk_size: 222\n", "b.yaml")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(a))
    assert load_engine_config(b).chunk_size == 222


def test_from_env_alone(monkeypatch):
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_CPU_SIZE", "2.5")
    assert LMCacheEngineConfig.from_env().max_local_cpu_size == 2.5


@pytest.mark.parametrize(
    ("var", "raw", "key", "expected"),
    [
        ("LMCACHE_LOCAL_CPU", "true", "local_cpu", True),
        ("LMCACHE_LOCAL_CPU", "1", "local_cpu", True),
        ("LMCACHE_LOCAL_CPU", " False ", "local_cpu", False),
        ("LMCACHE_LOCAL_CPU", "'0'", "local_cpu", False),
        ("LMCACHE_HIDDEN_STATE_LAYERS", "1,2,3", "hidden_state_layers", [1, 2, 3]),
        ("LMCACHE_HIDDEN_STATE_LAYERS", ' "0, 24" ', "hidden_state_layers", [0, 24]),
        ("LMCACHE_HIDDEN_STATE_LAYERS", "[4, 5]", "hidden_state_layers", [4, 5]),
        ("LMCACHE_EXTRA_CONFIG", '{"a": 1, "b": [2]}', "extra_config", {"a": 1, "b": [2]}),
        ("LMCACHE_CHUNK_SIZE", "  '768'  ", "chunk_size", 768),
        ("LMCACHE_LOCAL_DISK", '"file:///var/cache/x"', "local_disk", "/var/cache/x"),
        ("LMCACHE_REMOTE_URL", "none", "remote_url", None),
        ("LMCACHE_CACHE_POLICY", "fifo", "cache_policy", "FIFO"),
        ("LMCACHE_TIER_ORDER", "cpu,disk", "tier_order", ["cpu", "disk"]),
    ],
)
def test_env_value_conversion(monkeypatch, var, raw, key, expected):
    monkeypatch.setenv(var, raw)
    assert getattr(load_engine_config(), key) == expected


@pytest.mark.parametrize(
    ("var", "raw", "key", "expected"),
    [
        # A value in matching quotes is a string literal: its escapes are honoured.
        ("LMCACHE_EXTRA_CONFIG", '"{\\"config\\": \\"prod\\"}"', "extra_config", {"config": "prod"}),
        ("LMCACHE_EXTRA_CONFIG", '\'{"config": "prod"}\'', "extra_config", {"config": "prod"}),
        ("LMCACHE_NIXL_BACKEND_PARAMS", '"{\\"dir\\": \\"/mnt/nixl\\"}"', "nixl_backend_params", {"dir": "/mnt/nixl"}),
        ("LMCACHE_TIER_ORDER", '"[\\"cpu\\", \\"disk\\"]"', "tier_order", ["cpu", "disk"]),
        ("LMCACHE_LOCAL_DISK", '"/data/my \\"cache\\""', "local_disk", '/data/my "cache"'),
        ("LMCACHE_REMOTE_KEY_PREFIX", '"team\\tA"', "remote_key_prefix", "team\tA"),
        ("LMCACHE_REMOTE_KEY_PREFIX", "'caf\\u00e9'", "remote_key_prefix", "caf\u00e9"),
        # The content of quotes is kept as written, inner spaces included.
        ("LMCACHE_REMOTE_KEY_PREFIX", '" spaced "', "remote_key_prefix", " spaced "),
        # Not a valid literal: only the outer quotes go.
        ("LMCACHE_REMOTE_KEY_PREFIX", '"a\\x"', "remote_key_prefix", "a\\x"),
        ("LMCACHE_LOCAL_DISK", '"/mnt/\\d"', "local_disk", "/mnt/\\d"),
        ("LMCACHE_CHUNK_SIZE", '"512"', "chunk_size", 512),
        ("LMCACHE_MAX_LOCAL_CPU_SIZE", "' 1.5 '", "max_local_cpu_size", 1.5),
        ("LMCACHE_SAVE_UNFULL_CHUNK", '"true"', "save_unfull_chunk", True),
    ],
)
def test_quoted_env_values_are_read_as_lmcache_reads_them(monkeypatch, var, raw, key, expected):
    monkeypatch.setenv(var, raw)
    cfg = load_engine_config()
    assert getattr(cfg, key) == expected
    assert cfg.source_of(key) == f"env {var}"


def test_quoted_ec_env_values_are_read_the_same_way(monkeypatch):
    monkeypatch.setenv("LMCACHE_EC_EXTRA_CONFIG", '"{\\"config\\": \\"ec\\"}"')
    assert load_ec_engine_config().extra_config == {"config": "ec"}


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("LMCACHE_CHUNK_SIZE", "abc"),
        ("LMCACHE_CHUNK_SIZE", "0"),
        ("LMCACHE_LOCAL_CPU", "maybe"),
        ("LMCACHE_MAX_LOCAL_CPU_SIZE", "-1"),
        ("LMCACHE_MAX_LOCAL_CPU_SIZE", "nan"),
        ("LMCACHE_CACHE_POLICY", "MRU"),
        ("LMCACHE_EXTRA_CONFIG", "{not json"),
        ("LMCACHE_HIDDEN_STATE_LAYERS", "1,x"),
        ("LMCACHE_LOCAL_DISK_FSYNC", "sometimes"),
        ("LMCACHE_REMOTE_URL", "localhost:6379"),
    ],
)
def test_invalid_env_value_names_key_value_and_variable(monkeypatch, var, raw):
    monkeypatch.setenv(var, raw)
    with pytest.raises(ConfigError) as ei:
        load_engine_config()
    msg = str(ei.value)
    key = var[len("LMCACHE_") :].lower()
    assert key in msg
    assert repr(raw) in msg
    assert var in msg


def test_invalid_file_value_names_the_file(tmp_path):
    p = write(tmp_path, "cache_policy: RANDOM\n")
    with pytest.raises(ConfigError) as ei:
        LMCacheEngineConfig.from_file(p)
    assert "cache_policy" in str(ei.value) and "RANDOM" in str(ei.value) and str(p) in str(ei.value)


def test_cache_policy_only_lru_or_fifo():
    assert LMCacheEngineConfig.from_defaults(cache_policy="fifo").cache_policy == "FIFO"
    with pytest.raises(ConfigError, match="cache_policy"):
        LMCacheEngineConfig.from_defaults(cache_policy="LFU")


def test_unknown_file_key_warned_and_dropped(tmp_path, caplog):
    p = write(tmp_path, "chunk_size: 128\nno_such_key: 3\nec_chunk_size: 64\nec:\n  chunk_size: 32\n")
    with caplog.at_level(logging.WARNING, logger="lmcache_async.config"):
        c = LMCacheEngineConfig.from_file(p)
    assert c.chunk_size == 128
    assert "no_such_key" in caplog.text
    assert "ec_chunk_size" not in caplog.text  # the overlay's keys are not unknown
    assert "'ec'" not in caplog.text


_WITHOUT_EFFECT = {"enable_pd": True, "lmcache_instance_id": "inst-1", "use_layerwise": False, "pd_role": "sender"}


def _no_effect_warnings(caplog, key):
    return [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and repr(key) in r.getMessage() and "no effect" in r.getMessage()
    ]


@pytest.mark.parametrize("source", ["file", "env", "from_dict", "from_defaults"])
def test_lmcache_keys_without_effect_load_from_every_source_with_one_warning_each(
    source, tmp_path, monkeypatch, caplog
):
    with caplog.at_level(logging.WARNING, logger="lmcache_async.config"):
        if source == "file":
            text = yaml.safe_dump({"chunk_size": 128, **_WITHOUT_EFFECT})
            cfg = load_engine_config(write(tmp_path, text))
        elif source == "env":
            monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "128")
            for k, v in _WITHOUT_EFFECT.items():
                monkeypatch.setenv(f"LMCACHE_{k.upper()}", str(v))
            cfg = load_engine_config()
        elif source == "from_dict":
            cfg = LMCacheEngineConfig.from_dict({"chunk_size": 128, **_WITHOUT_EFFECT})
        else:
            cfg = LMCacheEngineConfig.from_defaults(chunk_size=128, **_WITHOUT_EFFECT)
    assert cfg.chunk_size == 128
    for key in _WITHOUT_EFFECT:
        assert len(_no_effect_warnings(caplog, key)) == 1, key
    assert "unknown" not in caplog.text


def test_a_key_without_effect_in_file_and_env_warns_once_per_load(tmp_path, monkeypatch, caplog):
    p = write(tmp_path, "enable_pd: true\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(p))
    monkeypatch.setenv("LMCACHE_ENABLE_PD", "false")
    with caplog.at_level(logging.WARNING, logger="lmcache_async.config"):
        load_engine_config()
    assert len(_no_effect_warnings(caplog, "enable_pd")) == 1
    with caplog.at_level(logging.WARNING, logger="lmcache_async.config"):
        load_ec_engine_config()  # a second load says it again, once
    assert len(_no_effect_warnings(caplog, "enable_pd")) == 2


def test_from_defaults_rejects_an_unknown_key_naming_it():
    with pytest.raises(ConfigError, match="unknown configuration key 'no_such_key'"):
        LMCacheEngineConfig.from_defaults(no_such_key=1)
    with pytest.raises(ConfigError, match="'chunk_sise'.*did you mean 'chunk_size'"):
        LMCacheEngineConfig.from_defaults(chunk_sise=128)


def test_unknown_env_and_ec_env_are_not_taken_by_base(monkeypatch):
    monkeypatch.setenv("LMCACHE_EC_CHUNK_SIZE", "64")
    monkeypatch.setenv("LMCACHE_NOT_A_KEY", "1")
    c = load_engine_config()
    assert c.chunk_size == 256


def test_non_mapping_yaml_is_rejected(tmp_path):
    p = write(tmp_path, "- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        LMCacheEngineConfig.from_file(p)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        LMCacheEngineConfig.from_file(tmp_path / "absent.yaml")


def test_assignment_is_validated_and_sourced():
    c = LMCacheEngineConfig()
    c.set("chunk_size", "128", "cli")
    assert c.chunk_size == 128 and c.source_of("chunk_size") == "cli"
    with pytest.raises(ConfigError, match="chunk_size"):
        c.set("chunk_size", -1, "cli")
    with pytest.raises(ConfigError, match="unknown"):
        c.set("nope", 1)


def test_describe_lists_every_key_with_source(monkeypatch):
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "64")
    rows = {k: (v, s) for k, v, s in load_engine_config().describe()}
    assert rows["chunk_size"] == (64, "env LMCACHE_CHUNK_SIZE")
    assert rows["local_cpu"] == (True, "default")
    assert set(rows) == set(LMCacheEngineConfig.model_fields)


def test_nixl_backends_list_sets_backend(tmp_path):
    p = write(tmp_path, "nixl_backends: [gds, posix]\n")
    assert LMCacheEngineConfig.from_file(p).nixl_backend == "GDS"


# ---- EC overlay ------------------------------------------------------------------------------


def test_ec_precedence_env_over_map_over_prefixed_over_base(tmp_path, monkeypatch):
    p = write(
        tmp_path,
        "chunk_size: 100\nsave_unfull_chunk: false\n"
        "ec_chunk_size: 200\nec_save_unfull_chunk: true\nec_blocking_timeout_secs: 7\n"
        "ec:\n  chunk_size: 300\n  blocking_timeout_secs: 8\n",
    )
    monkeypatch.setenv("LMCACHE_EC_CHUNK_SIZE", "1536")
    base = LMCacheEngineConfig.from_file(p)
    ec = load_ec_engine_config(base, p)
    assert ec.chunk_size == 1536 and isinstance(ec.chunk_size, int)  # env wins
    assert ec.source_of("chunk_size") == "env LMCACHE_EC_CHUNK_SIZE"
    assert ec.blocking_timeout_secs == 8  # ec: map wins over ec_ key
    assert ec.save_unfull_chunk is True  # ec_ key wins over base
    assert base.chunk_size == 100  # base untouched


def test_ec_overlay_table(tmp_path, monkeypatch):
    """Each source alone, then every pair: the higher source always wins."""
    sources = {"base": 16, "prefixed": 32, "map": 48, "env": 64}
    order = ["base", "prefixed", "map", "env"]
    from itertools import combinations

    for n in range(1, 5):
        for combo in combinations(order, n):
            lines = []
            if "base" in combo:
                lines.append(f"chunk_size: {sources['base']}")
            if "prefixed" in combo:
                lines.append(f"ec_chunk_size: {sources['prefixed']}")
            if "map" in combo:
                lines.append(f"ec:\n  chunk_size: {sources['map']}")
            p = write(tmp_path, "\n".join(lines) + "\n", f"{'-'.join(combo)}.yaml")
            if "env" in combo:
                monkeypatch.setenv("LMCACHE_EC_CHUNK_SIZE", str(sources["env"]))
            else:
                monkeypatch.delenv("LMCACHE_EC_CHUNK_SIZE", raising=False)
            ec = load_ec_engine_config(None, p)
            assert ec.chunk_size == sources[combo[-1]], combo


def test_ec_values_are_converted_and_validated(tmp_path, monkeypatch):
    monkeypatch.setenv("LMCACHE_EC_LOCAL_DISK", "file:///tmp/ec")
    monkeypatch.setenv("LMCACHE_EC_HIDDEN_STATE_LAYERS", "1,2")
    ec = load_ec_engine_config(LMCacheEngineConfig())
    assert ec.local_disk == "/tmp/ec"
    assert ec.hidden_state_layers == [1, 2]
    monkeypatch.setenv("LMCACHE_EC_MAX_LOCAL_CPU_SIZE", "lots")
    with pytest.raises(ConfigError) as ei:
        load_ec_engine_config(LMCacheEngineConfig())
    assert "LMCACHE_EC_MAX_LOCAL_CPU_SIZE" in str(ei.value) and "'lots'" in str(ei.value)


def test_ec_invalid_file_value_names_the_key(tmp_path):
    p = write(tmp_path, "ec:\n  cache_policy: MRU\n")
    with pytest.raises(ConfigError) as ei:
        load_ec_engine_config(LMCacheEngineConfig(), p)
    assert "ec.cache_policy" in str(ei.value) and "MRU" in str(ei.value)


def test_ec_unknown_keys_logged_and_dropped(tmp_path, monkeypatch, caplog):
    p = write(tmp_path, "ec_bogus: 1\nec:\n  also_bogus: 2\n  chunk_size: 64\n")
    monkeypatch.setenv("LMCACHE_EC_NOPE", "1")
    with caplog.at_level(logging.WARNING, logger="lmcache_async.config"):
        ec = load_ec_engine_config(LMCacheEngineConfig(), p)
    assert ec.chunk_size == 64
    for name in ("ec_bogus", "also_bogus", "LMCACHE_EC_NOPE"):
        assert name in caplog.text


def test_ec_defaults_cpu_on_with_one_gib_when_unset():
    base = LMCacheEngineConfig.from_defaults(local_cpu=False)
    ec = load_ec_engine_config(base)
    assert ec.local_cpu is True
    assert ec.max_local_cpu_size == 1.0
    assert base.local_cpu is False and base.max_local_cpu_size == 5.0


def test_ec_keeps_an_explicit_cpu_size_but_fixes_non_positive(tmp_path):
    assert load_ec_engine_config(LMCacheEngineConfig.from_defaults(max_local_cpu_size=3)).max_local_cpu_size == 3
    p = write(tmp_path, "ec_max_local_cpu_size: 0\n")
    assert load_ec_engine_config(LMCacheEngineConfig(), p).max_local_cpu_size == 1.0


def test_ec_disk_size_defaults_only_with_a_disk_path(tmp_path):
    ec = load_ec_engine_config(LMCacheEngineConfig())
    assert ec.local_disk is None and ec.max_local_disk_size == 0.0  # no path invented
    p = write(tmp_path, f"ec_local_disk: {tmp_path / 'ec'}\n")
    ec = load_ec_engine_config(LMCacheEngineConfig(), p)
    assert ec.local_disk == str(tmp_path / "ec") and ec.max_local_disk_size == 64.0
    p2 = write(tmp_path, f"ec_local_disk: {tmp_path / 'ec'}\nec_max_local_disk_size: 5\n", "b.yaml")
    assert load_ec_engine_config(LMCacheEngineConfig(), p2).max_local_disk_size == 5.0


def test_ec_base_object_is_never_modified(monkeypatch):
    base = LMCacheEngineConfig()
    before = base.model_dump()
    monkeypatch.setenv("LMCACHE_EC_CHUNK_SIZE", "64")
    load_ec_engine_config(base)
    assert base.model_dump() == before
    assert base.source_of("chunk_size") == "default"


def test_ec_loads_base_from_env_file_when_not_given(tmp_path, monkeypatch):
    p = write(tmp_path, "chunk_size: 512\nec_local_cpu: true\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(p))
    ec = load_ec_engine_config()
    assert ec.chunk_size == 512


def test_configuration_doc_lists_every_key():
    # The page's table is generated from the model when the site is built (docs/hooks).
    import importlib.util

    docs = Path(__file__).resolve().parents[2] / "docs"
    assert "<!-- generated: config-reference -->" in (docs / "configuration.md").read_text()
    spec = importlib.util.spec_from_file_location("docs_generated_hook", docs / "hooks" / "generated.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    table = hook.config_reference()
    for key in LMCacheEngineConfig.model_fields:
        assert f"`{key}`" in table, key


def test_ec_model_name_is_read_from_a_top_level_yaml_key_and_the_ec_env(tmp_path, monkeypatch):
    from lmcache_async.config import load_ec_engine_config

    path = tmp_path / "c.yaml"
    path.write_text("ec_model_name: from-yaml\n")
    cfg = load_ec_engine_config(LMCacheEngineConfig.from_defaults(), path)
    assert cfg.ec_model_name == "from-yaml"
    monkeypatch.setenv("LMCACHE_EC_MODEL_NAME", "from-env")
    cfg = load_ec_engine_config(LMCacheEngineConfig.from_defaults(), path)
    assert cfg.ec_model_name == "from-env"
    assert cfg.source_of("ec_model_name") == "env LMCACHE_EC_MODEL_NAME"
