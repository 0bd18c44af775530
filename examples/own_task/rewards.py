"""Rewards for the single-digit sums, in TRL's signature: `fn(prompts, completions, **columns)`.

`completions[i]` is the text sampled for `prompts[i]` (the prompt as the model saw it, after any
chat template); `answer` is the data set's column of that name, one entry per completion.
"""


def correct(prompts, completions, answer, **kwargs):
    """1 when the completion, stripped of leading spaces, starts with the right sum."""
    return [1.0 if text.lstrip().startswith(a) else 0.0 for text, a in zip(completions, answer)]


def digits(prompts, completions, **kwargs):
    """The share of the completion's characters that are digits: the answer's format."""
    return [sum(ch.isdigit() for ch in text) / max(1, len(text)) for text in completions]
