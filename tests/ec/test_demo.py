"""The encoder-cache demo: real subprocesses share entries through a disk directory."""

from __future__ import annotations

from pathlib import Path

import torch

from lmcache_async.cli.demo_ec import demo_tensor, main, run_ec_demo


def test_processes_share_encoder_outputs_only_through_the_disk_dir(tmp_path: Path) -> None:
    lines: list[str] = []
    result = run_ec_demo(tmp_path, out=lines.append, count=3)
    assert result["ok"]
    prod, cons, cpu = result["producer"], result["consumer"], result["cpu_only"]
    assert len({prod["pid"], cons["pid"], cpu["pid"]}) == 3  # three separate processes
    assert prod["stored"] == 3 and prod["tiers"] == ["cpu", "disk"]
    assert (cons["present"], cons["hits"], cons["exact"]) == (3, 3, 3)
    assert cpu["hits"] == 0 and cpu["tiers"] == ["cpu"]
    text = "\n".join(lines)
    assert "bit-exact" in text and "shared tier" in text


def test_demo_tensors_are_deterministic() -> None:
    a, b = demo_tensor(2), demo_tensor(2)
    assert a.dtype == torch.float16 and a.shape == (576, 1024)
    assert torch.equal(a, b) and not torch.equal(a, demo_tensor(3))


def test_cpu_only_consumer_process_entry_point(capsys: object) -> None:
    assert main(["consumer", "--count", "1"]) == 0
