"""Durable state on disk: the group ledger (`ledger.py`), the zarr rollout log (`rollout_log.py`),
policy versions on a shared filesystem (`weights.py`), checkpoints (`checkpoint.py`) and fsynced
writes (`durable.py`). Nothing here imports anything but the base vocabulary and itself.
"""
