"""Build a random-weight float32 Llama model directory that vLLM loads offline.

Nothing is downloaded: the config comes from ``transformers.LlamaConfig``, the weights are random
(seeded) and the tokenizer is a small byte-level BPE trained on the fly with ``tokenizers``. The
model exists to exercise serving machinery (KV connectors, prefix caching, scheduling); it does not
produce sensible text. It is float32 because on this CPU build any partial prefill in bf16 (vLLM's
own prefix cache included) changes greedy tokens after a dozen steps, while in fp32 they match.

The default sizes (8 layers x 1024 hidden, MLP 2816, 16 query heads, 4 KV heads, vocabulary
4096: 98 M parameters, 390 MB) make an
uncached prefill of a ~3,000-token prompt take several seconds on a 2-vCPU machine, so a cache hit
is clearly distinguishable from recomputation.

Usage::

    python scripts/tiny_llama.py OUT_DIR [--layers 8 --hidden 1024 --heads 16 --kv-heads 4
                                          --vocab 4096 --max-len 4096 --seed 0]

Reruns are cheap: ``OUT_DIR/.recipe`` records the recipe and the sizes, and a directory whose stamp
matches is reused as it is; any other content is rebuilt (atomically, via a sibling temporary
directory). ``build(out_dir, **sizes)`` does the same from Python and returns the directory. Needs
``torch``, ``transformers`` (5.x), ``safetensors`` and ``tokenizers`` (the vLLM environment has all).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

RECIPE = "tiny-llama-1"
"""Changes whenever the model built below changes (a directory with another stamp is rebuilt)."""

DEFAULTS: dict[str, int] = {
    "layers": 8,
    "hidden": 1024,
    "heads": 16,
    "kv_heads": 4,
    "vocab": 4096,
    "max_len": 4096,
    "seed": 0,
}
"""The sizes ``build`` uses for every keyword it is not given."""

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_TEXT = (
    "the quick brown fox jumps over the lazy dog while a cache keeps every chunk of keys and values "
    "for the next request so that prefill skips work already done by an earlier engine on this "
    "machine storage tier pool disk remote block layer head token prompt model weight random seed "
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma"
)


def _corpus(seed: int) -> list[str]:
    """A deterministic pseudo-text corpus (words and digit runs) to train the tokenizer on."""
    import random

    rng = random.Random(seed)
    words_of = _TEXT.split()
    lines = []
    for _ in range(2000):
        words = [rng.choice(words_of) for _ in range(rng.randint(4, 16))]
        words.append(str(rng.randint(0, 99999)))
        lines.append(" ".join(words))
    return lines


def _check_sizes(sizes: dict[str, int]) -> None:
    """Raise ValueError naming the first argument that cannot describe a Llama model."""
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if name != "seed" and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if sizes["hidden"] % sizes["heads"]:
        raise ValueError(f"hidden ({sizes['hidden']}) must be a multiple of heads ({sizes['heads']})")
    if sizes["heads"] % sizes["kv_heads"]:
        raise ValueError(f"heads ({sizes['heads']}) must be a multiple of kv_heads ({sizes['kv_heads']})")
    if sizes["vocab"] < 300:
        raise ValueError(f"vocab must be at least 300 (byte alphabet + specials), got {sizes['vocab']}")


def _tokenizer(out: Path, vocab: int, seed: int) -> int:
    """Train a byte-level BPE of at most ``vocab`` entries, save it to ``out``; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=1 << 30,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return len(fast)


def _intermediate(hidden: int) -> int:
    """Llama's MLP width: about 2.75 x hidden, rounded up to a multiple of 256 (2,816 for 1,024)."""
    return -(-hidden * 11 // 4 // 256) * 256


def _stamp(sizes: dict[str, int]) -> str:
    return json.dumps({"recipe": RECIPE, **sizes}, sort_keys=True)


def build(out_dir: str | os.PathLike[str], **sizes: int) -> Path:
    """Build the model into ``out_dir`` unless it already holds this recipe with these sizes.

    ``sizes`` are any of ``DEFAULTS``' keys (``layers``, ``hidden``, ``heads``, ``kv_heads``,
    ``vocab``, ``max_len``, ``seed``); unknown keys raise TypeError, impossible values ValueError.
    ``vocab`` is the model's vocabulary size; the tokenizer holds at most that many entries (ids it
    never emits still have embeddings, so prompts may be given as arbitrary ids below ``vocab``).
    Returns ``out_dir`` as a Path. Building writes a sibling temporary directory and renames it, so
    a crash never leaves a half-built directory behind a valid stamp.
    """
    unknown = set(sizes) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown size argument(s): {', '.join(sorted(unknown))}")
    full = {**DEFAULTS, **sizes}
    _check_sizes(full)
    out = Path(out_dir)
    stamp = out / ".recipe"
    if stamp.is_file() and stamp.read_text() == _stamp(full):
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-llama-", dir=out.parent))
    try:
        _tokenizer(tmp, full["vocab"], full["seed"])
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp)
        config = LlamaConfig(
            hidden_size=full["hidden"],
            intermediate_size=_intermediate(full["hidden"]),
            num_hidden_layers=full["layers"],
            num_attention_heads=full["heads"],
            num_key_value_heads=full["kv_heads"],
            head_dim=full["hidden"] // full["heads"],
            vocab_size=full["vocab"],
            max_position_embeddings=full["max_len"],
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
        )
        config.dtype = "float32"
        torch.manual_seed(full["seed"])
        model = LlamaForCausalLM(config).to(torch.float32)
        with torch.no_grad():  # a spread that keeps activations finite through every layer
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.05)
        model.save_pretrained(tmp, safe_serialization=True)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        (tmp / ".recipe").write_text(_stamp(full))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", dest=key, type=int, default=value)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    sizes = {key: getattr(args, key) for key in DEFAULTS}
    try:
        print(build(args.out_dir, **sizes))
    except (TypeError, ValueError) as exc:
        print(f"tiny_llama.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
