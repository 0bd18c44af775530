"""The built-in models: random-weight Qwen2 shapes with a byte-level tokenizer, built offline and
cached (`builtin.py`, also token log-probabilities), and the warm start that fine-tunes one on a
task until it is partly competent (`warm_start.py`).
"""
