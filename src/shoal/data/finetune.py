"""Fine-tuning data for `shoal data prepare --format chat|completion`: records -> token ids and a
loss mask (1 where a token is a target the model learns to predict, 0 where it only reads it).

- chat: a jsonl record's "messages" (or --field) is a list of {"role", "content"} messages,
  rendered with the tokenizer's chat template (transformers' apply_chat_template); the targets
  are the assistant's turns as the template renders them (its closing marker included, its
  opening header not), found by rendering the conversation prefix by prefix.
- completion: a record's "prompt" and "completion" strings, tokenized each on its own and
  joined; the targets are the completion's tokens.
In both, the EOS that prepare appends after a document is a target when the token before it is
(the model learns to stop after its answer).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

FORMATS = ("text", "chat", "completion")
COMPLETION_FIELDS = ("prompt", "completion")
ROLES = ("system", "user", "assistant", "tool")
"""The roles of chat messages (transformers' chat format); a template renders other names as text."""
Encoded = tuple[list[int], list[int]]
"""A document's token ids and its loss mask (one 0/1 a token)."""


def default_field(fmt: str) -> str:
    """The record field a format reads when --field is not given."""
    return {"text": "text", "chat": "messages", "completion": "prompt,completion"}[fmt]


def chat_template(tokenizer: str) -> str | None:
    """The chat template a local tokenizer folder ships (tokenizer_config.json's "chat_template",
    or a chat_template.jinja file), or None."""
    folder = Path(tokenizer)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    try:
        value = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value.strip() else None


def check_format(fmt: str, tokenizer: str, kinds: list[str]) -> None:
    """ValueError in one line when `fmt` cannot be prepared with this tokenizer and these inputs."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r} is not valid; valid: {', '.join(FORMATS)}")
    if fmt == "text":
        return
    if any(kind != "jsonl" for kind in kinds):
        raise ValueError(f"--format {fmt} reads jsonl inputs (.jsonl, .gz, .zst) only; got {', '.join(kinds)}")
    if fmt == "chat" and (tokenizer == "byte" or chat_template(tokenizer) is None):
        raise ValueError(f"tokenizer {tokenizer!r} has no chat template, which --format chat needs to render "
                         "conversations; valid: a tokenizer folder whose tokenizer_config.json has a chat_template")


def validate(fmt: str, value: Any, where: Callable[[], str]) -> Any:
    """A record's value for `fmt`, checked; ValueError naming where() (file:line) otherwise (called
    on an error only: finding a line's number in a byte range reads the file up to it)."""
    if fmt == "chat":
        if not (isinstance(value, list) and value):
            raise ValueError(f"{where()}: messages must be a non-empty list of {{\"role\": str, \"content\": str}}")
        for index, message in enumerate(value):
            _check_message(message, index, where)
        return value
    if fmt == "completion":
        wrong = [(name, v) for name, v in zip(COMPLETION_FIELDS, value) if not isinstance(v, str)]
        if wrong:
            raise ValueError(f"{where()}: {wrong[0][0]!r} holds {type(wrong[0][1]).__name__}, not text; valid: "
                             "{\"prompt\": str, \"completion\": str}")
        return tuple(value)
    if not isinstance(value, str):
        raise ValueError(f"{where()}: holds {type(value).__name__}, not text")
    return value


def _check_message(message: Any, index: int, where: Callable[[], str]) -> None:
    """Message `index` of a conversation: a {"role", "content"} dict whose role a chat template knows."""
    problem = None
    if not isinstance(message, dict):
        problem = f"is {type(message).__name__}, not a {{\"role\": str, \"content\": str}} object"
    elif missing := [key for key in ("role", "content") if key not in message]:
        problem = (f"has no {missing[0]!r} (has: {', '.join(map(str, message)) or 'nothing'}); valid: "
                   "{\"role\": str, \"content\": str}")
    elif wrong := [key for key in ("role", "content") if not isinstance(message[key], str)]:
        problem = f"{wrong[0]!r} holds {type(message[wrong[0]]).__name__}, not text"
    elif message["role"] not in ROLES:
        problem = f"role {message['role']!r} is not valid; valid: {', '.join(ROLES)}"
    if problem is not None:
        raise ValueError(f"{where()}: message {index} {problem}")


def encoder(fmt: str, tokenizer: str) -> Callable[[list[Any]], list[Encoded]]:
    """Records (validated values) -> (ids, mask) per document, for a worker process."""
    if fmt == "completion":
        encode = _plain_encoder(tokenizer)

        def completions(records: list[Any]) -> list[Encoded]:
            prompts, answers = encode([r[0] for r in records]), encode([r[1] for r in records])
            return [(p + a, [0] * len(p) + [1] * len(a)) for p, a in zip(prompts, answers)]
        return completions
    assert fmt == "chat", fmt
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    tok.chat_template = chat_template(tokenizer)
    return lambda records: [_chat(tok, messages) for messages in records]


def _plain_encoder(name: str) -> Callable[[list[str]], list[list[int]]]:
    if name == "byte":
        return lambda texts: [list(t.encode("utf-8")) for t in texts]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(name) / "tokenizer.json"))
    return lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def _chat(tok: Any, messages: list[dict[str, str]]) -> Encoded:
    """One conversation's ids and mask: the characters of each assistant turn are those between
    the rendering of the turns before it (with the generation prompt) and of the turns up to it."""
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = tok.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(upto) and upto.startswith(before)):
            raise ValueError("the tokenizer's chat template does not render a conversation as the renderings of "
                             "its beginnings, so the assistant's tokens cannot be found; valid: such a template")
        spans.append((len(before), len(upto)))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = np.array([a for a, _ in enc["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(starts), dtype=np.int64)
    for lo, hi in spans:
        mask |= (starts >= lo) & (starts < hi)
    return list(enc["input_ids"]), mask.tolist()
