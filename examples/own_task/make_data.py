"""Writes train.jsonl and eval.jsonl: single-digit sums, as plain prompts and as chat messages.

    python examples/own_task/make_data.py

Each row has a `prompt` (a string, or a list of {role, content} messages that the pipeline renders
with the tokenizer's chat template) and an `answer` column, which reaches the reward functions
as the keyword argument `answer`. Sums whose first term is 3 or 7 are held out for evaluation.
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def row(a: int, b: int, chat: bool) -> dict:
    question = f"What is {a}+{b}?"
    prompt = [{"role": "user", "content": question}] if chat else f"{question} Answer:"
    return {"id": f"{a}+{b}{'-chat' if chat else ''}", "prompt": prompt, "answer": str(a + b)}


def main() -> None:
    pairs = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]
    rows = [row(a, b, chat) for a, b in pairs for chat in (False, True)]
    random.Random(0).shuffle(rows)
    splits = {"train": [r for r in rows if not r["id"].startswith(("3+", "7+"))],
              "eval": [r for r in rows if r["id"].startswith(("3+", "7+"))]}
    for name, part in splits.items():
        with open(HERE / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        print(f"{name}.jsonl: {len(part)} rows")


if __name__ == "__main__":
    main()
