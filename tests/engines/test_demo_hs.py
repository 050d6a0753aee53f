"""The thinker -> talker demo runs and shows the hidden-state prefix shrinking with the KV."""

from __future__ import annotations

from lmcache_async.cli.demo_hs import run_hs_demo


def test_demo_shows_the_prefix_shrinking_with_the_kv():
    lines: list[str] = []
    summary = run_hs_demo(out=lines.append)
    assert summary["matches"]
    assert summary["hs_tokens_before"] == summary["kv_tokens_before"] > 0
    assert 0 < summary["hs_tokens_after"] == summary["kv_tokens_after"] < summary["hs_tokens_before"]
    assert summary["orphans_dropped"] == 1
    assert any("talker restores" in line for line in lines)
