"""The engines that sample groups: vLLM in this process (`vllm.py`), vLLM servers over HTTP
(`vllm_server.py`, launched by `vllm_launch.py` under `serve_guard.py`), transformers
(`transformers.py`) and the simulated engine (`simulated.py`); `base.py` the shared contract checks,
`residency.py` which versions an engine holds, `decoding.py` and `full_weights.py` the pieces they share.
Nothing here imports the loop.
"""
