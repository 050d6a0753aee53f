"""OmniStageStore semantics (no vllm_omni needed): keys per edge, put/get/cleanup/health/close."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async.errors import ManagerClosedError
from lmcache_async.integration.omni import OmniStageStore, load_stage_options, stage_key
from lmcache_async.integration.omni.options import StageOptions

Make = Callable[..., OmniStageStore]


def test_tensor_comes_back_equal_fresh_and_on_the_cpu(make_store: Make) -> None:
    s = make_store()
    t = torch.randn(32, 16)
    ok, size, meta = s.put("thinker", "talker", "r1_0_0", t)
    assert ok and size == t.numel() * 4 and meta is not None and meta["size"] == size
    got = s.get("thinker", "talker", "r1_0_0")
    assert got is not None
    out, n = got
    assert torch.equal(out, t) and n == size and out.data_ptr() != t.data_ptr()


def test_dict_payload_round_trips(make_store: Make) -> None:
    s = make_store()
    payload: dict[str, Any] = {"hidden_states": torch.randn(4, 8), "token_ids": [5, 6], "finished": True}
    assert s.put("0", "1", "req_0_0", payload)[0]
    got = s.get("0", "1", "req_0_0")
    assert got is not None
    assert torch.equal(got[0]["hidden_states"], payload["hidden_states"])
    assert got[0]["token_ids"] == [5, 6] and got[0]["finished"] is True


def test_bytes_payload_comes_back_as_bytes(make_store: Make) -> None:
    s = make_store()
    assert s.put("a", "b", "k", b"\x01\x02\x03")[0]
    got = s.get("a", "b", "k")
    assert got is not None and got[0] == b"\x01\x02\x03"


def test_int_stage_ids_name_the_same_edge_as_their_strings(make_store: Make) -> None:
    s = make_store()
    assert s.put(0, 1, "k", torch.ones(3))[0]  # type: ignore[arg-type]
    assert s.get("0", "1", "k") is not None


def test_edges_and_keys_are_separate_namespaces(make_store: Make) -> None:
    s = make_store(consume_on_get=False)
    s.put("a", "b", "k", torch.zeros(2))
    assert s.get("b", "a", "k") is None
    assert s.get("a", "c", "k") is None
    assert s.get("a", "b", "k2") is None
    assert s.get("a", "b", "k") is not None


def test_two_namespaces_share_a_tier_without_seeing_each_other(make_store: Make, tmp_path: Path) -> None:
    disk = {"local_disk": str(tmp_path), "max_local_disk_size": 0.05}
    a = make_store(namespace="pipeline-a", **disk)
    b = make_store(namespace="pipeline-b", **disk)
    a.put("x", "y", "k", torch.ones(4))
    a.manager.flush_sync()
    assert b.get("x", "y", "k") is None


def test_long_put_keys_get_distinct_keys() -> None:
    k1 = stage_key("omni", "a", "b", "x" * 500 + "1")
    k2 = stage_key("omni", "a", "b", "x" * 500 + "2")
    assert k1 != k2 and len(k1.to_string()) < 300


def test_get_consumes_by_default(make_store: Make) -> None:
    s = make_store()
    s.put("a", "b", "k", torch.ones(4))
    assert s.get("a", "b", "k") is not None
    assert s.get("a", "b", "k") is None


def test_get_keeps_the_entry_without_consume_on_get(make_store: Make) -> None:
    s = make_store(consume_on_get=False)
    s.put("a", "b", "k", torch.ones(4))
    assert s.get("a", "b", "k") is not None
    assert s.get("a", "b", "k") is not None


def test_cleanup_removes_the_requests_entries_on_every_edge(make_store: Make) -> None:
    s = make_store(consume_on_get=False)
    for edge in (("0", "1"), ("1", "2")):
        s.put(*edge, "req7_0_0", torch.ones(2))
        s.put(*edge, "req7_0_1", torch.ones(2))
    s.put("0", "1", "req7", torch.ones(2))
    s.put("0", "1", "req70_0_0", torch.ones(2))  # another request whose id starts alike
    s.cleanup("req7")
    for edge in (("0", "1"), ("1", "2")):
        assert s.get(*edge, "req7_0_0") is None
        assert s.get(*edge, "req7_0_1") is None
    assert s.get("0", "1", "req7") is None
    assert s.get("0", "1", "req70_0_0") is not None


def test_cleanup_reaches_a_lower_tier_shared_with_another_store(make_store: Make, tmp_path: Path) -> None:
    disk = {"local_disk": str(tmp_path), "max_local_disk_size": 0.05}
    producer = make_store(**disk)
    consumer = make_store(consume_on_get=False, **disk)
    producer.put("a", "b", "r_0_0", torch.ones(64))
    assert consumer.get("a", "b", "r_0_0") is not None
    producer.cleanup("r")
    consumer2 = make_store(**disk)
    assert consumer2.get("a", "b", "r_0_0") is None


def test_get_with_deadline_returns_none_by_the_deadline_when_nothing_is_written(make_store: Make) -> None:
    s = make_store()
    deadline = time.monotonic() + 0.3
    assert s.get_with_deadline("a", "b", "never", deadline=deadline) is None
    # Part of the contract (deadline + 50 ms); the margin here is CI-safe, the bench measures it tight.
    assert time.monotonic() < deadline + 1.0
    assert s.health()["deadline_misses"] == 1


def test_get_with_deadline_in_the_past_returns_at_once(make_store: Make) -> None:
    s = make_store()
    s.put("a", "b", "k", torch.ones(2))
    assert s.get_with_deadline("a", "b", "k", deadline=time.monotonic() - 1) is None
    assert s.get("a", "b", "k") is not None  # an expired receive consumed nothing


def test_get_with_deadline_sees_a_later_put(make_store: Make) -> None:
    import threading

    s = make_store()
    t = torch.randn(8)
    timer = threading.Timer(0.2, lambda: s.put("a", "b", "late", t))
    timer.start()
    try:
        got = s.get_with_deadline("a", "b", "late", deadline=time.monotonic() + 30)
    finally:
        timer.join()
    assert got is not None and torch.equal(got[0], t)


def test_health_counts_traffic(make_store: Make) -> None:
    s = make_store()
    s.put("a", "b", "k", torch.ones(4))
    s.get("a", "b", "k")
    s.get("a", "b", "missing")
    h = s.health()
    assert h["status"] == "healthy"
    assert (h["puts"], h["gets"], h["misses"], h["bytes_put"], h["bytes_got"]) == (1, 1, 1, 16, 16)
    assert "cpu" in h["tiers"]


def test_corrupt_record_is_a_counted_miss_and_is_removed(make_store: Make) -> None:
    from lmcache_async.memory import MemoryFormat

    s = make_store(consume_on_get=False)
    key = s.key("a", "b", "bad")
    assert s.manager.put_sync(key, torch.zeros(100, dtype=torch.uint8), MemoryFormat.BINARY)
    assert s.get("a", "b", "bad") is None
    assert s.health()["corrupt"] == 1
    assert not s.manager.contains_sync(key)


def test_unencodable_payload_is_a_type_error_naming_data(make_store: Make) -> None:
    s = make_store(serializer="lmcache")

    class Opaque:
        pass

    with pytest.raises(TypeError, match="data"):
        s.put("a", "b", "k", {"x": Opaque()})


@pytest.mark.parametrize(
    ("args", "exc", "name"),
    [
        ((None, "b", "k"), TypeError, "from_stage"),
        (("a", "", "k"), ValueError, "to_stage"),
        (("a", "b", 3), TypeError, "put_key"),
        (("a", "b", ""), ValueError, "put_key"),
    ],
)
def test_bad_arguments_raise_naming_them(make_store: Make, args: tuple[Any, Any, Any], exc: type, name: str) -> None:
    s = make_store()
    with pytest.raises(exc, match=name):
        s.put(*args, torch.ones(1))


def test_bad_deadline_is_a_type_error(make_store: Make) -> None:
    with pytest.raises(TypeError, match="deadline"):
        make_store().get_with_deadline("a", "b", "k", deadline="soon")  # type: ignore[arg-type]


def test_calls_after_close_raise_and_close_is_idempotent(make_store: Make) -> None:
    s = make_store()
    s.close()
    s.close()
    assert s.health()["status"] == "closed"
    with pytest.raises(ManagerClosedError):
        s.put("a", "b", "k", torch.ones(1))
    with pytest.raises(ManagerClosedError):
        s.get("a", "b", "k")


def test_bad_options_raise_naming_them() -> None:
    with pytest.raises(ValueError, match="serializer"):
        StageOptions(serializer="pickle")
    with pytest.raises(ValueError, match="poll_interval_s"):
        StageOptions(poll_interval_s=0)
    with pytest.raises(TypeError, match="consume_on_get"):
        StageOptions(consume_on_get="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="extra"):
        load_stage_options(["not", "a", "mapping"])  # type: ignore[arg-type]


def test_options_come_from_a_config_file_then_inline_keys(tmp_path: Path) -> None:
    f = tmp_path / "omni.yaml"
    f.write_text("max_local_cpu_size: 0.125\nchunk_size: 64\n")
    cfg, opts = load_stage_options(
        {"config_file": str(f), "chunk_size": 32, "namespace": "tts", "stage_id": 1, "role": "sender"}
    )
    assert cfg.max_local_cpu_size == 0.125 and cfg.chunk_size == 32
    assert opts.namespace == "tts"


def test_tracked_keys_are_bounded(make_store: Make) -> None:
    s = make_store(max_tracked_keys=3, consume_on_get=False)
    for i in range(10):
        s.put("a", "b", f"k{i}", torch.ones(1))
    assert s.health()["tracked_keys"] == 3


def test_reap_consumed_forgets_keys_another_reader_removed(make_store: Make) -> None:
    s = make_store()
    s.put("a", "b", "k", torch.ones(1))
    s.manager.remove_sync(s.key("a", "b", "k"))
    s.reap_consumed()
    assert s.health()["tracked_keys"] == 0
