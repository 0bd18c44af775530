"""What a run shows: structured logs (`log.py`), per-step metrics (`metrics.py`), the step rows
and summary (`reporting.py`), trackers (`trackers.py`) and report.png (`plots.py`).
"""
