"""One run on several devices of one host: which devices, and the collectives the shared loop needs.

A run with `devices: N` (or `auto`, or a list of GPU ids) is N processes, one per device, each
running the same recipe on its own share of the batches (data parallel). Rank 0 is the process
that was asked to train (the CLI, or the job's worker); it starts the other ranks
(`kestrel.training.launch`) and alone reports metrics, writes checkpoints and the final weights.
The environment follows torchrun's names (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), so `torchrun -m kestrel train ...` runs the same code.

How each method's weights are kept:
- LoRA / QLoRA: the frozen base is replicated (NF4 or bf16, as on one device), and after each
  step's backward the adapters' gradients are summed across ranks in one coalesced all-reduce.
  The adapters and their optimizer state are a few MB, so sharding them would save nothing and
  cost collectives inside the fused kernels and the layer CUDA graphs.
- full fine-tuning: parameters, gradients and optimizer state are sharded with FSDP2
  (`fully_shard` on each decoder layer and on the root), so a model too large for one device fits.

Loss scaling: each rank's loss is its trained tokens' summed loss divided by the number of
trained tokens of the whole step across ranks (one all-reduce of a count before the forwards),
so summing the ranks' gradients gives exactly the gradient of one big batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from kestrel.errors import ConfigError

STOP_CODES = {None: 0, "cancel": 1, "pause": 2}
INIT_TIMEOUT = timedelta(minutes=5)  # the other ranks load the model before their first collective


def plan_devices(spec: int | str | list[int], cuda_count: int) -> list[str]:
    """The device of each rank for a run's `devices` setting, given the GPUs this process sees.

    `auto`: every visible GPU, else one CPU process; N: the first N GPUs, or N CPU processes (gloo)
    when there is no GPU; a list: those GPU ids."""
    if cuda_count == 0:
        if isinstance(spec, list):
            raise ConfigError(f"devices lists GPU ids {spec} but this machine shows no GPU; write devices: N "
                              "for N CPU processes, or remove devices")
        return ["cpu"] * (1 if spec == "auto" else int(spec))
    if spec == "auto":
        return [f"cuda:{i}" for i in range(cuda_count)]
    if isinstance(spec, int):
        if spec > cuda_count:
            raise ConfigError(f"devices: {spec} asks for more GPUs than the {cuda_count} visible; "
                              f"use at most {cuda_count} (or devices: auto)")
        return [f"cuda:{i}" for i in range(spec)]
    missing = [i for i in spec if i >= cuda_count]
    if missing:
        raise ConfigError(f"devices lists GPU {missing[0]}, but only GPUs 0..{cuda_count - 1} are visible")
    return [f"cuda:{i}" for i in spec]


@dataclass
class World:
    """This process's place in a run: rank `rank` of `size`, on `device`. `World()` is a run on one
    device, whose collectives do nothing."""

    rank: int = 0
    size: int = 1
    device: str = "cpu"
    loss_scale: float = 1.0  # what each rank's loss is multiplied by before backward (see shard_full_model)
    threads_before: int = 0  # this process's CPU threads before `join` shared the cores out (restored by `leave`)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over every rank (in place; returned)."""
        if self.distributed:
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value

    def sync_gradients(self, params: Iterable[nn.Parameter]) -> None:
        """Sum the gradients of replicated trainable `params` across ranks, in one all-reduce of
        their flattened concatenation (a parameter with no gradient counts as zeros)."""
        if not self.distributed:
            return
        params = list(params)
        if not params:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    def gather_columns(self, value: torch.Tensor) -> torch.Tensor:
        """`value` (k, n) of every rank side by side in rank order: (k, size * n), on this rank's
        device (every rank passes the same shape and dtype). `value` itself on one device."""
        if not self.distributed:
            return value
        mine = value.to(self.device).contiguous()
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine)
        return torch.cat(every, dim=-1)

    def agree_stop(self, stop: str | None) -> str | None:
        """Rank 0's stop request (cancel / pause / None), the same on every rank, so all of them
        checkpoint and end at the same step."""
        if not self.distributed:
            return stop
        code = torch.tensor([STOP_CODES[stop] if self.is_main else 0], device=self.device)
        dist.broadcast(code, src=0)
        return {v: k for k, v in STOP_CODES.items()}[int(code.item())]

    def from_main(self, values: list[float]) -> list[float]:
        """Rank 0's `values` on every rank (one broadcast), so decisions taken from measured
        numbers (the evaluation schedule) agree; `values` itself on one device."""
        if not self.distributed:
            return values
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.broadcast(mine, src=0)
        return mine.tolist()

    def per_device(self, values: dict[str, float]) -> dict[str, float]:
        """`values` of every rank, named `<name>/gpu<rank>` (memory per device); {} on one device."""
        if not self.distributed:
            return {}
        names = sorted(values)
        mine = torch.tensor([values[n] for n in names], dtype=torch.float64, device=self.device)
        every = [torch.zeros_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine)
        return {f"{n}/gpu{r}": float(t[i]) for r, t in enumerate(every) for i, n in enumerate(names)}

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast_parameters(self, model: nn.Module) -> None:
        """Rank 0's trainable parameters copied to every rank (the adapters start equal even
        where an initialiser drew from another random stream)."""
        if not self.distributed:
            return
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad and not isinstance(p, torch.distributed.tensor.DTensor):
                    dist.broadcast(p.data, src=0)


def world_from_env() -> World:
    """The world torchrun's variables describe (RANK, WORLD_SIZE, LOCAL_RANK), else one device."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    return World(rank, size, device)


def join(world: World) -> None:
    """Join the run's process group (NCCL on GPUs, gloo on the CPU) and make this rank's GPU the
    current one, so models load onto it. Nothing to do on one device."""
    if not world.distributed or dist.is_initialized():
        return
    if world.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(world.device))
    else:  # CPU ranks share the cores; rank 0 may be a longer-lived process (the CLI, a test): `leave` gives them back
        world.threads_before = torch.get_num_threads()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world.size))
    backend = "nccl" if world.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, rank=world.rank, world_size=world.size, timeout=INIT_TIMEOUT)


def leave(world: World) -> None:
    """Leave the process group and give this process its CPU threads back."""
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()
    if world.threads_before:
        torch.set_num_threads(world.threads_before)


def shard_full_model(model: nn.Module, layers: Iterable[nn.Module], world: World) -> None:
    """FSDP2 for full fine-tuning: each decoder layer its own shard group (its parameters
    gathered just before it runs, freed after), then the root (embeddings, final norm, head).

    FSDP2 averages gradients over ranks, and each rank's loss is already divided by the whole
    step's token count, so the loss is scaled by the number of ranks (`world.loss_scale`) to make
    the average the sum (a divide factor of 1 would need PREMUL_SUM, which gloo lacks)."""
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    world.loss_scale = float(world.size)


def reshard_after_scoring(model: nn.Module) -> None:
    """After forwards without a backward (reference log-probs, evaluation) on a model sharded with
    FSDP2: its root keeps its parameters gathered after a forward, for the backward it expects,
    with the module holding the gathered tensors in place of the shards; reshard it, so an
    optimizer made next or the next step sees the shards. Nothing to do for any other model."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
