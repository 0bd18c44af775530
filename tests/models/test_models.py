"""Tests for pipeline.models.builtin: offline tokenizer and models, token log-probabilities."""

from __future__ import annotations

import os
import threading
import time
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from pipeline.models import builtin as models
from pipeline.errors import ConfigError
from pipeline.data.tasks import char_class_task

TEXTS = [
    "hello world",
    "a . b , c ! ? don't  two  spaces",
    "line one\nline two\n\n\tindented\r\n",
    " leading and trailing ",
    "".join(chr(c) for c in range(128)),
    "caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001f600 \u0000 \ufffd",
]
VOCAB = 320  # the tiny model's: 256 bytes + 3 special tokens, rounded up to a multiple of 64


@pytest.fixture(scope="module")
def tiny_model(model_dir: Path) -> torch.nn.Module:
    return models.load_causal_lm(model_dir, "cpu", "float32")


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> PreTrainedTokenizerBase:
    """The tokenizer as the pipeline loads it (orchestrator `_setup`)."""
    return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)


@pytest.fixture(scope="module")
def built() -> PreTrainedTokenizerBase:
    """The tokenizer build_model saves, before saving."""
    return models.build_tokenizer(VOCAB)


def test_tokenizer_is_one_token_per_byte_and_adds_no_bos() -> None:
    tok = models.build_tokenizer()
    assert set(models.BYTE_SYMBOLS) == set(pre_tokenizers.ByteLevel.alphabet())
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))  # token id = byte, and no BOS
        assert tok.decode(ids) == text
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == models.EOS_ID == 256
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [257, 258]
    assert tok.bos_token_id is None


# Any text: st.text() draws from all of unicode but surrogates; it rarely draws one that NFC
# changes, so the examples hold some (a decomposed accent, the Angstrom sign, a CJK compatibility ideograph).
@settings(max_examples=300, deadline=None)
@given(text=st.text())
@example(text="cafe\u0301 \u212b \uf900")
def test_loaded_tokenizer_round_trips_any_text_as_the_pipeline_encodes_and_decodes(
        loaded: PreTrainedTokenizerBase, built: PreTrainedTokenizerBase, text: str) -> None:
    # A special token's string in the text is that token (as in a rendered chat), and
    # skip_special_tokens drops it: the round trip is for text without one.
    assume(not any(t in text for t in loaded.get_added_vocab()))
    nfc = unicodedata.normalize("NFC", text)  # transformers' Qwen2Tokenizer normalises; see build_tokenizer
    ids = loaded(text, add_special_tokens=False)["input_ids"]  # as orchestrator encodes prompts
    assert ids == list(nfc.encode("utf-8"))
    assert built(text, add_special_tokens=False)["input_ids"] == ids
    assert loaded.decode(ids, skip_special_tokens=True) == nfc
    assert models.batch_decoder(loaded)([ids, []]) == [nfc, ""]  # the pipeline's fast paths
    assert models.batch_decoder(loaded, parallel=True)([ids])[0] == nfc
    if nfc == text:
        assert loaded.decode(ids) == text


def test_default_task_prompts_round_trip_with_their_spaces(loaded: PreTrainedTokenizerBase) -> None:
    prompts = ["What is 2+0? Answer:"] + [p["prompt"] for p in char_class_task(4, seed=0, max_new_tokens=16).prompts]
    assert " " in prompts[1]  # "<noise> digits:"
    decode = models.batch_decoder(loaded)
    for text in prompts:
        ids = loaded(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text)  # ASCII: one token per character, spaces included
        assert loaded.decode(ids, skip_special_tokens=True) == decode([ids])[0] == text


def test_loaded_tokenizer_renders_chatml_with_single_special_tokens(loaded: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+0? Answer:"}]
    text = loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+0? Answer:<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert loaded.apply_chat_template(messages, tokenize=False) == text.removesuffix("<|im_start|>assistant\n")
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    start, end = loaded.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert (ids.count(start), ids.count(end)) == (3, 2)
    assert all(i < 256 for i in ids if i not in (start, end))  # no partly matched special token
    assert ids[:1 + len("system\n")] == [start, *b"system\n"]
    assert loaded.decode(ids) == text
    assert loaded.decode(ids, skip_special_tokens=True) == "system\nBe brief.\nuser\nWhat is 2+0? Answer:\nassistant\n"


def test_tokenizer_pads_to_vocab_size_and_every_id_decodes(loaded: PreTrainedTokenizerBase) -> None:
    tok = models.build_tokenizer(vocab_size=VOCAB)
    for t in (tok, loaded):
        assert len(t) == VOCAB
        assert t.decode([VOCAB - 1]) == "<|extra_60|>"
        assert all(isinstance(t.decode([i]), str) for i in range(VOCAB))
        # the special and padding tokens decode to nothing; bytes that are not UTF-8 to U+FFFD
        assert t.decode(list(range(VOCAB)), skip_special_tokens=True) == t.decode(list(range(256)))
        assert t.decode(list(range(128)), skip_special_tokens=True) == "".join(chr(c) for c in range(128))
        assert t.decode([0xE6, 0x97]) == "\ufffd"  # a cut-off character (the model may sample one)
    with pytest.raises(ConfigError, match="vocab_size"):
        models.build_tokenizer(vocab_size=258)


def test_autotokenizer_loads_the_saved_tokenizer_offline(tmp_path: Path) -> None:
    models.build_tokenizer().save_pretrained(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    for text in TEXTS:
        assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token_id == tok.pad_token_id == models.EOS_ID


class NoBatchDecode(type(models.build_tokenizer())):
    """A fast tokenizer whose own batch_decode must not be called (the fast path bypasses it)."""

    def batch_decode(self, *a, **kw):
        raise AssertionError("batch_decode called")


def test_batch_decoder_decodes_in_rust_what_batch_decode_would(tmp_path: Path, loaded: PreTrainedTokenizerBase) -> None:
    tok = models.build_tokenizer(vocab_size=VOCAB)
    tok.save_pretrained(str(tmp_path))
    alone = AutoTokenizer.from_pretrained(str(tmp_path))  # no config.json beside it: loaded as saved
    rng = np.random.default_rng(0)
    # bytes (valid UTF-8 or not), special tokens (skipped) and the padding tokens, in sequences of mixed length
    ids = [rng.integers(0, VOCAB, size=int(rng.integers(0, 40))).tolist() for _ in range(64)]
    ids += [[], [models.EOS_ID, 1, models.EOS_ID + 1], list("héllo wörld".encode())]
    fast = NoBatchDecode(tokenizer_object=tok._tokenizer, eos_token=models.EOS_TOKEN, clean_up_tokenization_spaces=False)
    for t in (tok, alone, loaded, fast):
        for parallel in (False, True):
            assert models.batch_decoder(t, parallel)(ids) == tok.batch_decode(ids, skip_special_tokens=True)
    assert models.batch_decoder(loaded)(ids[-1:]) == ["héllo wörld"]


def test_batch_decoder_keeps_batch_decode_when_the_rust_decode_is_not_all_of_it() -> None:
    tok = models.build_tokenizer()
    cleaning = NoBatchDecode(tokenizer_object=tok._tokenizer, eos_token=models.EOS_TOKEN,
                             clean_up_tokenization_spaces=True)  # the clean-up is Python's

    class OwnDecode(NoBatchDecode):
        def _decode(self, token_ids, **kw):
            return "own"

    own = OwnDecode(tokenizer_object=tok._tokenizer, eos_token=models.EOS_TOKEN, clean_up_tokenization_spaces=False)

    class NotHF:
        def batch_decode(self, ids, skip_special_tokens=False):
            return [f"{len(x)}:{skip_special_tokens}" for x in ids]

    for t in (cleaning, own):
        for parallel in (False, True):
            with pytest.raises(AssertionError, match="batch_decode called"):
                models.batch_decoder(t, parallel)([[1, 2]])
    assert models.batch_decoder(NotHF())([[1, 2], []]) == ["2:True", "0:True"]


def test_build_model_tiny_builds_once_and_loads(tmp_path: Path) -> None:
    path = models.build_model("tiny", tmp_path)
    assert path == tmp_path / f"tiny-v{models.FORMAT_VERSION}"
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (path / f).is_file(), f
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    t0 = time.monotonic()
    assert models.build_model("tiny", tmp_path) == path
    assert time.monotonic() - t0 < 0.5
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp dirs left

    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    assert cfg.intermediate_size == 192 and cfg.max_position_embeddings == 512
    assert cfg.vocab_size == VOCAB and cfg.vocab_size % 64 == 0
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert model.dtype == torch.float32
    tok = models.load_tokenizer(path)
    assert len(tok) == cfg.vocab_size  # every id the model can sample decodes
    assert cfg.eos_token_id == tok.eos_token_id


def test_build_model_is_deterministic_per_seed(tmp_path: Path, tiny_model: torch.nn.Module) -> None:
    again = models.load_causal_lm(models.build_model("tiny", tmp_path / "a"), "cpu", "float32")
    other_dir = models.build_model("tiny", tmp_path / "a", seed=1)
    assert other_dir.name == f"tiny-seed1-v{models.FORMAT_VERSION}"
    other = models.load_causal_lm(other_dir, "cpu", "float32")
    w0 = tiny_model.model.embed_tokens.weight
    assert torch.equal(again.model.embed_tokens.weight, w0)
    assert not torch.equal(other.model.embed_tokens.weight, w0)


def test_concurrent_builders_leave_one_complete_model(tmp_path: Path) -> None:
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(models.build_model("tiny", tmp_path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(set(results)) == 1
    assert os.listdir(tmp_path) == [results[0].name]
    models.load_causal_lm(results[0], "cpu", "float32")


@pytest.mark.parametrize(("shape", "parameters"), [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-1.5b", 1_543_714_304)])
def test_the_shapes_named_for_qwen_models_have_their_parameter_counts(shape: str, parameters: int) -> None:
    # Qwen2.5-0.5B's and 1.5B's published sizes (tied embeddings), counted without building weights
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(models.model_config(models.SHAPES[shape]))
    assert sum(p.numel() for p in model.parameters()) == parameters


def test_model_shape_takes_every_built_in_shape() -> None:
    from pipeline.config.io import load_config

    for shape in models.SHAPES:
        assert load_config(None, {"model.shape": shape}).model.shape == shape


def test_build_model_refuses_unknown_shape(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="huge"):
        models.build_model("huge", tmp_path)


def test_load_causal_lm_names_a_bad_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=str(missing)):
        models.load_causal_lm(missing, "cpu", "float32")
    with pytest.raises(ConfigError, match="config.json"):
        models.load_causal_lm(tmp_path, "cpu", "float32")
    with pytest.raises(ConfigError, match=str(tmp_path)):
        models.load_tokenizer(tmp_path)


def test_pack_sequences_right_pads_and_marks_completions() -> None:
    ids, mask, comp = models.pack_sequences([[1, 2, 3], [4]], [[5, 6], [7, 8, 9, 10]], pad_id=0)
    assert ids.shape == mask.shape == comp.shape == (2, 5)
    assert ids.dtype == mask.dtype == torch.long and comp.dtype == torch.bool
    assert ids.tolist() == [[1, 2, 3, 5, 6], [4, 7, 8, 9, 10]]
    ids, mask, comp = models.pack_sequences([[1, 2, 3], [4]], [[5], [7, 8]], pad_id=99)
    assert ids.tolist() == [[1, 2, 3, 5], [4, 7, 8, 99]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert comp.tolist() == [[False, False, False, True], [False, True, True, False]]
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        models.pack_sequences([[]], [[1]], pad_id=0)


def test_pack_sequences_marks_only_sampled_tokens_and_attends_to_all() -> None:
    """Environment tokens (mask False) are context (attended) but never in the completion mask."""
    prompts, completions = [[1, 2], [3], [4, 5]], [[6, 7, 8, 9], [10, 11], [12]]
    sampled = [np.array([True, False, False, True]), None, np.array([0], dtype=np.uint8)]
    ids, attn, comp = models.pack_sequences(prompts, completions, pad_id=0, sampled=sampled)
    assert ids.tolist() == [[1, 2, 6, 7, 8, 9], [3, 10, 11, 0, 0, 0], [4, 5, 12, 0, 0, 0]]
    assert attn.tolist() == [[1] * 6, [1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0]]
    assert comp.tolist() == [[False, False, True, False, False, True], [False, True, True, False, False, False],
                             [False] * 6]
    # all-True masks and no masks pack alike (single turns)
    plain = models.pack_sequences(prompts, completions, pad_id=0)
    every = models.pack_sequences(prompts, completions, pad_id=0,
                                  sampled=[np.ones(len(c), dtype=bool) for c in completions])
    assert all(torch.equal(a, b) for a, b in zip(plain, every))
    with pytest.raises(ValueError, match="completion 1 has 2 tokens but a sampled mask of 3"):
        models.pack_sequences(prompts, completions, pad_id=0, sampled=[None, np.ones(3, bool), None])
    with pytest.raises(ValueError, match="3 completions but 2 sampled masks"):
        models.pack_sequences(prompts, completions, pad_id=0, sampled=[None, None])


def _manual_logprobs(model: torch.nn.Module, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0].double()
    lp = logits.log_softmax(-1)
    return torch.tensor([0.0] + [float(lp[t - 1, seq[t]]) for t in range(1, len(seq))])


def test_token_logprobs_match_per_sequence_computation_and_are_differentiable(tiny_model: torch.nn.Module) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 98, size=k).tolist() for k in (3, 7, 1)]
    completions = [rng.integers(0, 128, size=k).tolist() for k in (6, 2, 9)]
    ids, mask, comp = models.pack_sequences(prompts, completions, pad_id=98)
    out = models.token_logprobs(tiny_model, ids, mask)
    assert out.shape == ids.shape and out.dtype == torch.float32
    for i, (p, c) in enumerate(zip(prompts, completions)):
        want = _manual_logprobs(tiny_model, p + c)
        n = len(p) + len(c)
        assert torch.allclose(out[i, :n].double(), want.double(), atol=1e-5), i
        assert torch.all(out[i, n:] == 0)  # padding
    assert torch.all(out[:, 0] == 0)
    assert torch.all(out[mask.bool()][1:] <= 0)

    tiny_model.zero_grad()
    (out * comp).sum().backward()
    grad = tiny_model.model.embed_tokens.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    tiny_model.zero_grad()


def test_completion_logprobs_returns_each_completions_tokens(tiny_model: torch.nn.Module) -> None:
    prompts = [[10, 11, 12], [20], [30, 31]]
    completions = [[1, 2, 3, 4], [5], []]
    got = models.completion_logprobs(tiny_model, prompts, completions, "cpu", batch_size=2)
    assert [len(g) for g in got] == [4, 1, 0]
    assert all(g.dtype == np.float32 for g in got)
    for p, c, g in zip(prompts, completions, got):
        want = _manual_logprobs(tiny_model, p + c)[len(p):].numpy()
        np.testing.assert_allclose(g, want, atol=1e-5)
