"""A number-guessing game: an environment loaded by import path.

    env.factory = "examples/multi_turn/guess.py:GuessNumber"

Each row's number is hidden (`secret`, from the row's "id" when the row has none); the policy
guesses one number per turn and the game answers "higher" or "lower" until it is found. The
reward comes at the end: 1 for finding it, 0.2 less for each extra guess, 0 if the guesses run out.
"""

from __future__ import annotations

import re
import zlib
from typing import Any, Mapping

from pipeline.envs import EnvStep

LOW, HIGH = 1, 20  # the secret is drawn from [LOW, HIGH]
MAX_GUESSES = 4  # the game ends after this many guesses (env.max_turns may end it sooner)
_NUMBER = re.compile(r"-?\d+")


class GuessNumber:
    """Guess the number: a plain-text game, one guess per turn, "higher"/"lower" in between."""

    def __init__(self) -> None:
        self.secret = 0
        self.guesses = 0

    def reset(self, row: Mapping[str, Any]) -> str:
        # a fixed number per row (crc32, not hash(): that changes per process), so a resumed run replays it
        self.secret = int(row.get("secret", LOW + zlib.crc32(str(row["id"]).encode()) % (HIGH - LOW + 1)))
        self.guesses = 0
        return f"Guess my number from {LOW} to {HIGH}. Guess:"

    def step(self, action: str) -> EnvStep:
        self.guesses += 1
        found = _NUMBER.search(action)
        last = self.guesses >= MAX_GUESSES
        if found is None:
            return EnvStep(" no number. Guess:", done=last, info={"valid": False})
        guess = int(found.group())
        if guess == self.secret:
            return EnvStep(None, reward=1.0 - 0.2 * (self.guesses - 1), done=True, info={"found": True})
        hint = "higher" if guess < self.secret else "lower"
        return EnvStep(None if last else f" {hint}. Guess:", done=last, info={"found": False})
