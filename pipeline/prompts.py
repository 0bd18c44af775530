"""A data-source item as a validated Prompt: its text (chat-templated where it is a conversation),
token ids and the columns that reach the reward.

An item is a `Prompt`, a string, or a row (dict) with the prompt under `prompt_field` (a string or
a list of `{"role", "content"}` messages) or with `token_ids`; an optional `id`; every other
column is kept as `Prompt.meta` and reaches the reward functions as keyword arguments.

Invariants:
- A message list is rendered with the chat template and its generation prompt, then tokenized
  without added special tokens (the template writes its own); a string is taken as it is unless
  `apply_chat_template`, when it becomes one user message. `Prompt.text` is what the model sees.
- `build` returns a Prompt or raises `PromptError` whose `reason` is one of REASONS, with a
  message naming the row; it never lets a tokenizer's or template's own exception escape.
"""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, PromptError
from pipeline.types import Prompt

REASONS = ("malformed", "empty", "too_long", "no_chat_template", "template_error")


def _refuse(reason: str, message: str) -> PromptError:
    return PromptError(message, reason=reason)


def read_chat_template(path: str) -> str:
    """The jinja text of data.chat_template (ConfigError naming the file if it cannot be read)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:  # bad input: said with the key, exit 2
        raise ConfigError(f"data.chat_template = {path!r} cannot be read: {e}") from None


class PromptBuilder:
    """Turns items into Prompts for one tokenizer, chat template and context length."""

    def __init__(self, tokenizer: Any, *, max_new_tokens: int, max_context: int | None = None,
                 prompt_field: str = "prompt", apply_chat_template: bool = False, chat_template: str | None = None,
                 system_prompt: str = "") -> None:
        self.tokenizer = tokenizer  # None: items must carry token_ids
        self.max_new_tokens = max_new_tokens
        self.max_context = max_context
        self.prompt_field = prompt_field
        self.apply_chat_template = apply_chat_template
        self.chat_template = chat_template  # overrides the tokenizer's own
        self.system_prompt = system_prompt

    def build(self, item: Any) -> Prompt:
        """`item` as a Prompt; PromptError (with its reason) if it cannot be one."""
        prompt = item if isinstance(item, Prompt) else self._from_item(item)
        if not prompt.token_ids:
            raise _refuse("empty", f"prompt {prompt.id!r} is empty")
        need = len(prompt.token_ids) + self.max_new_tokens
        if self.max_context is not None and need > self.max_context:
            raise _refuse("too_long", f"prompt {prompt.id!r} has {len(prompt.token_ids)} tokens; with max_new_tokens "
                                      f"{self.max_new_tokens} it exceeds the context of {self.max_context}")
        return prompt

    def _from_item(self, item: Any) -> Prompt:
        field = self.prompt_field
        if isinstance(item, str):
            item = {field: item}
        if not isinstance(item, dict) or not (field in item or "token_ids" in item):
            raise _refuse("malformed", f"a prompt must be a Prompt, a string or a row with {field!r}, "
                                       f"got {str(item)[:60]!r}")
        raw = item.get(field, "")
        pid = str(item.get("id", raw if isinstance(raw, str) else ""))
        meta = {k: v for k, v in item.items() if k not in (field, "id", "token_ids")}
        ids = item.get("token_ids")
        if isinstance(raw, str) and not self.apply_chat_template:
            text = raw
        elif isinstance(raw, str) or isinstance(raw, list):
            text = self._render(pid, self._messages(pid, raw))
        else:
            raise _refuse("malformed", f"prompt {pid!r}: {field!r} must be a string or a list of "
                                       f"{{role, content}} messages, got {type(raw).__name__}")
        if ids is None:
            if self.tokenizer is None:
                raise _refuse("malformed", f"prompt {pid!r} has no token_ids and the pipeline has no tokenizer")
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        try:
            # plain ints: numpy ids (a numpy or pandas data set) are refused by vLLM's serialiser
            ids = tuple(map(operator.index, ids))
        except TypeError:
            raise _refuse("malformed", f"prompt {pid!r}: token_ids must be integers, got "
                                       f"{str(list(ids)[:8])[:60]}") from None
        return Prompt(id=pid, text=text, token_ids=ids, meta=meta)

    def _messages(self, pid: str, raw: str | list[Any]) -> list[dict[str, str]]:
        """The conversation to render: the row's messages (checked), the system prompt first."""
        if isinstance(raw, str):
            messages = [{"role": "user", "content": raw}]
        else:
            if not raw:
                raise _refuse("empty", f"prompt {pid!r} is an empty list of messages")
            for j, m in enumerate(raw):
                if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                    raise _refuse("malformed", f"prompt {pid!r}: message {j} must be a {{role, content}} table of "
                                               f"strings, got {str(m)[:60]!r}")
            messages = [{"role": m["role"], "content": m["content"]} for m in raw]
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def _render(self, pid: str, messages: list[dict[str, str]]) -> str:
        tok = self.tokenizer
        if tok is None:
            raise _refuse("malformed", f"prompt {pid!r} is a conversation and the pipeline has no tokenizer")
        template = self.chat_template or getattr(tok, "chat_template", None)
        if not template:
            raise _refuse("no_chat_template", f"prompt {pid!r} is a list of messages but the tokenizer "
                                              f"({type(tok).__name__}) has no chat template; set data.chat_template "
                                              "to a jinja file")
        try:
            text = tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                           add_generation_prompt=True)
        except Exception as e:  # a template that fails on this row (jinja raises its own types): the row is refused
            raise _refuse("template_error", f"prompt {pid!r}: the chat template failed: "
                                            f"{type(e).__name__}: {e}") from None
        if not isinstance(text, str):
            raise _refuse("template_error", f"prompt {pid!r}: the chat template rendered {type(text).__name__}, "
                                            "not text")
        return text
