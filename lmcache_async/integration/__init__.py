"""The integrations with inference engines: :mod:`.vllm`, :mod:`.sglang`, :mod:`.omni`."""

__all__: list[str] = []
