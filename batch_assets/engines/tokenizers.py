"""Tokenizers, loaded once per process: formatting and inference of every partition share them."""

import functools


@functools.lru_cache(maxsize=8)
def load_tokenizer(source: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)
