"""Build a tiny random-weight LLaVA model directory that vLLM loads offline.

Nothing is downloaded: the configs come from ``transformers`` classes, the weights are random
(seeded), and the tokenizer is a small BPE trained on the fly with ``tokenizers``. The model is
for exercising serving machinery (encoder cache, scheduling), not for producing sensible text.

Usage::

    python scripts/tiny_llava.py OUT_DIR        # builds OUT_DIR unless its stamp matches

``build(out_dir)`` does the same from Python and returns the directory. Needs ``torch``,
``transformers`` (5.x) and ``tokenizers`` (the vLLM environment has all three).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

RECIPE = "tiny-llava-3"
"""Changes whenever the model built below changes (a directory with another stamp is rebuilt)."""
IMAGE_SIZE = 56
PATCH_SIZE = 14
IMAGE_TOKEN = "<image>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_CORPUS = [
    "a small picture of a red square on a white background",
    "describe the image in one sentence please",
    "what colour is the object in the middle of the picture",
    "the quick brown fox jumps over the lazy dog",
    "user assistant system image text token cache encoder vision",
] * 20


def _tokenizer(out: Path) -> int:
    """Train and save the tokenizer; returns the image token's id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": IMAGE_TOKEN},
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    image_id = fast.convert_tokens_to_ids(IMAGE_TOKEN)
    assert isinstance(image_id, int)
    return image_id


def build(out_dir: str | os.PathLike[str]) -> Path:
    """Build the model into ``out_dir`` (atomically) unless it already holds this recipe."""
    out = Path(out_dir)
    stamp = out / ".recipe"
    if stamp.is_file() and stamp.read_text() == RECIPE:
        return out
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-llava-", dir=out.parent))
    try:
        image_id = _tokenizer(tmp)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp)
        vocab = len(tokenizer)
        vision = CLIPVisionConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=IMAGE_SIZE,
            patch_size=PATCH_SIZE,
            projection_dim=64,
        )
        text = LlamaConfig(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=vocab,
            max_position_embeddings=1024,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        config = LlavaConfig(
            vision_config=vision,
            text_config=text,
            image_token_index=image_id,
            vision_feature_layer=-1,
            vision_feature_select_strategy="default",
            projector_hidden_act="gelu",
        )
        config.dtype = "bfloat16"
        config.image_seq_length = (IMAGE_SIZE // PATCH_SIZE) ** 2
        torch.manual_seed(1234)
        model = LlavaForConditionalGeneration(config).to(torch.bfloat16)
        with torch.no_grad():  # random weights with a spread that keeps activations finite
            for p in model.parameters():
                p.normal_(0.0, 0.05)
        model.save_pretrained(tmp, safe_serialization=True)
        # vLLM's CLIP loader expects the vision tower's weights under `vision_model.`.
        for f in tmp.glob("*.safetensors"):
            tensors = load_file(str(f))
            renamed = {}
            for k, v in tensors.items():
                head, sep, tail = k.partition("vision_tower.")
                if sep and not tail.startswith("vision_model."):
                    k = f"{head}vision_tower.vision_model.{tail}"
                renamed[k] = v
            save_file(renamed, str(f), metadata={"format": "pt"})
        image_processor = CLIPImageProcessor(
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        )
        processor = LlavaProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=PATCH_SIZE,
            vision_feature_select_strategy="default",
            chat_template=CHAT_TEMPLATE,
            image_token=IMAGE_TOKEN,
            num_additional_image_tokens=1,
        )
        processor.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.setdefault("dtype", "bfloat16")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        (tmp / ".recipe").write_text(RECIPE)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_llava.py OUT_DIR")
    print(build(sys.argv[1]))
