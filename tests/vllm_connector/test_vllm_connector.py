"""The encoder-cache connector inside real vLLM (0.33.0, CPU build).

vLLM's own pieces do the work: ``VllmConfig``/``ModelConfig``/``ECTransferConfig`` (a tiny model
config written to a temporary directory, no download), ``ECConnectorFactory`` loading our class
from ``ec_connector_module_path``, real ``Request``/``MultiModalFeatureSpec`` objects,
``SchedulerOutput`` carrying our metadata, and the model-runner mixin that binds it and calls
``save_caches``/``start_load_caches``. Run with ``nox -s vllm`` (or ``scripts/vllm_env.sh`` then
``.venv-vllm/bin/python -m pytest tests/vllm_connector``); skipped where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def _vllm_installed() -> bool:
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None  # not a bare directory named vllm


if not _vllm_installed():
    pytest.skip(
        "vLLM is not installed in this environment; `nox -s vllm` (or scripts/vllm_env.sh and "
        ".venv-vllm/bin/python -m pytest tests/vllm_connector) installs vllm==0.33.0 and runs this test",
        allow_module_level=True,
    )

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

with warnings.catch_warnings():  # vLLM's own import-time warnings are not ours to fix
    warnings.simplefilter("ignore")
    from vllm import SamplingParams
    from vllm.config import ECTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.ec_transfer import (
        ensure_ec_transfer_initialized,
        ensure_ec_transfer_shutdown,
        get_ec_transfer,
    )
    from vllm.distributed.ec_transfer.ec_connector.base import (
        ECConnectorBase,
        ECConnectorMetadata,
        ECConnectorRole,
    )
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request
    from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin

from lmcache_async.integration.vllm import LMCacheECConnector, LMCacheECConnectorMetadata  # noqa: E402

MODULE = "lmcache_async.integration.vllm"
TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "torch_dtype": "float16",
    "rms_norm_eps": 1e-6,
}
SMALL = {"max_local_cpu_size": 32 / 1024, "staging_size": 8 / 1024}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny-model")
    (d / "config.json").write_text(json.dumps(TINY_MODEL))
    return d


def make_vllm_config(model_dir: Path, ec_role: str, extra: dict[str, Any]) -> VllmConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, served_model_name="tiny-vl", dtype="float16"
        )
        transfer = ECTransferConfig(
            ec_connector="LMCacheECConnector",
            ec_connector_module_path=MODULE,
            ec_role=ec_role,
            ec_connector_extra_config=extra,
        )
        return VllmConfig(model_config=model, ec_transfer_config=transfer)


def mm_request(req_id: str, *hashes: str) -> Request:
    feats = [
        MultiModalFeatureSpec(
            data=None, modality="image", identifier=h, mm_position=PlaceholderRange(offset=1 + 4 * i, length=4)
        )
        for i, h in enumerate(hashes)
    ]
    return Request(req_id, list(range(2 + 4 * len(hashes))), SamplingParams(max_tokens=1), None, mm_features=feats)


@pytest.fixture
def worker_agent() -> Iterator[None]:
    """vLLM's process-wide worker connector is shut down after each test."""
    yield
    ensure_ec_transfer_shutdown()


def test_factory_loads_the_connector_from_the_module_path() -> None:
    transfer = ECTransferConfig(ec_connector="LMCacheECConnector", ec_connector_module_path=MODULE, ec_role="ec_both")
    cls = ECConnectorFactory.get_connector_class(transfer)
    assert cls is LMCacheECConnector
    assert issubclass(cls, ECConnectorBase)
    assert issubclass(LMCacheECConnectorMetadata, ECConnectorMetadata)


def test_producer_to_consumer_through_vllm_objects(model_dir: Path, worker_agent: None) -> None:
    cfg = make_vllm_config(model_dir, "ec_both", SMALL)
    scheduler = ECConnectorFactory.create_connector(cfg, ECConnectorRole.SCHEDULER)
    ensure_ec_transfer_initialized(cfg)  # vLLM's worker-side agent, built by the same factory
    worker = get_ec_transfer()
    try:
        assert isinstance(scheduler, LMCacheECConnector) and isinstance(worker, LMCacheECConnector)
        assert scheduler.impl.engine is worker.impl.engine  # one engine per process
        key = worker.impl.engine.key("img-1")
        # The served name is an alias: the key carries the model vLLM loads.
        assert (key.model_name, key.dtype, key.world_size, key.worker_id) == (str(model_dir), torch.float16, 1, 0)

        # Producer step: the encoder ran; vLLM's runner hands the outputs to save_caches.
        produced = {"img-2": torch.randn(4, 64, dtype=torch.float16), "img-1": torch.randn(4, 64, dtype=torch.float16)}
        for h in produced:
            ECConnectorModelRunnerMixin.maybe_save_ec_to_connector(produced, h)

        # Scheduler step: lookups, allocation, metadata for the workers.
        assert scheduler.has_cache_item("img-1") and scheduler.has_cache_item("img-2")
        assert not scheduler.has_cache_item("img-3")
        req = mm_request("r1", "img-2", "img-3", "img-1")
        for i in range(3):
            scheduler.update_state_after_alloc(req, i)
        out = SchedulerOutput.make_empty()
        meta = scheduler.build_connector_meta(out)
        assert isinstance(meta, LMCacheECConnectorMetadata) and isinstance(meta, ECConnectorMetadata)
        assert meta.mm_hashes == ["img-1", "img-2"]
        assert scheduler.build_connector_meta(SchedulerOutput.make_empty()).mm_hashes == []
        # Metadata crosses to worker processes pickled.
        out.ec_connector_metadata = pickle.loads(pickle.dumps(meta))

        # Consumer step: vLLM's runner binds the metadata and calls start_load_caches.
        held = torch.zeros(1)
        encoder_cache: dict[str, torch.Tensor] = {"img-2": held}
        with ECConnectorModelRunnerMixin.maybe_get_ec_connector_output(out, encoder_cache=encoder_cache):
            pass
        assert encoder_cache["img-2"] is held  # never overwritten
        assert torch.equal(encoder_cache["img-1"], produced["img-1"])
        assert encoder_cache["img-1"].dtype == torch.float16
        assert encoder_cache["img-1"].device.type == "cpu"
        assert worker._connector_metadata is None  # vLLM cleared it after the step

        # Without bound metadata the load is a no-op; foreign metadata is a wiring error.
        worker.start_load_caches({})
        worker.bind_connector_metadata(ECConnectorMetadata())
        with pytest.raises(TypeError):
            worker.start_load_caches({})
        worker.clear_connector_metadata()
        assert worker.get_stats()["loaded"] == 1
    finally:
        scheduler.shutdown()
    engine = worker.impl.engine
    ensure_ec_transfer_shutdown()
    assert engine.closed


def test_consumer_only_instance_does_not_save(model_dir: Path, worker_agent: None) -> None:
    cfg = make_vllm_config(model_dir, "ec_consumer", SMALL)
    ensure_ec_transfer_initialized(cfg)
    worker = get_ec_transfer()
    assert worker.is_consumer and not worker.is_producer
    ECConnectorModelRunnerMixin.maybe_save_ec_to_connector({"h": torch.ones(4)}, "h")
    assert not worker.has_cache_item("h")


def test_producer_and_consumer_instances_share_through_a_disk_dir(
    model_dir: Path, tmp_path: Path, worker_agent: None
) -> None:
    pytest.importorskip("lmcache_async.disk.tier", reason="the disk tier is not in this tree")
    disk = {**SMALL, "local_disk": str(tmp_path / "ec"), "max_local_disk_size": 0.1}
    # (vLLM accepts a producer-only role only for multimodal models; ec_both produces too.)
    producer_cfg = make_vllm_config(model_dir, "ec_both", {**disk, "chunk_size": 16})
    consumer_cfg = make_vllm_config(model_dir, "ec_consumer", {**disk, "chunk_size": 32})
    producer = ECConnectorFactory.create_connector(producer_cfg, ECConnectorRole.WORKER)
    consumer_sched = ECConnectorFactory.create_connector(consumer_cfg, ECConnectorRole.SCHEDULER)
    consumer = ECConnectorFactory.create_connector(consumer_cfg, ECConnectorRole.WORKER)
    try:
        assert producer.impl.engine is not consumer.impl.engine  # like two processes
        t = torch.randn(6, 64, dtype=torch.float16)
        producer.save_caches({"img": t}, "img")
        producer.impl.engine.flush(timeout=30)
        assert consumer_sched.has_cache_item("img")
        consumer_sched.update_state_after_alloc(mm_request("r", "img"), 0)
        consumer.bind_connector_metadata(consumer_sched.build_connector_meta(SchedulerOutput.make_empty()))
        encoder_cache: dict[str, torch.Tensor] = {}
        consumer.start_load_caches(encoder_cache)
        consumer.clear_connector_metadata()
        assert torch.equal(encoder_cache["img"], t)
    finally:
        for c in (producer, consumer_sched, consumer):
            c.shutdown()


def test_stats_are_built_and_aggregated_through_vllms_api(model_dir: Path, worker_agent: None) -> None:
    stats = LMCacheECConnector.build_ec_connector_stats({"hits": 2, "loaded_bytes": 64})
    if stats is None:
        pytest.skip("this vLLM has no EC connector stats API")
    merged = stats.aggregate(LMCacheECConnector.build_ec_connector_stats({"hits": 1}))
    assert merged.reduce() == {"hits": 3, "loaded_bytes": 64}
    assert not merged.is_empty()
    cfg = make_vllm_config(model_dir, "ec_both", SMALL)
    scheduler = ECConnectorFactory.create_connector(cfg, ECConnectorRole.SCHEDULER)
    try:
        scheduler.get_ec_connector_stats()  # drain whatever start-up counted
        scheduler.has_cache_item("nothing")
        delta = scheduler.get_ec_connector_stats()
        assert delta.data["misses"] == 1 and delta.data["lookups"] == 1
    finally:
        scheduler.shutdown()
