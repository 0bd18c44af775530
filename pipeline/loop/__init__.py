"""The asynchronous loop, in data-flow order: admission, generation (engine rotation, episodes),
scoring, the staleness-bounded buffer, training, versions; evaluation, outcomes, the session and
the runtime around them; `orchestrator.py` wires them into `Pipeline`, `build.py` makes the parts.
"""
