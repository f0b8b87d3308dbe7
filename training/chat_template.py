"""A conversation ({"messages": [{"role", "content"}, ...]}) as text pieces, each marked
trained (an assistant turn) or not -- what `training/sft.py` tokenizes piece by piece.

Two templates:

- the tokenizer's own: the ``chat_template`` a Hugging Face tokenizer folder ships
  (tokenizer_config.json, or chat_template.jinja beside it), rendered by transformers'
  ``apply_chat_template``. Templates rarely mark where an assistant turn starts and ends,
  so the pieces are found by rendering the conversation's prefixes: the text up to an
  assistant turn (with the generation prompt: "<|im_start|>assistant\\n" and the like) is
  not trained, the text that turn adds after it is. A template that does not render a
  conversation as the prefix of its continuation cannot be split this way, and is refused.
- PLAIN, for the byte tokenizer and any tokenizer without a template: every message is
  "<|ROLE|>\\n" then its content then "\\n"; an assistant turn's content and its "\\n" are
  trained (the "\\n" is how the model learns to end a reply), everything else is not.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from meshtrain.training.config import ConfigError

CHOICES = ("auto", "tokenizer", "plain")  # [training] chat_template


def plain_pieces(messages: list[dict]) -> list[tuple[str, bool]]:
    pieces = []
    for m in messages:
        assistant = m["role"] == "assistant"
        pieces += [(f"<|{m['role']}|>\n", False), (m["content"] + "\n", assistant)]
    return pieces


def _template_folder(tokenizer: str) -> Path | None:
    """The folder of a tokenizer.json, where its tokenizer_config.json would be."""
    return None if tokenizer == "byte" else Path(tokenizer).resolve().parent


def tokenizer_has_template(tokenizer: str) -> bool:
    folder = _template_folder(tokenizer)
    if folder is None:
        return False
    if (folder / "chat_template.jinja").is_file():
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def resolve(choice: str, tokenizer: str) -> str:
    """"tokenizer" or "plain" for [training] chat_template = ``choice`` ("auto": the
    tokenizer's own when it has one). Asking for the tokenizer's when it has none is an error."""
    if choice not in CHOICES:
        raise ConfigError(f'[training] chat_template = "{choice}": accepted: {", ".join(CHOICES)}')
    has = tokenizer_has_template(tokenizer)
    if choice == "tokenizer" and not has:
        where = ("the byte tokenizer has none" if tokenizer == "byte" else
                 f"no chat_template in {_template_folder(tokenizer) / 'tokenizer_config.json'} "
                 f"(nor a chat_template.jinja beside {tokenizer})")
        raise ConfigError(f'[training] chat_template = "tokenizer", but {where}; use chat_template = "plain" '
                          f'(the template docs/finetuning.md describes) or a tokenizer folder that ships one')
    return "tokenizer" if choice == "tokenizer" or (choice == "auto" and has) else "plain"


@functools.lru_cache(maxsize=2)
def _hf_tokenizer(folder: str):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(f"{folder}: rendering its chat template needs transformers: pip install transformers "
                          f'(or pip install "meshtrain[hf]"), or use [training] chat_template = "plain"') from None
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return AutoTokenizer.from_pretrained(folder)


def template_pieces(messages: list[dict], tokenizer: str) -> list[tuple[str, bool]]:
    """The conversation rendered by the tokenizer's own chat template, cut into pieces at
    the start and end of each assistant turn (see the module docstring)."""
    hf = _hf_tokenizer(str(_template_folder(tokenizer)))
    render = lambda msgs, prompt: hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)
    pieces, done = [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head, turn = render(messages[:i], True), render(messages[:i + 1], False)
        if not (head.startswith(done) and turn.startswith(head)):
            raise ValueError("the tokenizer's chat template does not render a conversation as the start of its "
                             "continuation, so its assistant turns cannot be told apart; use [training] "
                             'chat_template = "plain"')
        pieces += [(head[len(done):], False), (turn[len(head):], True)]
        done = turn
    rest = render(messages, False)
    if not rest.startswith(done):
        raise ValueError("the tokenizer's chat template renders the whole conversation differently from its "
                         'parts; use [training] chat_template = "plain"')
    return pieces + [(rest[len(done):], False)]
