"""The policy's learner, in the order a step uses it: a batch as rows (`rows.py`), the loss family
(`loss.py`), the one trainer (`policy.py`: `PolicyTrainer`) with its update strategy, LoRA or
full weights (`update.py`), the older versions it keeps (`snapshots.py`) and its saved state
(`state.py`); FSDP2 applied to its model (`fsdp.py`) with the collectives of its ranks passed in
(`collectives.py`); its own process (`process.py`, `log_shipping.py`) and its ranks' start-up,
channels and watch (`ranks.py`). `simulated.py` is a trainer that only waits. Nothing here
imports the loop.
"""
