"""One Omni stage in its own process, for the cross-process tests (run as a script).

argv: ``ROLE IMPL EXTRA_JSON REQUEST_ID``

* ``ROLE`` ``thinker``: put the thinker's payload (a dict with hidden states) and a raw tensor
  for ``REQUEST_ID`` on the edge ``thinker -> talker``; print one JSON line.
* ``ROLE`` ``talker``: print ``ready``, then ``get_with_deadline`` both (deadline 400 s), check
  them against the expected values, check a second read misses (consumed); print one JSON line.
* ``IMPL``: ``connector`` (LMCacheOmniConnector from the factory, as Omni builds it) or ``store``.

Payloads are pure functions of ``REQUEST_ID``, so the talker can check every byte.
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from typing import Any

import torch


def expected(request_id: str) -> tuple[dict[str, Any], torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(request_id.encode()))
    payload = {
        "hidden_states": torch.randn(512, 512, generator=g).to(torch.bfloat16),
        "token_ids": list(range(17)),
        "meta": {"request_id": request_id, "finished": True, "ratio": 0.5},
    }
    raw = torch.randint(0, 255, (3, 1000), generator=g, dtype=torch.uint8)
    return payload, raw


def build(impl: str, extra: dict[str, Any]) -> Any:
    if impl == "connector":
        from vllm_omni.distributed.omni_connectors import ConnectorSpec, OmniConnectorFactory

        from lmcache_async.integration.omni import CONNECTOR_NAME, register

        register()
        return OmniConnectorFactory.create_connector(ConnectorSpec(name=CONNECTOR_NAME, extra=extra))
    from lmcache_async.integration.omni import OmniStageStore, load_stage_options

    cfg, opts = load_stage_options(extra)
    return OmniStageStore(cfg, opts)


def main(role: str, impl: str, extra_json: str, request_id: str) -> int:
    conn = build(impl, json.loads(extra_json))
    payload, raw = expected(request_id)
    out: dict[str, Any] = {"role": role}
    try:
        if role == "thinker":
            out["payload"] = conn.put("thinker", "talker", f"{request_id}_0_0", payload)[:2]
            out["raw"] = conn.put("thinker", "talker", f"{request_id}_0_1", raw)[:2]
        else:
            print("ready", flush=True)
            deadline = time.monotonic() + 400  # the thinker's import of vLLM may take minutes on a loaded host
            got = conn.get_with_deadline("thinker", "talker", f"{request_id}_0_0", None, deadline=deadline)
            got_raw = conn.get_with_deadline("thinker", "talker", f"{request_id}_0_1", None, deadline=deadline)
            out["received"] = [got is not None, got_raw is not None]
            ok = got is not None and got_raw is not None
            if ok:
                data = got[0]
                ok = (
                    isinstance(data, dict)
                    and torch.equal(data["hidden_states"], payload["hidden_states"])
                    and data["token_ids"] == payload["token_ids"]
                    and data["meta"] == payload["meta"]
                    and isinstance(got_raw[0], torch.Tensor)
                    and torch.equal(got_raw[0], raw)
                )
            out["ok"] = ok
            out["again"] = conn.get("thinker", "talker", f"{request_id}_0_0") is not None
        out["health"] = conn.health()["status"]
    finally:
        conn.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
