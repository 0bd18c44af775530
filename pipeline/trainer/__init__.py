"""The policy's learner: the step (`policy.py`), the loss family (`loss.py`), its saved state
(`state.py`), its own process (`process.py`, `log_shipping.py`) and FSDP2 ranks (`ranks.py`
starts and watches them, `fsdp.py` runs in each). Nothing here imports the loop.
"""
