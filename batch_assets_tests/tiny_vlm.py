"""The tests' tiny random-weight vision-language model, built once into .venv: the SmolVLM architecture
(Idefics3: a SigLIP-style vision tower, a pixel-shuffle connector and a Llama text model) at the tiny
text model's size, with the embedded SmolLM2 tokenizer plus the image tokens its processor needs and
a chat template that puts each image part where the message has it.

Why Idefics3: of vLLM 0.32's vision-language models, it is the one whose code and Hugging Face
processor load without torchvision (LLaVA, Qwen2-VL and most others import it), and SmolVLM is a
real small VLM of this architecture. A 32x32-pixel tower with 8x8 patches and scale factor 2 gives
4 image tokens an image; images are resized to 32 pixels on their longest edge, never split.

Plain functions, no pytest: conftest.py's fixtures and bench/bench_images.py both build it here.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
IMAGE_SIDE = 32
# Each image part becomes `<image>` in the text; the processor expands it into the image's tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] in ['image', 'image_url'] %}{{ '<image>\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def built_tiny_vlm() -> Path:
    """The tiny VLM's folder (`BATCH_ASSETS_TEST_VLM_CACHE`, else .venv/tiny-test-vlm), built there if
    missing, under a lock (pytest's workers may start at once)."""
    from batch_assets.runtime.instance import exclusive_file_lock

    cached = Path(os.environ.get("BATCH_ASSETS_TEST_VLM_CACHE", REPO_ROOT / ".venv" / "tiny-test-vlm"))
    if (cached / "model.safetensors").exists():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_file_lock(cached.with_name(cached.name + ".lock")):
        if not (cached / "model.safetensors").exists():
            build_tiny_vlm(cached)
    return cached


def build_tiny_vlm(destination: Path) -> Path:
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        Idefics3VisionConfig,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from batch_assets.engines.embedded_model import ensure_embedded_model
    from batch_assets_tests.tiny_model import tiny_llama_config

    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model())
    grid = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]  # the processor looks them up
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                "<fake_token_around_image>",
                "<image>",
                "<end_of_utterance>",
                "<global-img>",
                *grid,
            ]
        }
    )
    text = tiny_llama_config(tokenizer)
    # A wider initialisation than the default 0.02, so an image visibly moves the random model's answers.
    vision = Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIDE,
        patch_size=8,
        initializer_range=0.5,
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.eos_token_id,
        initializer_range=0.5,
    )
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    staging = destination.with_name(destination.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    side = {"longest_edge": IMAGE_SIDE}
    images = Idefics3ImageProcessorPil(size=side, max_image_size=side, do_image_splitting=False)
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4).save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    shutil.rmtree(destination, ignore_errors=True)
    staging.rename(destination)
    return destination


if __name__ == "__main__":
    print(built_tiny_vlm())


def write_test_images(folder: Path, count: int, seed: int = 0) -> list[str]:
    """`count` small generated pictures (PNG and JPEG, several sizes, random colours and shapes) in
    `folder`; their names, in order. The same seed, the same bytes (Pillow's own encoders)."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for index in range(count):
        width, height = rng.choice([(16, 16), (32, 24), (48, 64), (100, 60), (200, 150)])
        image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
        draw = ImageDraw.Draw(image)
        for _ in range(3):
            x, y = rng.randrange(width), rng.randrange(height)
            box = (x, y, min(width, x + rng.randrange(4, 40)), min(height, y + rng.randrange(4, 40)))
            draw.rectangle(box, fill=tuple(rng.randrange(256) for _ in range(3)))
        name = f"img-{index:04d}.{'png' if index % 2 == 0 else 'jpg'}"
        image.save(folder / name, format="PNG" if name.endswith(".png") else "JPEG", quality=90)
        names.append(name)
    return names
