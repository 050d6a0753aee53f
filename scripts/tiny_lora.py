"""Build a random LoRA adapter for a model directory made by ``tiny_llama.py``, offline, with peft.

peft initialises ``lora_B`` to zeros (an adapter that changes nothing); here both halves are
random (seeded), so two adapters give two different models and so two different KV caches.

Usage::

    python scripts/tiny_lora.py BASE_DIR OUT_DIR [--seed 1 --rank 8]

``build(base_dir, out_dir, seed=..., rank=...)`` does the same from Python and returns
``out_dir``; a directory whose ``.recipe`` stamp matches is reused, any other is rebuilt
atomically (via a sibling temporary directory). Needs ``torch``, ``transformers`` and ``peft``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

RECIPE = "tiny-lora-1"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def build(base_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, seed: int = 1, rank: int = 8) -> Path:
    """Build the adapter into ``out_dir`` unless it already holds this recipe for these
    arguments; returns ``out_dir`` as a Path."""
    out = Path(out_dir)
    stamp_text = json.dumps({"recipe": RECIPE, "base": str(base_dir), "seed": seed, "rank": rank}, sort_keys=True)
    stamp = out / ".recipe"
    if stamp.is_file() and stamp.read_text() == stamp_text:
        return out
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-lora-", dir=out.parent))
    try:
        base = LlamaForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0))
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    p.normal_(0.0, 0.05)
        model.save_pretrained(str(tmp), safe_serialization=True)
        (tmp / ".recipe").write_text(stamp_text)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args(argv)
    print(build(args.base_dir, args.out_dir, seed=args.seed, rank=args.rank))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
