"""Variants of the KV tests' tiny float32 Llama that differ only in ``config.json``.

``sliding_variant`` turns every other layer into sliding-window attention
(``layer_types: [full_attention, sliding_attention, ...]``, ``sliding_window`` tokens): vLLM's
hybrid KV-cache manager then keeps two KV-cache groups, and the window layers hold only the
blocks inside the window. The weights are those of the base model (hard-linked or copied), so a
variant is built in a moment and reused while its stamp matches.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

VARIANT_RECIPE = "variant-1"


def _stamp(base: Path, changes: dict[str, Any]) -> str:
    base_stamp = (base / ".recipe").read_text() if (base / ".recipe").exists() else str(base)
    return json.dumps({"recipe": VARIANT_RECIPE, "base": base_stamp, "changes": changes}, sort_keys=True)


def config_variant(base: Path, target: Path, changes: dict[str, Any]) -> Path:
    """``target``: the model of ``base`` with ``changes`` merged into its ``config.json``
    (built atomically through a sibling temporary directory; reused while its stamp matches)."""
    stamp = _stamp(base, changes)
    if (target / ".recipe").is_file() and (target / ".recipe").read_text() == stamp:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".variant-", dir=target.parent))
    try:
        for item in base.iterdir():
            if item.name in {".recipe", "config.json"}:
                continue
            try:
                os.link(item, tmp / item.name)
            except OSError:
                shutil.copy2(item, tmp / item.name)
        cfg = json.loads((base / "config.json").read_text())
        cfg.update(changes)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        (tmp / ".recipe").write_text(stamp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def sliding_variant(base: Path, window: int, num_layers: int) -> Path:
    """The base model with layers 1, 3, 5, ... attending to the last ``window`` tokens only."""
    kinds = ["full_attention" if i % 2 == 0 else "sliding_attention" for i in range(num_layers)]
    changes = {"layer_types": kinds, "sliding_window": window}
    return config_variant(base, base.parent / f"{base.name}-swa{window}", changes)
