"""Rows become Prompts: raw strings stay raw, conversations go through the chat template, and a row
that cannot become a prompt is refused on its own with a reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.errors import ConfigError, PromptError
from pipeline.models.builtin import build_tokenizer
from pipeline.data.prompts import PromptBuilder, read_chat_template
from pipeline.types import Prompt

TOK = build_tokenizer()
MESSAGES = [{"role": "user", "content": "What is 2+3?"}]


def builder(**kw) -> PromptBuilder:
    return PromptBuilder(kw.pop("tokenizer", TOK), max_new_tokens=kw.pop("max_new_tokens", 4), **kw)


def test_a_string_prompt_stays_raw_and_extra_columns_become_reward_kwargs() -> None:
    p = builder().build({"id": 7, "prompt": "What is 2+3? Answer:", "answer": "5", "level": 1})
    assert p.text == "What is 2+3? Answer:" and p.id == "7"
    assert list(p.token_ids) == TOK("What is 2+3? Answer:", add_special_tokens=False)["input_ids"]
    assert dict(p.meta) == {"answer": "5", "level": 1}


def test_messages_are_rendered_with_the_chat_template_and_its_generation_prompt() -> None:
    p = builder().build({"prompt": MESSAGES, "answer": "5"})
    expected = TOK.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert p.text == expected and p.text.endswith("<|im_start|>assistant\n")
    assert list(p.token_ids) == TOK(expected, add_special_tokens=False)["input_ids"]
    assert TOK.convert_tokens_to_ids("<|im_start|>") in p.token_ids  # a special token, not its characters


def test_system_prompt_goes_first_unless_the_row_has_one() -> None:
    b = builder(system_prompt="Be brief.")
    assert b.build({"prompt": MESSAGES}).text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user")
    own = [{"role": "system", "content": "Mine."}, *MESSAGES]
    assert "Be brief." not in b.build({"prompt": own}).text
    assert b.build({"prompt": "raw"}).text == "raw"  # a raw string has no conversation to put it in


def test_apply_chat_template_turns_a_string_into_one_user_message() -> None:
    p = builder(apply_chat_template=True).build({"prompt": "What is 2+3?"})
    assert p.text == TOK.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def test_a_chat_template_file_replaces_the_tokenizers(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant] {% endif %}")
    p = builder(chat_template=read_chat_template(str(path))).build({"prompt": MESSAGES})
    assert p.text == "[user] What is 2+3?\n[assistant] "
    with pytest.raises(ConfigError, match="data.chat_template"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_a_tokenizer_without_a_template_refuses_messages_by_name() -> None:
    bare = build_tokenizer()
    bare.chat_template = None
    with pytest.raises(PromptError, match="has no chat template; set data.chat_template") as e:
        builder(tokenizer=bare).build({"id": "q1", "prompt": MESSAGES})
    assert e.value.reason == "no_chat_template" and "'q1'" in str(e.value)
    assert builder(tokenizer=bare).build({"prompt": "raw"}).text == "raw"  # strings need no template


@pytest.mark.parametrize("row, reason", [
    ({"question": "no prompt column"}, "malformed"),
    ({"prompt": 3}, "malformed"),
    ({"prompt": [{"role": "user"}]}, "malformed"),
    ({"prompt": [{"role": "user", "content": 5}]}, "malformed"),
    ({"prompt": []}, "empty"),
    ({"prompt": ""}, "empty"),
    ({"prompt": "x" * 600}, "too_long"),
    ({"prompt": "ok", "token_ids": ["a"]}, "malformed"),
    ("", "empty"),
])
def test_a_bad_row_is_refused_with_its_reason(row, reason) -> None:
    with pytest.raises(PromptError) as e:
        builder(max_context=512).build(row)
    assert e.value.reason == reason


def test_a_template_that_fails_on_a_row_refuses_that_row(tmp_path: Path) -> None:
    b = builder(chat_template="{{ raise_exception('no system role here') if messages[0]['role'] == 'system' }}x")
    assert b.build({"prompt": MESSAGES}).text == "x"
    with pytest.raises(PromptError, match="the chat template failed") as e:
        b.build({"prompt": [{"role": "system", "content": "s"}, *MESSAGES]})
    assert e.value.reason == "template_error"


def test_prompt_field_names_the_column_and_prompts_pass_through() -> None:
    p = builder(prompt_field="question").build({"question": "Q?", "prompt": "kept as a column"})
    assert p.text == "Q?" and p.meta == {"prompt": "kept as a column"}
    ready = Prompt("x", "t", (1, 2))
    assert builder().build(ready) is ready
