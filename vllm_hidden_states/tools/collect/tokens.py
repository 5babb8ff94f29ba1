# SPDX-License-Identifier: Apache-2.0
"""A ``collect`` document's token ids (as the server's route encodes them), and
the client-side cut of a long document: a prefix of its text, or of its
conversation, that encodes to the same first ``--max-length`` tokens, so a
long document costs a small request (docs/datasets.md, "Long documents")."""

from __future__ import annotations

from typing import Any

from vllm_hidden_states.tools.collect.dataset import Doc


def tokenize_text(tokenizer, text: str, max_length: int) -> list[int]:
    """The first ``max_length`` token ids of a text, as the route encodes it
    (benchmarks/harvest.py uses it)."""
    return list(tokenizer.encode(text))[:max_length]


def render_ids(tokenizer, messages) -> list[int]:
    """A conversation's token ids: the chat template with the generation
    prompt, encoded without adding special tokens (the template has them)."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def doc_ids(tokenizer, doc: Doc) -> list[int]:
    """Every token id of a document (not cut)."""
    if doc.text is not None:
        return list(tokenizer.encode(doc.text))
    return render_ids(tokenizer, doc.messages)


# A first guess of characters per token for a prefix; doubled until it holds.
_CHARS_PER_TOKEN = 8


def text_prefix(tokenizer, text: str, full_ids: list[int], max_length: int) -> str | None:
    """A prefix of ``text`` whose encoding starts with the same ``max_length``
    tokens as the whole text's (``full_ids``), so a server that encodes it and
    keeps the first ``max_length`` tokens computes exactly those: starts near
    ``max_length`` tokens' worth of characters and doubles until that holds.
    None if only the whole text does."""
    want = full_ids[:max_length]
    chars = _CHARS_PER_TOKEN * max_length + 64
    while chars < len(text):
        prefix = text[:chars]
        if list(tokenizer.encode(prefix))[:max_length] == want:
            return prefix
        chars *= 2
    return None


def messages_prefix(
    tokenizer, messages: list[dict[str, Any]], full_ids: list[int], max_length: int
) -> list[dict[str, Any]] | None:
    """Like :func:`text_prefix` for a conversation: the messages cut to a
    budget of content characters (later ones dropped) whose rendering starts
    with the same ``max_length`` tokens as the whole conversation's. None if
    none does short of the whole (or a content is not a string)."""
    want = full_ids[:max_length]
    if not all(isinstance(m.get("content"), str) for m in messages):
        return None
    contents: list[str] = [m["content"] for m in messages]
    total = sum(map(len, contents))
    budget = _CHARS_PER_TOKEN * max_length + 64
    while budget < total:
        cut, left = [], budget
        for message, content in zip(messages, contents):
            if left <= 0:
                break
            cut.append({**message, "content": content[:left]})
            left -= len(content)
        try:
            if render_ids(tokenizer, cut)[:max_length] == want:
                return cut
        except Exception:  # noqa: BLE001 - a template that wants the whole conversation
            return None
        budget *= 2
    return None
