"""Tokenizers, loaded once per process: formatting and inference of every partition share them.

A model folder with a `tokenizer.json` is read with the `tokenizers` library itself
(`FastTokenizer`): that is what transformers' fast tokenizers run underneath, and importing
transformers (and torch with it) costs 10-15 s of every run that only renders prompts and counts
their tokens. Its chat template is rendered with jinja2 set up as transformers sets it up
(`chat_template_environment`), so the text is the same. A folder without `tokenizer.json`, a Hugging
Face id, or a folder whose tokenizer_config.json asks transformers to change what tokenizer.json
says (`_needs_transformers`) is loaded with transformers' AutoTokenizer as before.
`batch_assets_tests/test_prompt_tokens.py` compares the two on every shipped task.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

# Special tokens transformers exposes as `<name>` (string) and `<name>_id`, and passes to a chat template.
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@functools.lru_cache(maxsize=8)
def load_tokenizer(source: str):
    """The tokenizer of a model folder or id: a `FastTokenizer` where tokenizer.json says it all."""
    fast = FastTokenizer.from_folder(Path(source)) if Path(source).is_dir() else None
    if fast is not None:
        return fast
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


@functools.lru_cache(maxsize=16)
def compiled_chat_template(template: str):
    """A chat template compiled as transformers' `_compile_jinja_template` does (sandboxed, blocks
    trimmed, loop controls, its `tojson`, `raise_exception` and `strftime_now`): hand-written here so
    rendering a prompt needs jinja2 only, not transformers and torch. The `{% generation %}` blocks
    transformers tracks (assistant masks for training) render their body, as there."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # As transformers: json.dumps, not jinja's HTML-escaping filter.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment.from_string(template)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _chat_template(folder: Path, config: dict) -> str | None:
    """The chat template: chat_template.jinja (transformers 5 saves it there), else the config's.
    A list of named templates gives its `default` one."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class FastTokenizer:
    """The part of a transformers tokenizer the pipeline uses, on the `tokenizers` library alone.

    `__call__` encodes as a transformers fast tokenizer called without truncation or padding does
    (it switches off what tokenizer.json sets of them, and so does this); `apply_chat_template`
    renders as transformers does (and tokenizes without adding special tokens, as it does)."""

    # Set from tokenizer_config.json (`_SPECIAL_NAMES`): the token's text and its id, None if unset.
    bos_token: str | None
    bos_token_id: int | None
    eos_token: str | None
    eos_token_id: int | None
    unk_token: str | None
    unk_token_id: int | None
    pad_token: str | None
    pad_token_id: int | None

    def __init__(self, backend, config: dict, chat_template: str | None) -> None:
        backend.no_truncation()
        backend.no_padding()
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.split_special_tokens = bool(config.get("split_special_tokens", False))
        self.truncation_side = config.get("truncation_side", "right")
        self.model_max_length = config.get("model_max_length")
        self._copies: dict[tuple[bool, int | None], Any] = {}
        self.special_tokens_map: dict[str, str] = {}
        for name in _SPECIAL_NAMES:
            text = _token_text(config.get(name))
            if text is not None:
                self.special_tokens_map[name] = text
            setattr(self, name, text)
            setattr(self, f"{name}_id", backend.token_to_id(text) if text is not None else None)
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
        extra_texts = [_token_text(token) for token in (extra.values() if isinstance(extra, dict) else extra)]
        self.all_special_tokens = list(
            dict.fromkeys([*self.special_tokens_map.values(), *(t for t in extra_texts if t)])
        )
        self.added_tokens_decoder = backend.get_added_tokens_decoder()

    @classmethod
    def from_folder(cls, folder: Path) -> FastTokenizer | None:
        """The folder's tokenizer, or None where transformers is needed to load it as it would."""
        from tokenizers import Tokenizer

        tokenizer_json, config_json = folder / "tokenizer.json", folder / "tokenizer_config.json"
        if not tokenizer_json.is_file():
            return None
        try:
            config = json.loads(config_json.read_text()) if config_json.is_file() else {}
            tokenizer = cls(Tokenizer.from_file(str(tokenizer_json)), config, _chat_template(folder, config))
        except Exception:
            return None  # whatever transformers makes of it, it says so itself
        return None if _needs_transformers(tokenizer, config) else tokenizer

    def __call__(
        self,
        text,
        add_special_tokens: bool = True,
        split_special_tokens: bool | None = None,
        truncation: bool = False,
        max_length: int | None = None,
    ):
        """{"input_ids": ids} of a text, or of each text of a list."""
        split = self.split_special_tokens if split_special_tokens is None else split_special_tokens
        backend = self._backend(split, max_length if truncation else None)
        if isinstance(text, str):
            return {"input_ids": backend.encode(text, add_special_tokens=add_special_tokens).ids}
        encodings = backend.encode_batch_fast(list(text), add_special_tokens=add_special_tokens)
        return {"input_ids": [encoding.ids for encoding in encodings]}

    def _backend(self, split: bool, max_length: int | None):
        """The Rust tokenizer, or a copy set once to split special-token text or to cut at
        `max_length`: the shared one is never switched (threads may use it at the same time)."""
        if not split and max_length is None:
            return self.backend_tokenizer
        key = (split, max_length)
        if key not in self._copies:
            from tokenizers import Tokenizer

            copy = Tokenizer.from_str(self.backend_tokenizer.to_str())
            copy.encode_special_tokens = split
            if max_length is not None:
                copy.enable_truncation(max_length, direction=self.truncation_side)
            self._copies[key] = copy
        return self._copies[key]

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        return self.backend_tokenizer.num_special_tokens_to_add(pair)

    def apply_chat_template(
        self, conversation, tokenize: bool = True, add_generation_prompt: bool = False, **kwargs: Any
    ):
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat template")
        rendered = compiled_chat_template(self.chat_template).render(
            messages=conversation,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs},
        )
        return self(rendered, add_special_tokens=False)["input_ids"] if tokenize else rendered

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _needs_transformers(tokenizer: FastTokenizer, config: dict) -> bool:
    """tokenizer_config.json settings transformers applies over tokenizer.json: where they would
    change the ids (BOS/EOS added otherwise than its post-processor does, a prefix space), loading
    through transformers keeps the ids exactly as they were."""
    if "add_prefix_space" in config:
        return True
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    for flag, token_id, at in (
        ("add_bos_token", tokenizer.bos_token_id, 0),
        ("add_eos_token", tokenizer.eos_token_id, -1),
    ):
        if flag in config and bool(config[flag]) != (token_id is not None and bool(ids) and ids[at] == token_id):
            return True
    return False
