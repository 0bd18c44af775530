"""Refused prompts of one session: counted by reason, logged a few times each, and the verdict
that the prompt source holds nothing usable.

Invariants:
- Every refusal is counted under its reason (`PromptError.reason`); only the first
  LOGGED_PER_REASON of each reason are to be logged, so a data set refused again every epoch
  cannot flood events.jsonl. The counts are logged once at the end of the session.
- `everything_refused` is true once every distinct item of the source (by index) has been
  refused and none has become a prompt. The source cycles its items, so past that point a run
  would only refuse them again, forever.
"""

from __future__ import annotations

from collections import Counter

LOGGED_PER_REASON = 3  # examples of a reason worth reading; beyond them a refusal is only counted


class Refusals:
    """What was refused among the `items` distinct items of a prompt source, and why."""

    def __init__(self, items: int) -> None:
        self.items = items
        self.by_reason: Counter[str] = Counter()
        self.example: dict[str, str] = {}  # reason -> the message of its first refusal
        self.accepted = False  # an item became a prompt: the source is usable
        self._refused: set[int] = set()  # indices of refused items, while none was accepted

    def refuse(self, index: int, reason: str, message: str) -> int:
        """Count item `index` refused for `reason`; how many refusals `reason` has had (log the first
        LOGGED_PER_REASON)."""
        self.by_reason[reason] += 1
        self.example.setdefault(reason, message)
        if not self.accepted:
            self._refused.add(index)
        return self.by_reason[reason]

    def accept(self) -> None:
        """An item became a prompt."""
        self.accepted = True
        self._refused.clear()

    @property
    def everything_refused(self) -> bool:
        return not self.accepted and len(self._refused) >= self.items

    def describe(self) -> str:
        """The reasons with their counts and an example each, most frequent first."""
        return "; ".join(f"{reason}: {n} (e.g. {self.example[reason]})" for reason, n in self.by_reason.most_common())
