"""A test connector: ``LMCacheKVConnector`` reporting failed loads by block id whatever the groups.

That is how the connector reported them before it learnt that vLLM refuses block ids with more
than one KV-cache group; loaded with ``kv_connector_module_path="block_errors_connector"``
(``tests/e2e`` on ``PYTHONPATH``) it shows what vLLM does then: its scheduler raises in
``_handle_invalid_blocks`` and the engine dies.
"""

from __future__ import annotations

from typing import Any

from lmcache_async.integration.vllm.kv.connector import LMCacheKVConnector


class BlockErrorsKVConnector(LMCacheKVConnector):
    """See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.worker_side is not None:
            self.worker_side.per_request_failures = False
        if self.scheduler_side is not None:
            self.scheduler_side.per_request_failures = False
