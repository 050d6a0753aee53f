"""The scheduler → worker step metadata of the KV connector (no vLLM needed)."""

from __future__ import annotations

import json

import pytest

from lmcache_async.integration.vllm.kv.metadata import BlockRun, KVStepMetadata


def test_a_run_maps_request_blocks_to_chunks_and_offsets() -> None:
    run = BlockRun("r", first_block=3, block_ids=(30, 40, 50, 60), chunk_hashes=(11, 22, 33))
    # blocks 3 | 4 5 | 6 with two blocks per chunk: chunks 1, 2, 3
    assert run.chunks(2) == [(11, 1, 1, [30]), (22, 2, 0, [40, 50]), (33, 3, 0, [60])]


def test_a_run_with_too_few_hashes_is_refused_when_mapped() -> None:
    run = BlockRun("r", first_block=0, block_ids=(1, 2, 3), chunk_hashes=(7,))
    with pytest.raises(ValueError, match="chunk hashes"):
        run.chunks(2)


def test_step_metadata_round_trips_through_json() -> None:
    meta = KVStepMetadata(
        loads=[BlockRun("a", 0, (4, 5), ((1 << 64) - 1,))],
        saves=[BlockRun("b", 2, (9, 8), (123,)), BlockRun("c", 0, (), ())],
        async_loads=[BlockRun("d", 1, (3,), (5,))],
        idle=True,
    )
    back = KVStepMetadata.from_dict(json.loads(json.dumps(meta.to_dict())))
    assert back == meta
    assert KVStepMetadata.from_dict({}).idle is False


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("req_id", 5, TypeError),
        ("first_block", -1, ValueError),
        ("block_ids", (1, "2"), TypeError),
        ("block_ids", (-3,), ValueError),
        ("chunk_hashes", (1 << 64,), ValueError),
        ("chunk_hashes", "12", TypeError),
        ("block_ids", (True,), TypeError),
    ],
)
def test_malformed_runs_are_refused_naming_the_field(field: str, value: object, error: type[Exception]) -> None:
    args = {"req_id": "r", "first_block": 0, "block_ids": (1,), "chunk_hashes": (2,)}
    args[field] = value
    with pytest.raises(error, match=field):
        BlockRun(**args)  # type: ignore[arg-type]


def test_malformed_mappings_are_refused() -> None:
    with pytest.raises(ValueError, match="lacks"):
        BlockRun.from_dict({"req_id": "r"})
    with pytest.raises(TypeError):
        KVStepMetadata.from_dict([])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        KVStepMetadata.from_dict({"loads": [5]})
    with pytest.raises(TypeError, match="idle"):
        KVStepMetadata.from_dict({"idle": 1})
