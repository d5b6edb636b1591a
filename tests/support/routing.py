"""One routing for several runs of a mixture-of-experts model, for comparisons of precision.

A bf16 model and its fp32 twin send a token to different experts wherever its k-th and (k+1)-th
router scores lie closer than bf16's rounding. Such near-ties are common: in the tiny two-layer MoE
models on a 128-token batch, 0 to 6 of the 256 (layer, token) choices flip between the twins (seeds
21-30), as often in HF's bf16 model as in ours, and one flipped choice moves that token's output by
the difference of two experts' outputs: a relative logits error (max-norm) of 0.04 to 0.15 for
Qwen3-MoE and about 0.3 for gpt-oss, against about 0.01 of bf16 rounding.
A comparison of arithmetic precision therefore first pins every run to one routing: each router
still computes its own logits and weights (its own rounding, the family's own code), but takes
its top-k experts from the reference run.

The pin replaces `torch.topk` while a router runs with a gather at the pinned experts, so the
family's scoring rule (softmax then top-k and renormalise, or top-k of the logits then softmax)
stays HF's own.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from kestrel.model.registry import family_of


def routers(model: nn.Module) -> list[nn.Module]:
    """The router of each sparse block of `model` (PEFT-wrapped or not), in layer order."""
    spec = family_of(model.config.model_type)
    if spec is None or spec.moe is None:
        raise ValueError(f"{model.config.model_type} is not a mixture-of-experts family")
    return [getattr(m, spec.moe.router_attr) for m in model.modules() if type(m).__name__ == spec.moe.block_class]


def routing_of(model: nn.Module, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The top-k experts (N, k) each router of `model` picks in one forward of `inputs`."""
    chosen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: chosen.append(out[2].detach())) for r in routers(model)]
    try:
        with torch.no_grad():
            model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return chosen


@contextmanager
def _topk_at(index: torch.Tensor) -> Iterator[None]:
    """While open, `torch.topk(x, k, dim=-1)` returns x at `index` (N, k) instead of x's top k."""
    real = torch.topk

    def pinned(x: torch.Tensor, k: int, dim: int = -1, **_: Any) -> Any:
        if x.shape[:-1] != index.shape[:-1] or k != index.shape[-1] or dim not in (-1, x.dim() - 1):
            raise ValueError(f"pinned routing {tuple(index.shape)} does not fit top-{k} of {tuple(x.shape)}: "
                             "pin with the routing of the same batch")
        return torch.return_types.topk((x.gather(-1, index), index))

    torch.topk = pinned
    try:
        yield
    finally:
        torch.topk = real


def pin_router(router: nn.Module, index: torch.Tensor) -> None:
    """From now on `router` takes its experts from `index` (N, k); its logits and weights stay its own.
    Every call must be on the N tokens `index` was taken from."""
    forward = router.forward

    def run(*args: Any, **kwargs: Any) -> Any:
        with _topk_at(index.to(args[0].device)):
            return forward(*args, **kwargs)

    router.forward = run


def pin_routing(model: nn.Module, chosen: list[torch.Tensor]) -> None:
    """`pin_router` on each router of `model`, with `chosen` one (N, k) per router as `routing_of` returns."""
    found = routers(model)
    if len(found) != len(chosen):
        raise ValueError(f"{len(chosen)} pinned routings for {len(found)} routers")
    for router, index in zip(found, chosen):
        pin_router(router, index)
