"""vLLM's KV connector (``KVConnectorBase_V1``).

:mod:`.connector` is the class vLLM loads; scheduler and worker sides, lookup, load-or-recompute
(:mod:`.costs`), KV-cache groups, hidden states and KV events are beside it.
"""

__all__: list[str] = []
