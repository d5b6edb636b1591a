"""kestrel.kernels.lora.mlp's gate store: a checkpoint's first pass hands the gate product E to the store, and
its recompute takes E back instead of computing it, with the gradients unchanged."""

from __future__ import annotations

import pytest
import torch

from kestrel.kernels.lora import lora as lora_module
from kestrel.kernels.lora import mlp as mlp_module
from kestrel.kernels.lora.mlp import lora_mlp
from tests.kernels.test_lora import MLP, _adapter_params, _close, _peft_block, _peft_mlp, _run, _weights, _x


class _Store:
    """A GateStore that keeps E on the CPU and counts what it is asked."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []
        self.taken = 0

    def target(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        return None

    def keep(self, e: torch.Tensor) -> None:
        self.kept.append(e.detach().clone())

    def take(self) -> torch.Tensor | None:
        self.taken += 1
        return self.kept.pop() if self.kept else None


def _gate_products(monkeypatch: pytest.MonkeyPatch, gate_a: torch.Tensor) -> list[int]:
    """Rows of every gate product formed from now on (a spy on kestrel.kernels.lora._expand)."""
    rows: list[int] = []
    real = lora_module._expand

    def spy(x, xa, w, *args, **kwargs):
        if w.lora_A is gate_a:
            rows.append(x.shape[0])
        return real(x, xa, w, *args, **kwargs)

    monkeypatch.setattr(lora_module, "_expand", spy)
    return rows


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_recompute_takes_the_kept_gate_product(activation: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_KERNELS", backend)
    block = _peft_block()
    params = _adapter_params(block, MLP)
    expected = _run(_peft_mlp(activation)(block), _x(torch.float32), params)
    weights = _weights(block, MLP)
    computed = _gate_products(monkeypatch, weights[0].lora_A)
    store = _Store()
    with torch.no_grad():  # a checkpoint's first pass: E goes to the store
        first = lora_mlp(_x(torch.float32), *weights, activation=activation, gate_store=store)
    assert computed == [14] and len(store.kept) == 1 and store.kept[0].shape == (14, weights[0].out_features)
    _close([first], [expected[0][0]], 1e-5)
    ours = lambda x: lora_mlp(x, *weights, activation=activation, discard_output=True, gate_store=store)  # noqa: E731
    got = _run(ours, _x(torch.float32), params)
    assert computed == [14] and store.taken == 1 and store.kept == []  # the recompute formed no E
    _close(got[1], expected[1], 1e-5)
    # The same recompute without a store: bit for bit the same gradients.
    plain = _run(lambda x: lora_mlp(x, *weights, activation=activation, discard_output=True), _x(torch.float32), params)
    for a, b in zip(got[1], plain[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_store_with_nothing_kept_means_the_recompute_forms_e(monkeypatch: pytest.MonkeyPatch) -> None:
    block = _peft_block()
    params = _adapter_params(block, MLP)
    expected = _run(_peft_mlp("swiglu")(block), _x(torch.float32), params)
    weights = _weights(block, MLP)
    computed = _gate_products(monkeypatch, weights[0].lora_A)
    store = _Store()
    got = _run(lambda x: lora_mlp(x, *weights, discard_output=True, gate_store=store), _x(torch.float32), params)
    assert store.taken == 1 and computed == [14]
    _close(got[1], expected[1], 1e-5)


def test_a_first_pass_whose_recompute_defers_keeps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # A deferred recompute runs nothing in its forward, so a kept E would only cost the host link.
    monkeypatch.setattr(mlp_module, "DEFERRED_ROWS", 5)  # 14 rows over a 16-bit base: deferred
    block = _peft_block()
    params = _adapter_params(block, MLP)
    expected = _run(_peft_mlp("swiglu")(block), _x(torch.float32), params)
    weights, store = _weights(block, MLP), _Store()
    with torch.no_grad():
        lora_mlp(_x(torch.float32), *weights, gate_store=store)
    assert store.kept == []
    got = _run(lambda x: lora_mlp(x, *weights, discard_output=True, gate_store=store), _x(torch.float32), params)
    assert store.taken == 0
    _close(got[1], expected[1], 1e-5)


class _Policy:
    """A DeferPolicy with a fixed answer that records the rows it is asked about."""

    def __init__(self, defers: bool) -> None:
        self.answer, self.asked = defers, []

    def defers(self, rows: int, gate, up, device: torch.device) -> bool:
        self.asked.append(rows)
        return self.answer


@pytest.mark.parametrize("defers", [False, True])
def test_the_deferral_policy_decides_both_passes(defers: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rows past the memory rule's point: the run's policy, not the rule, decides. Not deferring, the
    # first pass keeps E and the recompute takes it (no gate product); deferring, nothing is kept and
    # the backward forms E itself. The gradients are PEFT's either way.
    monkeypatch.setattr(mlp_module, "DEFERRED_ROWS", 5)  # 14 rows over a 16-bit base: the memory rule defers
    block = _peft_block()
    params = _adapter_params(block, MLP)
    expected = _run(_peft_mlp("swiglu")(block), _x(torch.float32), params)
    weights, store, policy = _weights(block, MLP), _Store(), _Policy(defers)
    computed = _gate_products(monkeypatch, weights[0].lora_A)
    with torch.no_grad():
        lora_mlp(_x(torch.float32), *weights, gate_store=store, defer=policy)
    assert len(store.kept) == (0 if defers else 1)
    got = _run(lambda x: lora_mlp(x, *weights, discard_output=True, gate_store=store, defer=policy),
               _x(torch.float32), params)
    assert policy.asked == [14, 14]
    assert store.taken == (0 if defers else 1)
    assert computed == ([14, 5, 5, 4] if defers else [14])  # first pass, then the deferred chunks or nothing
    _close(got[1], expected[1], 1e-5)
