"""Checkpointed training gives the gradients of training without checkpointing, on every family,
including layers tied by more than their hidden states (Gemma 4's per-layer inputs and shared
K/V: `kestrel.recompute.linked`)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from kestrel.model.registry import SUPPORTED
from kestrel.recompute.checkpoint import set_gradient_checkpointing
from tests.support.tiny import tiny_model

VOCAB = 97


def _batch() -> dict[str, torch.Tensor]:
    """Two right-padded rows."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, VOCAB, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor | None]) -> None:
    assert got.keys() == want.keys()
    for name, grad in want.items():
        if grad is None:
            assert got[name] is None or not got[name].any(), name
            continue
        assert got[name] is not None, f"{name}: no gradient under checkpointing"
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", ["standard", "offload"])
@pytest.mark.parametrize("family", SUPPORTED)
def test_checkpointed_full_training_gives_the_gradients_of_plain_training(family: str, mode: str) -> None:
    """Every parameter (embeddings, per-layer input projections, each layer's K/V projections
    that later layers read) gets the gradient it gets without checkpointing."""
    ref = tiny_model(family, VOCAB, seed=3)
    fast = copy.deepcopy(ref)
    set_gradient_checkpointing(fast, mode)
    ref.train(), fast.train()
    batch = _batch()
    want_loss = ref(**batch, use_cache=False).loss
    want_loss.backward()
    loss = fast(**batch, use_cache=False).loss
    loss.backward()
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    _assert_same(_grads(fast), _grads(ref))


def test_shared_kv_reaches_the_writing_layer() -> None:
    """Gemma 4: the K/V projections of the layers whose K/V later layers reuse get those layers'
    gradient too (without it they would get only their own layer's share)."""
    ref = tiny_model("gemma4_text", VOCAB, seed=3)
    assert ref.config.num_kv_shared_layers > 0
    fast = copy.deepcopy(ref)
    set_gradient_checkpointing(fast, "standard")
    batch = _batch()
    for model in (ref, fast):
        model.train()
        model(**batch, use_cache=False).loss.backward()
    writers = [i for i, layer in enumerate(ref.model.layers) if layer.self_attn.store_full_length_kv]
    assert writers
    for i in writers:
        for proj in ("k_proj", "v_proj"):
            want = getattr(ref.model.layers[i].self_attn, proj).weight.grad
            got = getattr(fast.model.layers[i].self_attn, proj).weight.grad
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=f"layer {i} {proj}")


def _two_steps_on_reference_counts(model: torch.nn.Module) -> None:
    """Two training steps, each loss dropped after its backward, with the cyclic collector off: what
    is still alive afterwards is kept by references (Python's collector cannot free cycles through
    autograd's C++ graph anyway)."""
    model.train()
    gc.disable()
    try:
        for _ in range(2):
            loss = model(**_batch(), use_cache=False).loss
            loss.backward()
            del loss
    finally:
        gc.enable()


@pytest.mark.parametrize("mode", ["standard", "offload"])
def test_a_step_leaves_nothing_behind_without_the_garbage_collector(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a step's backward has run and its loss is dropped, none of its linked calls (and so
    none of the shared K/V mappings and layer outputs they hold) survive. Gemma 4 lost ~0.17 GiB a
    step on the H200 when a checkpoint's context held its linked call, whose mapping held the
    outputs whose grad_fn is that context: a cycle through autograd's C++ graph, which Python's
    collector cannot free either (checked: `gc.collect()` left them alive). Reference counts alone
    must free them."""
    from kestrel.recompute import linked

    calls: list[weakref.ref] = []
    made = linked.LinkedCall.__init__

    def tracked(self, *args, **kwargs):
        made(self, *args, **kwargs)
        calls.append(weakref.ref(self))

    monkeypatch.setattr(linked.LinkedCall, "__init__", tracked)
    model = tiny_model("gemma4_text", VOCAB, seed=3)  # the family with ties (per-layer input, shared K/V)
    set_gradient_checkpointing(model, mode)
    _two_steps_on_reference_counts(model)
    alive = [c for c in calls if c() is not None]
    assert calls and not alive, f"{len(alive)} of {len(calls)} linked calls outlive their step"


@pytest.mark.parametrize("mode", ["standard", "offload"])
@pytest.mark.parametrize("family", SUPPORTED)
def test_no_layer_output_outlives_its_step(family: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every family: once a step's backward has run and its loss is dropped, no checkpointed
    layer's output is alive on reference counts alone (a cycle through autograd's graph keeps a
    step's activations for good: the Gemma 4 leak above)."""
    from kestrel.recompute import checkpoint

    outputs: list[weakref.ref] = []
    apply = checkpoint.LayerCheckpoint.apply

    def tracked(*args):
        out = apply(*args)
        outputs.extend(weakref.ref(t) for t in (out if isinstance(out, tuple) else (out,)))
        return out

    monkeypatch.setattr(checkpoint.LayerCheckpoint, "apply", tracked)
    model = tiny_model(family, VOCAB, seed=3)
    set_gradient_checkpointing(model, mode)
    _two_steps_on_reference_counts(model)
    alive = sum(r() is not None for r in outputs)
    assert outputs and alive == 0, f"{alive} of {len(outputs)} layer outputs outlive their step"

