"""A data-source item as a validated Prompt: its text (chat-templated where it is a conversation),
token ids and the columns that reach the reward.

An item is a `Prompt`, a string, or a row (dict) with the prompt under `prompt_field` (a string or
a list of `{"role", "content"}` messages) or with `token_ids`; an optional `id`; every other
column is kept as `Prompt.meta` and reaches the reward functions as keyword arguments.

Invariants:
- A message list is rendered with the chat template and its generation prompt, then tokenized
  without added special tokens (the template writes its own); a string is taken as it is unless
  `apply_chat_template`, when it becomes one user message. `Prompt.text` is what the model sees.
- `tools` (an environment's tool schemas) go to the template as its `tools`, as TRL and
  verifiers pass them: a prompt with tools is always a conversation (a string becomes one user
  message), since only a template can show them.
- `build` returns a Prompt or raises `PromptError` whose `reason` is one of REASONS, with a
  message naming the row; it never lets a tokenizer's or template's own exception escape.

An environment's observation in a multi-turn episode becomes tokens appended after the policy's
sampled ones (`render_observation`), so the policy's tokens are never tokenized again: in chat,
prompt + turn + reply tokens are the template's rendering of the whole conversation, token for
token, where the turn ends with the template's end-of-turn token (`end_of_turn_token`).
"""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any, Mapping

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

    def build(self, item: Any, tools: list[dict[str, Any]] | None = None) -> Prompt:
        """`item` as a Prompt, with `tools` (JSON schemas) shown by the chat template; PromptError
        (with its reason) if it cannot be one."""
        prompt = item if isinstance(item, Prompt) else self._from_item(item, tools)
        if not prompt.token_ids:
            raise _refuse("empty", f"prompt {prompt.id!r} is empty")
        need = len(prompt.token_ids) + self.max_new_tokens
        if self.max_context is not None and need > self.max_context:
            raise _refuse("too_long", f"prompt {prompt.id!r} has {len(prompt.token_ids)} tokens; with max_new_tokens "
                                      f"{self.max_new_tokens} it exceeds the context of {self.max_context}")
        return prompt

    def _from_item(self, item: Any, tools: list[dict[str, Any]] | None) -> Prompt:
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
        if isinstance(raw, str) and not (self.apply_chat_template or tools):
            text = raw
        elif isinstance(raw, str) or isinstance(raw, list):
            text = self._render(pid, self._messages(pid, raw), tools)
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

    def _render(self, pid: str, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None) -> str:
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
                                           add_generation_prompt=True, tools=tools or None)
        except Exception as e:  # a template that fails on this row (jinja raises its own types): the row is refused
            raise _refuse("template_error", f"prompt {pid!r}: the chat template failed: "
                                            f"{type(e).__name__}: {e}") from None
        if not isinstance(text, str):
            raise _refuse("template_error", f"prompt {pid!r}: the chat template rendered {type(text).__name__}, "
                                            "not text")
        return text


# The dummy assistant turn's content: found again in the rendering, so what the template writes
# after it (the end of the turn, the observation, the next generation prompt) can be cut out.
_TURN_MARK = "PIPELINEASSISTANTTURN"


def _observation_messages(observation: Any) -> list[dict[str, Any]]:
    """A string as one user message, a message as a list of one; PromptError if it is not messages."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    messages = [observation] if isinstance(observation, Mapping) else observation
    if not isinstance(messages, (list, tuple)) or not messages or not all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise _refuse("malformed", f"an observation must be a string or {{role, content}} messages, "
                                   f"got {str(observation)[:60]!r}")
    return [dict(m) for m in messages]


def _render_turn(tokenizer: Any, chat_template: str | None, after: list[dict[str, Any]],
                 generation_prompt: bool, tools: list[dict[str, Any]] | None = None) -> str:
    """The template's text after the dummy assistant turn's content, when `after` follows it."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise _refuse("no_chat_template", f"the tokenizer ({type(tokenizer).__name__}) has no chat template to "
                                          "render an observation with; set data.chat_template to a jinja file")
    conversation = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _TURN_MARK}, *after]
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                             add_generation_prompt=generation_prompt, tools=tools or None)
    except Exception as e:  # a template that cannot render this observation (jinja raises its own types)
        raise _refuse("template_error",
                      f"the chat template failed on an observation: {type(e).__name__}: {e}") from None
    if not isinstance(text, str) or text.count(_TURN_MARK) != 1:
        raise _refuse("template_error", "the chat template does not render an assistant turn's content once, "
                                        "as it is; observations cannot be appended to its turns")
    return text.partition(_TURN_MARK)[2]


def _special_ids(tokenizer: Any) -> set[int]:
    return set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}


def end_of_turn_token(tokenizer: Any, chat_template: str | None = None) -> int | None:
    """The special token that closes an assistant turn in the chat template (ChatML: <|im_end|>),
    None if the template closes turns with plain text. A chat policy's turn should stop at it."""
    close = tokenizer(_render_turn(tokenizer, chat_template, [], False), add_special_tokens=False)["input_ids"]
    return close[0] if close and close[0] in _special_ids(tokenizer) else None


def render_observation(tokenizer: Any, observation: Any, *, chat: bool, chat_template: str | None = None,
                       turn_ended: bool = True, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The token ids to append after a policy turn's sampled tokens: the environment's observation
    and, in chat, the template's text that frames it, up to the next assistant turn's start.

    chat=False: the observation's text (of a message list, the contents joined) tokenized as it is.
    chat=True: the observation as messages (a string is one user message; "tool" messages keep
    their role) rendered by the template after an assistant turn, with the generation prompt:
    what follows the turn's end-of-turn token (ChatML: "\n<|im_start|>tool\n...<|im_end|>\n
    <|im_start|>assistant\n"). `turn_ended=False` (the turn was cut at max_new_tokens, so no
    end-of-turn token was sampled): the end-of-turn token comes first. A template that ends
    turns without a special token writes its closing text in either case. `tools`: the
    conversation's tool schemas, given to the template as the prompt's were.

    Tokenized without added special tokens. PromptError (reason "malformed", "no_chat_template"
    or "template_error") when the observation or the template cannot make one.
    """
    messages = _observation_messages(observation)
    if not chat:
        text = "".join(m["content"] for m in messages)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
    tail = _render_turn(tokenizer, chat_template, messages, True, tools)
    ids = list(tokenizer(tail, add_special_tokens=False)["input_ids"])
    if turn_ended and ids and ids[0] == end_of_turn_token(tokenizer, chat_template):
        ids = ids[1:]
    return ids
