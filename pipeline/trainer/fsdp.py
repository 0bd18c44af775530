"""FSDP2 for the policy trainer: `apply_fsdp` shards a model over the ranks, and the reads of sharded tensors.

torchtitan's way: the trainer builds its model whole, applies `apply_fsdp` to it (and to its KL
reference) before the optimizer takes the parameters, and otherwise runs the code of one process.
Where a sharded tensor needs other handling than a plain one, the helpers here take either, so
the trainer makes one call for both.

Invariants:
- A model is sharded per decoder layer (the classes its `_no_split_modules` names) and at its
  root, for LoRA and for full weights; AdamW, built on the sharded parameters, holds (and steps)
  each rank's shard of every moment.
- With `sum_gradients`, gradients are summed over the ranks (divide factor 1, in plain SUM
  reductions: gloo has no PREMUL_SUM), since each rank's loss is already weighed by its share of
  the whole step's.
- `whole` and `full_state_dict` of a sharded model are all-gathers: every rank calls them, in the
  same order. On a plain tensor or model they gather nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def device_mesh(device: str, world_size: int) -> Any:
    """The one-dimensional mesh of every rank, each on a device of `device`'s type (cpu or cuda)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.split(":")[0], (world_size,))


def apply_fsdp(model: torch.nn.Module, mesh: Any, *, sum_gradients: bool = False) -> None:
    """Shard `model` in place over `mesh`: each decoder layer, then the root. fully_shard moves each
    rank's shards to its device."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    layers = set(getattr(model, "_no_split_modules", None) or [])
    for m in list(model.modules()):
        if type(m).__name__ in layers:
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if sum_gradients:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (sharing its storage); a plain tensor itself."""
    return t.detach().to_local() if isinstance(t, DTensor) else t


def whole(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value to write: a sharded one gathered from every rank onto the CPU."""
    if isinstance(p, DTensor):
        return p.detach().full_tensor().to("cpu")
    return p.detach().contiguous()


def like_parameter(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t` (a saved AdamW moment, this rank's part) as the optimizer keeps it for `p`: sharded as `p` is."""
    if not isinstance(p, DTensor):
        return t
    return DTensor.from_local(t.to(local(p).device), p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def value(t: torch.Tensor) -> float:
    """A scalar's value; a sharded one (a gradient norm over sharded parameters) is already reduced over the ranks."""
    return float(t.full_tensor() if isinstance(t, DTensor) else t)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A sharded model's whole state dict on the CPU (gathered from every rank), with a tied output
    embedding left out, as the unsharded model's save_pretrained writes it (once)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    tied = getattr(model.config, "tie_word_embeddings", False)
    out = model.get_output_embeddings()
    if tied and out is not None:
        name = next(n for n, m in model.named_modules() if m is out)
        state.pop(f"{name}.weight", None)
    return state
