"""Functions run inside vLLM's worker through ``LLM.collective_rpc`` (each gets the worker).

They live in an importable module so a worker in another process unpickles them by reference.
"""

from __future__ import annotations

from typing import Any


def _worker(obj: Any) -> Any:
    return getattr(obj, "worker", None) or obj


def install_vision_counter(obj: Any) -> bool:
    """Count calls (and images) of the model's vision tower from now on."""
    model = _worker(obj).model_runner.get_model()
    tower = model.vision_tower
    if getattr(tower, "_e2e_counter", None) is not None:
        tower._e2e_counter.update(calls=0, images=0)
        return True
    counter = {"calls": 0, "images": 0}

    def hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
        counter["calls"] += 1
        if args and hasattr(args[0], "shape"):
            counter["images"] += int(args[0].shape[0])

    tower.register_forward_hook(hook)
    tower._e2e_counter = counter
    return True


def read_vision_counter(obj: Any) -> dict[str, int]:
    tower = _worker(obj).model_runner.get_model().vision_tower
    return dict(tower._e2e_counter)


def connector_stats(obj: Any) -> dict[str, Any] | None:
    from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

    if not has_ec_transfer():
        return None
    stats = get_ec_transfer().impl.stats()
    stats.pop("engine", None)
    return stats


def flush_connector(obj: Any) -> bool:
    from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

    if has_ec_transfer():
        get_ec_transfer().impl.engine.flush(timeout=60)
    return True
