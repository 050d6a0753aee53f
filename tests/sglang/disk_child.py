"""Child process of the cross-process test: store pages through the disk tier, then exit.

Usage: python disk_child.py SPEC_JSON. SPEC names the layout, the extra config, the page hashes,
the pool pages to store and where to write the expected bytes (raw, page after page). Prints one
JSON line with the results of ``batch_set_v1`` and of the flush.
"""

from __future__ import annotations

import json
import sys
import warnings


def main() -> int:
    spec = json.loads(sys.argv[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        from lmcache_async.integration.sglang.cpu_pool import build_cpu_host_pool

    pool = build_cpu_host_pool(spec["layout"], page_num=spec["page_num"])
    g = torch.Generator().manual_seed(spec["seed"])
    bits = torch.randint(-(1 << 15), 1 << 15, pool.kv_buffer.shape, generator=g, dtype=torch.int16)
    pool.kv_buffer.view(torch.int16).copy_(bits)
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name="test/model",
        extra_config=spec["extra"],
    )  # fmt: skip
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    p = pool.page_size
    idx = torch.cat([torch.arange(q * p, (q + 1) * p) for q in spec["pages"]])
    stored = backend.batch_set_v1(spec["keys"], idx)
    flushed = backend.flush()
    with open(spec["expected"], "wb") as f:
        for q in spec["pages"]:
            f.write(pool.get_data_page(q * p).contiguous().view(torch.uint8).numpy().tobytes())
    backend.close()
    print(json.dumps({"stored": stored, "flushed": flushed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
