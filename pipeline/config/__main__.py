"""`python -m pipeline.config` prints the reference of every key (docs/configuration.md)."""

from pipeline.config.io import reference_markdown

print(reference_markdown())
