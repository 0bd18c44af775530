"""Offline model building and token log-probabilities.

Nothing here downloads anything: the built-in models are random-weight `Qwen2ForCausalLM`s of
a named shape with a byte-level tokenizer, built once into a cache directory. The same
log-probability code serves the trainer (with gradients) and the engine checks (without).

Invariants:
- `build_model(shape, cache_dir)` returns a complete directory or raises: it is built in a
  temporary directory beside the target and renamed into place, so a reader never sees a
  half-written model, and of two concurrent builders one wins and the other's copy is discarded.
- The tokenizer is one token per UTF-8 byte (id = the byte's value) after NFC normalisation, so
  `decode(encode(s)) == unicodedata.normalize("NFC", s)` for any text without a special token's
  string in it (exactly `s` for NFC text, which is nearly all text), with or without
  `skip_special_tokens`. It adds no BOS, and decodes every id the model can sample (its
  vocabulary is padded to the model's; a byte sequence that is not UTF-8 decodes to U+FFFD).
  `AutoTokenizer` loads it as it is built, and `apply_chat_template` renders ChatML.
- `token_logprobs(...)[:, t]` is `log p(input_ids[:, t] | input_ids[:, :t])` in float32 for
  t >= 1 on non-padding positions, and 0 at t = 0 and on padding.
- `pack_sequences`' completion_mask is True exactly on the completion tokens the policy sampled
  (`Completion.mask`; every completion token when the mask is None); environment tokens of a
  multi-turn episode are attended to as context but are never in it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import structlog
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.utils import logging as hf_logging

from pipeline.errors import ConfigError

log = structlog.get_logger(__name__)

# peft 0.21 reads PreTrainedModel.is_gradient_checkpointing, which transformers 5 deprecates with a
# FutureWarning: printed once by the engine and once by the trainer in every run, about nothing
# this project (which never checkpoints activations) can act on.
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)

# Bump when what build_model writes changes, so stale caches are rebuilt rather than reused.
# 2: wider embedding init (learnable); 3: embed_std per shape ("small" was degenerate);
# 4: byte-level tokenizer (the character one lost spaces and non-ASCII once loaded) and a chat template;
# 5: the chat template renders `tools` (Qwen2.5's system block)
FORMAT_VERSION = 5


def _byte_symbols() -> tuple[str, ...]:
    """The symbol `pre_tokenizers.ByteLevel` writes for each byte (GPT-2's map), indexed by byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)}
    others = iter(range(256, 512))  # the other bytes, in order, get code points from 256 up
    return tuple(chr(b) if b in printable else chr(next(others)) for b in range(256))


# Token id b is byte b, so a text's ids are its UTF-8 bytes.
BYTE_SYMBOLS = _byte_symbols()
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
EOS_ID = len(BYTE_SYMBOLS)  # the special tokens follow the bytes
# ChatML, as Qwen2's tokenizers render it (without their default system message). With `tools`,
# Qwen2.5's system block: the tools' JSON schemas between <tools> tags and the <tool_call> format,
# after the conversation's own system message if it has one.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    " + '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_LOAD_LOCK = threading.RLock()


def building_modules() -> threading.RLock:
    """Hold this while constructing modules (from_pretrained, get_peft_model) in a worker thread.

    transformers builds models under a process-wide default-device switch ("meta"), so a module
    constructed in one thread while another thread loads a model can land on the meta device.
    """
    return _LOAD_LOCK

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}



@dataclass(frozen=True)
class Shape:
    """The Qwen2Config fields that differ between the built-in models."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float
    dtype: str  # weights as saved
    vocab_size: int = 0  # 0 = the byte tokenizer's size rounded up to a multiple of 64
    tie_word_embeddings: bool = True
    rms_norm_eps: float = 1e-6
    # Embedding (= output, tied) init std. In a shallow random model the final hidden state leans
    # on the last input token's own embedding, so that token's logit grows with hidden_size *
    # embed_std. Too small and no LoRA update can make any token likely (the policy cannot
    # learn); too large and the model repeats its last token with probability ~1 (0.08 at hidden
    # 256 gave 0.99, so sampling, seeds and learning had nothing to act on). Chosen per shape so
    # the most likely next token of random prompts has a median probability of ~0.2-0.5
    # (measured on the CPU: tiny 0.08 -> 0.47, small 0.05 -> 0.22).
    embed_std: float = 0.08


SHAPES: dict[str, Shape] = {
    # CPU default: a few hundred thousand parameters, so `python run.py` is fast on two cores.
    "tiny": Shape(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=192, max_position_embeddings=512, rope_theta=10000.0, dtype="float32"),
    # head_dim 64, which flash attention kernels support.
    "small": Shape(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=704, max_position_embeddings=2048, rope_theta=10000.0, dtype="float32",
                   embed_std=0.05),
    # Qwen2.5-0.5B's shape, with random weights.
    "qwen2.5-0.5b": Shape(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                          intermediate_size=4864, max_position_embeddings=32768, rope_theta=1_000_000.0,
                          dtype="bfloat16", vocab_size=151936),
    # Qwen2.5-1.5B's shape, with random weights.
    "qwen2.5-1.5b": Shape(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                          intermediate_size=8960, max_position_embeddings=32768, rope_theta=1_000_000.0,
                          dtype="bfloat16", vocab_size=151936),
}


# --------------------------------------------------------------------------- tokenizer


def build_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """A byte-level `PreTrainedTokenizerFast`: one token per UTF-8 byte of the NFC-normalised text.

    Ids 0..255 are the bytes, then `<|endoftext|>` (eos and pad), `<|im_start|>`, `<|im_end|>`;
    with `vocab_size`, `<|extra_N|>` special tokens pad it to exactly that many entries.

    It is built as transformers' `Qwen2Tokenizer` rebuilds it: `AutoTokenizer` loads every
    qwen2 directory through that class, which keeps only the vocabulary, merges and added tokens
    of `tokenizer.json` and imposes its own NFC normaliser, Qwen2 split and byte-level pre-tokenizer
    and decoder. A BPE without merges over the 256 byte symbols gives one token per byte under any
    split, and the NFC here makes the tokenizer built and the tokenizer loaded the same.
    """
    base = len(BYTE_SYMBOLS) + len(SPECIAL_TOKENS)
    if vocab_size is not None and vocab_size < base:
        raise ConfigError(f"tokenizer vocab_size must be >= {base} (bytes + special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE({sym: b for b, sym in enumerate(BYTE_SYMBOLS)}, merges=[]))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # Special tokens are matched in the raw text before normalising and pre-tokenizing, so a
    # rendered chat's <|im_start|> is one id, not 12 bytes.
    extra = [f"<|extra_{i}|>" for i in range((vocab_size or base) - base)]
    tok.add_special_tokens(list(SPECIAL_TOKENS) + extra)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,  # " ." must stay " ." for an exact round trip
        chat_template=CHAT_TEMPLATE,
    )


def batch_decoder(tokenizer: Any, parallel: bool = False) -> Callable[[list[list[int]]], list[str]]:
    """`tokenizer.batch_decode(ids, skip_special_tokens=True)`, through the Rust tokenizer itself
    when that is exactly what it amounts to.

    transformers decodes a batch one sequence at a time through its Python wrapper, holding the
    GIL. Straight to the Rust tokenizer, the same decode costs a fraction of that:
    - `parallel=False`: one Rust decode per sequence on the calling thread, which keeps its
      core. For the event loop: handing a small batch to other threads made the loop wait for
      them to be scheduled (`python run.py`'s lag p99 rose on 2 cores).
    - `parallel=True`: `decode_batch`, in parallel and without the GIL, for a worker thread.
    Taken only for a fast tokenizer whose `_decode` is the base class's (that decode, then an
    optional clean-up) with the clean-up off; any other tokenizer keeps its own `batch_decode`.
    """
    raw = getattr(tokenizer, "_tokenizer", None)
    if not (isinstance(raw, Tokenizer) and isinstance(tokenizer, PreTrainedTokenizerFast)
            and getattr(type(tokenizer), "_decode", None) is PreTrainedTokenizerFast._decode
            and not tokenizer.clean_up_tokenization_spaces):
        return functools.partial(tokenizer.batch_decode, skip_special_tokens=True)
    if parallel:
        return functools.partial(raw.decode_batch, skip_special_tokens=True)
    decode = raw.decode

    def each(ids: list[list[int]]) -> list[str]:
        return [decode(x, skip_special_tokens=True) for x in ids]

    return each


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in a model directory (offline)."""
    _check_model_dir(path)
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)  # tokenizers built offline here


# --------------------------------------------------------------------------- models


def _model_vocab_size(shape: Shape) -> int:
    if shape.vocab_size:
        return shape.vocab_size
    base = len(BYTE_SYMBOLS) + len(SPECIAL_TOKENS)
    return (base + 63) // 64 * 64


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # what transformers and vLLM load weights from


def check_model_dir(path: str | Path, key: str = "model.path") -> None:
    """A model directory worth loading: its config.json a JSON object, and weight files beside it.

    Said before anything loads it, as a ConfigError naming `key`: the engines and the trainer load
    it at once, and which of their own errors surfaced first varied from one run to the next."""
    config = Path(path) / "config.json"
    try:
        conf = json.loads(config.read_text(encoding="utf-8"))
    except OSError as e:  # the preflight saw it exist; unreadable now (permissions, a dangling link)
        raise ConfigError(f"{key}: {str(config)!r} cannot be read: {e}") from None
    except ValueError as e:  # not JSON, or not UTF-8 text
        raise ConfigError(f"{key}: {str(config)!r} is not valid JSON ({e})") from None
    if not isinstance(conf, dict):
        raise ConfigError(f"{key}: {str(config)!r} is not a JSON object")
    if not any(p.suffix in WEIGHT_SUFFIXES and p.is_file() for p in Path(path).iterdir()):
        raise ConfigError(f"{key}: {str(path)!r} holds no weights (no *.safetensors or *.bin file beside its "
                          "config.json)")


def build_model(shape: str, cache_dir: str | Path, seed: int = 0) -> Path:
    """Build (once) a random-weight Qwen2 model of `shape` with its tokenizer; return its directory.

    The directory is `cache_dir/<shape>-v<FORMAT_VERSION>` for seed 0, and
    `cache_dir/<shape>-seed<seed>-v<FORMAT_VERSION>` otherwise (a different seed is a different model).
    """
    if shape not in SHAPES:
        raise ConfigError(f"model.shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    cache_dir = Path(cache_dir)
    name = f"{shape}-v{FORMAT_VERSION}" if seed == 0 else f"{shape}-seed{seed}-v{FORMAT_VERSION}"
    target = cache_dir / name
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_dir))
    try:
        _write_model(SHAPES[shape], tmp, seed)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another builder renamed its copy into place first; theirs is as good as ours.
            if not (target / "config.json").is_file():
                raise
            log.info("model_build_lost_race", shape=shape, path=str(target))
        else:
            log.info("model_built", shape=shape, path=str(target), seed=seed)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def model_config(shape: Shape) -> Qwen2Config:
    """The Qwen2Config of a built-in shape (its tokenizer's eos as bos, eos and pad)."""
    eos = EOS_ID
    return Qwen2Config(
        vocab_size=_model_vocab_size(shape),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings,
        rms_norm_eps=shape.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        hidden_act="silu",
        use_sliding_window=False,
        initializer_range=0.02,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def _write_model(shape: Shape, out: Path, seed: int) -> None:
    config = model_config(shape)
    tokenizer = build_tokenizer(config.vocab_size)
    tokenizer.model_max_length = shape.max_position_embeddings
    eos = tokenizer.eos_token_id
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Initialise from our own seed without disturbing the caller's global RNG state.
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
        with torch.no_grad():
            model.model.embed_tokens.weight.normal_(0.0, shape.embed_std)
    model = model.to(DTYPES[shape.dtype])
    model.config.dtype = shape.dtype
    # Only ids: sampling defaults here would silently become vLLM's defaults ("auto" generation config).
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    with quiet_progress():
        model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """No transformers progress bars for loading and saving: a tiny model is done before one draws."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _check_model_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"model directory {str(p)!r} does not exist")
    if not (p / "config.json").is_file():
        raise ConfigError(f"model directory {str(p)!r} has no config.json")
    return p


def load_causal_lm(path: str | Path, device: str, dtype: str, trust_remote_code: bool = False) -> PreTrainedModel:
    """A causal LM from a local directory, on `device` in `dtype`, in eval mode."""
    p = _check_model_dir(path)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    # from_pretrained builds on the "meta" device through a process-wide default-device switch,
    # so two threads loading at once (engine and trainer start together) corrupt each other.
    with _LOAD_LOCK, quiet_progress():
        model = AutoModelForCausalLM.from_pretrained(str(p), dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    return model.to(device).eval()


# --------------------------------------------------------------------------- log-probabilities


def pack_sequences(
    prompts: list[Sequence[int]], completions: list[Sequence[int]], pad_id: int,
    sampled: Sequence[np.ndarray | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate each prompt with its completion, right-padded.

    sampled: per completion, its `Completion.mask` ([T] bool, True where the policy sampled the
        token) or None (every token sampled); None for the whole argument: every token of every
        completion was sampled (single turns).
    Returns input_ids: [N, L] long, attention_mask: [N, L] long (1 on real tokens: prompt,
    sampled and environment tokens alike, so every one is context) and completion_mask: [N, L]
    bool, True only on the completion tokens the policy sampled (the tokens a loss may weigh).
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if sampled is not None and len(sampled) != len(completions):
        raise ValueError(f"{len(completions)} completions but {len(sampled)} sampled masks")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: its first completion token would have no context")
    n = len(prompts)
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    width = max(lengths, default=0)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    completion_mask = torch.zeros((n, width), dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        seq = list(p) + list(c)
        input_ids[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        attention_mask[i, : len(seq)] = 1
        m = None if sampled is None else sampled[i]
        if m is None:
            completion_mask[i, len(p) : len(seq)] = True
        elif len(m) != len(c):
            raise ValueError(f"completion {i} has {len(c)} tokens but a sampled mask of {len(m)}")
        else:
            completion_mask[i, len(p) : len(seq)] = torch.as_tensor(np.asarray(m, dtype=bool))
    return input_ids, attention_mask, completion_mask


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Log-probability of every token given the ones before it: [N, L] float32, differentiable.

    input_ids: [N, L], attention_mask: [N, L] (right padding). out[:, 0] = 0 and padding gets 0.
    """
    return token_logprobs_and_entropy(model, input_ids, attention_mask, entropy=False)[0]


def token_logprobs_and_entropy(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                               entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs`, and with `entropy` the entropy [N, L] of the model's next-token
    distribution at each position that predicts a token (no gradient; 0 where out is 0).

    The entropy is computed one row at a time, so it costs one [L, V] float32 tensor more than the
    forward pass, never a second [N, L, V] one.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]  # [N, L-1, V]
    logits = logits.float()
    targets = input_ids[:, 1:].unsqueeze(-1)  # [N, L-1, 1]
    # gather - logsumexp: the log-softmax of only the tokens we need, never a second [N, L, V] tensor
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets).squeeze(-1) - lse  # [N, L-1]
    real = attention_mask[:, 1:].bool()
    picked = torch.where(real, picked, torch.zeros_like(picked))
    out = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
    if not entropy:
        return out, None
    with torch.no_grad():
        ent = torch.zeros_like(out)
        for i in range(logits.shape[0]):  # H = logsumexp(z) - sum softmax(z) * z
            row = logits[i].detach()
            ent[i, 1:] = lse[i].detach() - (torch.softmax(row, dim=-1) * row).sum(dim=-1)
        ent[:, 1:] = torch.where(real, ent[:, 1:], torch.zeros_like(ent[:, 1:]))
    return out, ent


def completion_logprobs(
    model: torch.nn.Module,
    prompts: list[Sequence[int]],
    completions: list[Sequence[int]],
    device: str | torch.device,
    batch_size: int = 32,
) -> list[np.ndarray]:
    """Per completion, the float32 log-probs of its tokens under `model` (no gradients)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out: list[np.ndarray] = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            ps = prompts[start : start + batch_size]
            cs = completions[start : start + batch_size]
            ids, mask, _ = pack_sequences(ps, cs, pad_id=0)  # padding is masked: any id serves
            lp = token_logprobs(model, ids.to(device), mask.to(device)).cpu().numpy()
            for i, (p, c) in enumerate(zip(ps, cs)):
                out.append(lp[i, len(p) : len(p) + len(c)].astype(np.float32))
    return out

