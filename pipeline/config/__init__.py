"""The run's configuration: the schema (`schema.py`, frozen dataclasses and their checks) and its
files (`io.py`: TOML, `--set` overrides, the reference table). Importing either loads no torch.
"""
