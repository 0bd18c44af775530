"""What a run learns from: prompt files (`files.py`), the built-in tasks (`tasks.py`), prompts made
from items (`prompts.py`), refused prompts (`refusals.py`) and reward functions (`rewards.py`).
"""
