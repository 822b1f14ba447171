"""How the model is laid over the ranks (`distributed.strategy`) and what its backward keeps
(`trainer.activation_checkpointing`).

`fsdp`: PyTorch's FSDP2 (`fully_shard`) over a one-dimensional device mesh of all ranks. The
units are the modules of the classes `distributed.fsdp.wrap` names (each top-level child with
parameters when it names none), then the whole model. Mixed precision under `fsdp` is FSDP2's
policy (parameters all-gathered in the low precision, gradients reduced in float32), not
autocast.

Both work on the module in place: its names (state-dict keys) stay those of the plain model,
so checkpoints, EMA and validation see one model whatever the strategy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from app import dist
from app.checkpoint.rng import rng_state, set_rng_state
from app.errors import UserError

log = logging.getLogger(__name__)

LOW_PRECISION = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def module_classes(model: nn.Module, names: Iterable[str], key: str) -> tuple[type, ...]:
    """The classes of `model`'s modules named by `names` (a class name such as `Linear`, or
    its dotted path); a name no module of the model has is an error listing those it has."""
    present = {type(m) for m in model.modules()}
    by_name = {c.__name__: c for c in present} | {f"{c.__module__}.{c.__qualname__}": c
                                                  for c in present}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        have = ", ".join(sorted({c.__name__ for c in present}))
        raise UserError(f"{key}: the model has no module of class {', '.join(unknown)} (its "
                        f"classes: {have})")
    return tuple(by_name[n] for n in names)


def checkpoint_activations(model: nn.Module, class_names: list[str]) -> int:
    """Recompute the activations of the modules of these classes in the backward, with
    PyTorch's composable `checkpoint`: the module's names stay, and the forward's random state
    is restored for the recompute, so a resume stays exact. Returns how many modules."""
    if not class_names:
        return 0
    from torch.distributed._composable import checkpoint

    classes = module_classes(model, class_names, "trainer.activation_checkpointing")
    chosen = [m for m in model.modules() if isinstance(m, classes)]
    for module in chosen:
        checkpoint(module)
    log.info("activation checkpointing: %d module(s) of %s", len(chosen), ", ".join(class_names))
    return len(chosen)


def mixed_precision_policy(precision: str):  # -> MixedPrecisionPolicy
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = LOW_PRECISION.get(precision)
    if low is None:
        return MixedPrecisionPolicy()
    # float32 gradients in the reduction (a sum of low-precision values loses bits) and
    # float32 outputs, so the loss is computed as without FSDP.
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32,
                                output_dtype=torch.float32)


def units(model: nn.Module, class_names: list[str]) -> list[nn.Module]:
    """The modules sharded as units, innermost first (FSDP2 needs an inner unit sharded
    before the unit around it), the model itself not among them."""
    if class_names:
        classes = module_classes(model, class_names, "distributed.fsdp.wrap")
        chosen = [m for m in model.modules() if isinstance(m, classes) and m is not model]
    else:
        chosen = [m for m in model.children() if any(True for _ in m.parameters())]
    order = {id(m): i for i, m in enumerate(model.modules())}
    # Reversed module order puts every module after all the modules inside it.
    return sorted(chosen, key=lambda m: -order[id(m)])


def shard(model: nn.Module, device: torch.device, wrap: list[str], precision: str,
          reshard_after_forward: bool) -> nn.Module:
    """FSDP2 over all ranks, in place. Every rank must hold the same initial weights (the same
    seed): each keeps its part."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.world_size(),))
    policy = mixed_precision_policy(precision)
    inner = units(model, wrap)
    for module in inner:
        fully_shard(module, mesh=mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward)
    # The root's own parameters are freed after each forward too (FSDP2 keeps a root's for
    # the backward by default): after a forward without backward (validation) they stayed
    # gathered, and the checkpoint's optimizer state could not be matched to them (a
    # KeyError in torch's get_optimizer_state_dict when the root holds the parameters).
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    log.info("fsdp: %d unit(s) and the model sharded over %d ranks%s", len(inner),
             dist.world_size(), f", parameters in {precision}" if precision in LOW_PRECISION
             else "")
    return model


def buffer_broadcast(model: nn.Module) -> Callable[[], None] | None:
    """`distributed.broadcast_buffers` for a sharded model: FSDP shards parameters, not
    buffers (batch-norm statistics), which each rank then updates with its own batches. Called
    after each step's forwards, it copies rank 0's into every rank, so that between steps all
    ranks hold the same: they validate alike, and a checkpoint, which keeps one copy (DCP
    saves a replicated tensor from one rank, not always rank 0), resumes them exactly. (DDP
    broadcasts before each forward instead, and its checkpoint is rank 0's.) None without
    buffers."""
    import torch.distributed as tdist

    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in model.buffers():
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    if not by_dtype:
        return None

    @torch.no_grad()
    def broadcast() -> None:
        for buffers in by_dtype.values():  # one collective per dtype
            flat = torch.cat([b.reshape(-1) for b in buffers])
            tdist.broadcast(flat, src=0)
            for b, new in zip(buffers, flat.split([b.numel() for b in buffers]), strict=True):
                b.copy_(new.view_as(b))

    return broadcast


def settle_buckets(ddp: nn.Module, dataset: Dataset, device: torch.device, precision: str) -> None:
    """Put DDP's gradient buckets in their final layout before the first step of any run.

    DDP regroups the gradients into buckets after its first backward, by the order in which
    they were ready. Where a value lies in its bucket decides the order in which a ring
    all-reduce adds the ranks' values, and with three ranks or more that order shows in the
    last bits: a resumed run's first step, in the first layout, differed from the same step
    of the run it continues, in the regrouped one (two ranks add commutatively). One
    backward on two samples, before the loop, regroups them (two with static_graph=true,
    whose first backward records no order); their effects are undone (the buffers they
    updated, such as BatchNorm's statistics, the random states the samples and the forward
    drew on) and their gradients dropped."""
    model, random_states = ddp.module, rng_state()
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    x, _ = default_collate([dataset[i] for i in range(min(2, len(dataset)))])
    dtype = torch.bfloat16 if precision == "bf16-true" else None
    for _ in range(2 if ddp.static_graph else 1):
        ddp(x.to(device, dtype=dtype)).float().sum().backward()
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    for p in model.parameters():
        p.grad = None
    set_rng_state(random_states)
