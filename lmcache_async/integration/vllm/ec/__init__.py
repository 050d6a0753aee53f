"""vLLM's encoder-cache connector (``ECConnectorBase``).

:mod:`.connector` is the class vLLM loads, :mod:`.impl` its framework-free half; the scheduler
and worker sides, leases and counters are beside them.
"""

__all__: list[str] = []
