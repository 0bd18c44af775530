"""A full-weight version read for a loaded model: every tensor checked before any is written.

`stage_weights` reads a model directory (what the trainer publishes with `trainer.update =
"full"`) into CPU tensors and pairs each with the model parameter it replaces; it writes nothing,
so a directory that does not check out leaves the model as it was.

Invariants:
- The directory's config.json names the model's own `model_type`.
- Its tensors, from the files its shard index names (else every *.safetensors file), are exactly
  the model's persistent tensors by name and shape; a tied tensor (lm_head.weight tied to
  embed_tokens.weight) may be written once, and tied copies that are present must be equal.
- A value is converted to its parameter's dtype, but never between floating-point and integer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from pipeline.errors import AdapterCorruptError


def stage_weights(model: torch.nn.Module, path: Path, where: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(model tensor, new value in its dtype) for every distinct tensor of `model`; nothing is written.

    Refuses with AdapterCorruptError, its message starting with `where` and naming the path, a
    directory whose config is not this model's kind, whose safetensors do not read, or whose
    tensor names and shapes are not exactly the model's.
    """

    def bad(why: str) -> AdapterCorruptError:
        return AdapterCorruptError(f"{where}: {str(path)!r} {why}")

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise bad(f"has no readable config.json ({e})") from e
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type != model.config.model_type:
        raise bad(f"holds a {model_type!r} model; the engine serves {model.config.model_type!r}")
    # persistent tensors by name; tied names share one tensor object
    expected: dict[str, torch.Tensor] = model.state_dict(keep_vars=True)
    staged: dict[str, torch.Tensor] = {}
    for file in weight_files(path, bad):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as st:
                for name in st.keys():
                    target = expected.get(name)
                    if target is None:
                        raise bad(f"{file.name} holds tensor {name!r}, which the model does not have")
                    if name in staged:
                        raise bad(f"holds tensor {name!r} twice (again in {file.name})")
                    shape = list(st.get_slice(name).get_shape())
                    if shape != list(target.shape):
                        raise bad(f"{file.name}: tensor {name!r} has shape {shape}, the model's is "
                                  f"{list(target.shape)}")
                    value = st.get_tensor(name)
                    if value.is_floating_point() != target.is_floating_point():
                        raise bad(f"{file.name}: tensor {name!r} is {value.dtype}, the model's is {target.dtype}")
                    staged[name] = value.to(target.dtype)
        except AdapterCorruptError:
            raise
        except Exception as e:  # safetensors' own error (truncated file, bad header) or a read error
            raise bad(f"{file.name} does not read as safetensors: {type(e).__name__}: {e}") from e
    tied: dict[int, list[str]] = {}
    for name, tensor in expected.items():
        tied.setdefault(id(tensor), []).append(name)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    missing: list[str] = []
    for names in tied.values():
        present = [n for n in names if n in staged]
        if not present:
            missing.append(names[0])
            continue
        value = staged[present[0]]
        for other in present[1:]:
            if not torch.equal(staged[other], value):
                raise bad(f"holds different values for the tied tensors {present[0]!r} and {other!r}")
        pairs.append((expected[names[0]], value))
    if missing:
        raise bad(f"lacks {len(missing)} of the model's tensors: {', '.join(missing[:5])}"
                  + (", ..." if len(missing) > 5 else ""))
    return pairs


def weight_files(path: Path, bad: Callable[[str], AdapterCorruptError]) -> list[Path]:
    """The safetensors files of a model directory: those its shard index names, or all of them."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise bad("has no safetensors weights")
        return files
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise bad(f"has an unreadable {index.name} ({type(e).__name__}: {e})") from e
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
            raise bad(f"{index.name} names {name!r}, not a safetensors file of the directory")
        if not (path / name).is_file():
            raise bad(f"{index.name} names {name!r}, which is missing")
    return [path / n for n in names]
