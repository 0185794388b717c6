"""How a training run spreads over processes: where this process stands (:class:`Dist`), the checks of the
parallel options, the context-parallel groups, DistributedDataParallel or FSDP2 around the model, the full state
of a sharded run, and leaving the process group in the order that lets every rank exit.

The world is ``context_parallel`` x data-parallel groups: ranks ``g P .. g P + P - 1`` (``P`` the
``--context-parallel`` ranks) share their sequences, each holding its part of every position (zigzag layout).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch

from ..backends import why_not
from .model import TransformerConfig, TransformerLM
from .options import TrainOptions, UsageError


@dataclass
class Dist:
    """Where this process stands in a distributed run (from torchrun's environment variables)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    enabled: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> Dist:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        return cls(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")), True)


def parameter_groups(model: TransformerLM, weight_decay: float) -> list[dict]:
    """Weight decay on linear weights only: relative tables must not decay, the causal LM never updates
    their future rows, and decaying those would fake 'learned' structure."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        is_table = name.endswith(("rel_k", "rel_v"))
        (decay if p.dim() == 2 and not is_table and not name.startswith("embed") else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def optimizer_for(model: TransformerLM, options: TrainOptions) -> torch.optim.Optimizer:
    """The run's AdamW over ``model``'s parameters (plain or sharded)."""
    return torch.optim.AdamW(parameter_groups(model, options.weight_decay), lr=options.lr, betas=(0.9, 0.95))


def data_parallel(dist: Dist, options: TrainOptions) -> tuple[int, int]:
    """(index, count) of this rank's data-parallel group."""
    p = options.context_parallel
    return dist.rank // p, dist.world_size // p


def check_parallel(config: TransformerConfig, options: TrainOptions, dist: Dist) -> None:
    """The parallel options against the world and the model (a :class:`UsageError` before any work)."""
    world, p = dist.world_size, options.context_parallel
    if (p > 1 or options.fsdp) and not dist.enabled:
        raise UsageError("--context-parallel and --fsdp split the work over processes: run under torchrun "
                         "with more than one process")
    if world % p:
        raise UsageError(f"--context-parallel {p} must divide the number of processes ({world})")
    if p > 1:
        if config.context % (2 * p):
            raise UsageError(f"--context {config.context} must be a multiple of 2 x --context-parallel "
                             f"({2 * p}): each rank holds two chunks of every sequence (zigzag)")
        if config.dropout > 0:
            raise UsageError("--context-parallel needs --dropout 0 (attention dropout is not served by the ring)")
        if refused := why_not(config.backend, chunk_pairs=True):
            raise UsageError(f"--context-parallel needs a --backend that serves context-parallel chunk pairs; "
                             f"--backend {config.backend} refuses: {'; '.join(refused)}")


def context_parallel_group(dist: Dist, options: TrainOptions):
    """The :class:`~relattn.distributed.ContextParallel` of this rank (None without context parallelism): its group
    of ``P`` consecutive ranks, zigzag layout (causal attention then costs every rank the same)."""
    p = options.context_parallel
    if p == 1:
        return None
    from ..distributed import ContextParallel

    groups = [torch.distributed.new_group(list(range(g * p, (g + 1) * p))) for g in range(dist.world_size // p)]
    return ContextParallel(groups[dist.rank // p], layout="zigzag")


def data_parallel_wrapper(model: TransformerLM, device: torch.device):
    """DistributedDataParallel around ``model`` (gradients averaged over the world)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def fully_shard_model(model: TransformerLM, optimizer: torch.optim.Optimizer, options: TrainOptions,
                      device: torch.device) -> torch.optim.Optimizer:
    """FSDP2: every block, then the whole model, under ``fully_shard``; returns the optimizer rebuilt over the
    sharded parameters, with the state of ``optimizer`` (a resumed run's) sharded the same way."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    restored = optimizer.state_dict()
    for block in model.encoder.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = optimizer_for(model, options)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, state in restored["state"].items():
        p = params[index]
        restored["state"][index] = {k: distribute_tensor(v.to(device), p.device_mesh, p.placements,
                                                         src_data_rank=None)
                                    if torch.is_tensor(v) and v.shape == p.shape else v for k, v in state.items()}
    optimizer.load_state_dict(restored)
    return optimizer


def full_copies(model: TransformerLM, optimizer: torch.optim.Optimizer, config: TransformerConfig,
                options: TrainOptions, device: torch.device) -> tuple[TransformerLM, torch.optim.Optimizer]:
    """A sharded run's model and optimizer as plain ones holding the full state, on ``device`` (every rank calls it:
    each sharded tensor is gathered)."""
    from torch.distributed.tensor import DTensor

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    with torch.random.fork_rng(devices=[]):  # building the copy must not move the run's random state
        copy = TransformerLM(config)
    copy.load_state_dict({k: full(v).detach() for k, v in model.state_dict().items()})
    copy.to(device)
    copied = optimizer_for(copy, options)
    sd = optimizer.state_dict()
    # gathered in one order on every rank (a restored state's order is the checkpoint reader's)
    sd["state"] = {i: {k: full(sd["state"][i][k]) for k in sorted(sd["state"][i])} for i in sorted(sd["state"])}
    copied.load_state_dict(sd)
    return copy, copied


def leave_process_group(*, finished: bool, release) -> None:
    """Leave the process group: ``finished=True`` (every rank completed its run) waits for the other ranks first, so
    none tears the group down while another still uses it (after a failure there is no such wait: the other ranks
    may never arrive); ``release()`` then drops what holds the group (a DistributedDataParallel reducer, a sharded
    model, the context-parallel group: a reducer freed after ``destroy_process_group()`` joins gloo's threads in
    its destructor and can hang the process at exit)."""
    if finished:
        torch.distributed.barrier()
    release()
    gc.collect()  # the wrapper and its reducer, should a reference cycle hold them
    torch.distributed.destroy_process_group()


__all__ = ["Dist", "check_parallel", "context_parallel_group", "data_parallel", "data_parallel_wrapper",
           "full_copies", "fully_shard_model", "leave_process_group", "optimizer_for", "parameter_groups"]
