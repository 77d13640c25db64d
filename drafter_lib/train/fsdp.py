"""FSDP for the trainer (`TrainConfig.distributed = "fsdp"`): torch's FSDP2 `fully_shard`, one group per decoder
layer and the root (the `LossModule` around the drafter), and the whole-model state dicts that checkpoints and
exports keep, gathered to the main process or loaded into the shards with `torch.distributed.checkpoint.state_dict`.

Each parameter is a DTensor sharded on dim 0 (output rows) over the processes; before a group's forward FSDP2
gathers its weights whole, so the QAT fake-quant parametrizations (registered before sharding) quantize whole rows
and groups, exactly as on one process. Gradients are reduce-scattered (averaged over the processes, as DDP
averages them) into each process's shard, and AdamW keeps the state of its shard only.

`fully_shard` is called here rather than through accelerate's FSDP plugin: the trainer has to register the QAT
parametrizations on an unsharded model before sharding it, re-shard a fresh model when QAT starts, and make the
LossModule the root (its forward is the one the loop calls, so the root's hooks gather the embeddings, final norm and
head); the plugin wraps what `prepare` is given by its own policy and needs its own launch flags. The same calls
serve gloo on CPUs and NCCL on GPUs (tested with gloo only). Parameters stay fp32 (no MixedPrecisionPolicy): bf16
runs use the autocast DDP runs use, and fake-quant sees the fp32 latent weights that packing quantizes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

__all__ = ["device_mesh", "shard", "clip_grad_norm_", "full_model_state_dict", "full_state_dicts", "load_state_dicts",
           "broadcast_model_state_dict"]

# whole tensors, on the CPU of the main process only (the others get {}): what rank-0 writes need, without a whole
# copy of the drafter on any accelerator
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)


def device_mesh(device: torch.device) -> DeviceMesh:
    """A 1-D mesh over all processes on `device`'s type (the default process group: gloo on CPUs, NCCL on GPUs)."""
    return init_device_mesh(device.type, (dist.get_world_size(),))


def shard(loss_mod: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """fully_shard each decoder layer of `loss_mod.lm` (an HF causal LM), then `loss_mod` itself; in place."""
    for layer in loss_mod.lm.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(loss_mod, mesh=mesh)
    return loss_mod


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ over the DTensor gradient shards: clips by the norm of the whole gradient and returns
    it as a plain tensor, the same on every process. Collective."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def full_model_state_dict(model: nn.Module) -> dict:
    """`model.state_dict()` with whole CPU tensors on the main process, {} on the others. Collective: every
    process calls it."""
    return get_model_state_dict(model, options=_GATHER)


def full_state_dicts(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts as one process's `model.state_dict()` / `opt.state_dict()` give them, whole
    CPU tensors on the main process, ({}, {}) on the others. Collective. The optimizer's comes keyed by parameter
    name and is keyed back by position, the checkpoints' format, so any mode and process count resumes them."""
    msd = full_model_state_dict(model)
    osd = get_optimizer_state_dict(model, opt, options=_GATHER)
    if not osd:
        return msd, {}
    pos = {name: i for i, name in enumerate(_param_names(model, opt))}
    return msd, _rekeyed(osd, pos.__getitem__)


def load_state_dicts(model: nn.Module, msd: dict, opt: torch.optim.Optimizer, osd: dict) -> None:
    """Load whole state dicts (as `full_state_dicts` returns them), which every process holds, into the sharded
    `model` and `opt`: each process takes its shards from its own copy. Collective."""
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, dict(msd), options=options)  # a copy: it puts the local shards in the dict it gets
    set_optimizer_state_dict(model, opt, _rekeyed(osd, _param_names(model, opt).__getitem__), options=options)


def broadcast_model_state_dict(model: nn.Module, msd: dict) -> None:
    """Load the whole state dict the main process passes (the others pass {}) into the sharded `model`: the main
    process broadcasts it, each process keeps its shards. Collective."""
    set_model_state_dict(model, dict(msd), options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _param_names(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """The names torch.distributed.checkpoint keys the optimizer's parameters by, in the order of the positions
    `opt.state_dict()` numbers them in (a tied weight under its first name, as named_parameters lists it)."""
    names = {p: n for n, p in model.named_parameters()}
    return [names[p] for group in opt.param_groups for p in group["params"]]


def _rekeyed(osd: dict, key) -> dict:
    """An optimizer state dict with every parameter key k replaced by key(k), in its state and its param groups."""
    return {"state": {key(k): v for k, v in osd["state"].items()},
            "param_groups": [{**g, "params": [key(k) for k in g["params"]]} for g in osd["param_groups"]]}
