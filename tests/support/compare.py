"""Comparing a patched model with its unpatched twin."""

from __future__ import annotations

import torch


def assert_same_trainable_grads(fast: torch.nn.Module, ref: torch.nn.Module, rtol: float = 1e-3, atol: float = 1e-5) -> None:
    """Every trainable parameter of `fast` got the gradient its namesake in `ref` got."""
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    fast_grads = {n: p.grad for n, p in fast.named_parameters() if p.requires_grad}
    assert ref_grads.keys() == fast_grads.keys() and len(ref_grads) > 0
    for name, grad in ref_grads.items():
        assert fast_grads[name] is not None, name
        torch.testing.assert_close(fast_grads[name], grad, rtol=rtol, atol=atol, msg=name)


def assert_same_loss_and_grads(fast: torch.nn.Module, ref: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
    """`fast`'s training loss on `batch` (with its labels) is `ref`'s, and so are the trainable gradients of it."""
    ref_loss = ref(**batch, use_cache=False).loss
    fast_loss = fast(**batch, use_cache=False).loss
    torch.testing.assert_close(fast_loss, ref_loss, rtol=1e-5, atol=1e-5)
    ref_loss.backward()
    fast_loss.backward()
    assert_same_trainable_grads(fast, ref)
