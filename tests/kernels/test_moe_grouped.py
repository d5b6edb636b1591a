"""The grouped expert product and the routed expert MLP against a per-expert loop."""

from __future__ import annotations

import pytest
import torch

from kestrel.kernels.moe import ExpertProjection, Routing, gpt_oss_glu, grouped_mm, moe_experts

IMPLS = ("grouped_mm", "padded")


def _loop_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    out, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        out.append(x[start:end] @ w[e])
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_mm_equals_loop_with_empty_experts(impl: str, transposed: bool) -> None:
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 0, 9, 1])  # experts 1 and 3 get no rows
    offsets = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), 16, generator=g, requires_grad=True)
    stored = torch.randn(6, 24, 16, generator=g) if transposed else torch.randn(6, 16, 24, generator=g)
    stored.requires_grad_(True)
    w = stored.transpose(1, 2) if transposed else stored  # (E, K, N) either way
    dy = torch.randn(x.shape[0], 24, generator=g)
    y = grouped_mm(x, w, offsets, impl)
    y.backward(dy)
    x_ref, s_ref = x.detach().clone().requires_grad_(True), stored.detach().clone().requires_grad_(True)
    w_ref = s_ref.transpose(1, 2) if transposed else s_ref
    y_ref = _loop_mm(x_ref, w_ref, offsets)
    y_ref.backward(dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stored.grad, s_ref.grad, rtol=1e-5, atol=1e-5)
    assert stored.grad[1].abs().sum() == 0 and stored.grad[3].abs().sum() == 0


def test_grouped_mm_broadcast_gradient_and_odd_shapes() -> None:
    """A .sum() gradient (zero strides) and a width torch's kernel cannot take (padded then)."""
    x = torch.randn(7, 5, requires_grad=True)
    w = torch.randn(3, 5, 3, requires_grad=True)
    offsets = torch.tensor([2, 2, 7], dtype=torch.int32)
    grouped_mm(x, w, offsets).sum().backward()
    x_ref, w_ref = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    _loop_mm(x_ref, w_ref, offsets).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(w.grad, w_ref.grad)


def _reference_moe(x, index, weights, gu, down, activation):
    """HF's loop: for each expert, its tokens through dense weights (base + s * A B)."""
    out = torch.zeros_like(x)
    for e in range(gu.weight.shape[0]):
        tok, slot = torch.where(index == e)
        if tok.numel() == 0:
            continue
        def lin(p, h):
            y = h @ p.weight[e] + (p.bias[e] if p.bias is not None else 0)
            return y + p.scaling * (h @ p.lora_a[e]) @ p.lora_b[e] if p.lora_a is not None else y
        h = lin(gu, x[tok])
        if activation == "gpt_oss":
            h = gpt_oss_glu(h, 1.702, 7.0)
        else:
            a, b = h.chunk(2, dim=-1)
            h = torch.nn.functional.silu(a) * b
        out = out.index_add(0, tok, lin(down, h) * weights[tok, slot, None])
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("activation", ["swiglu", "gpt_oss"])
def test_moe_experts_with_lora_equal_per_expert_loop(impl: str, activation: str) -> None:
    g = torch.Generator().manual_seed(1)
    n, k, e, hidden, inter, r = 13, 2, 8, 16, 8, 8
    x = torch.randn(n, hidden, generator=g, requires_grad=True)
    index = torch.stack([torch.randint(0, 5, (n,), generator=g), torch.randint(5, 7, (n,), generator=g)], 1)  # expert 7 idle
    weights = torch.rand(n, k, generator=g, requires_grad=True)

    def proj(i: int, o: int) -> ExpertProjection:
        t = lambda *s: (torch.randn(*s, generator=g) * 0.3).requires_grad_(True)  # noqa: E731
        return ExpertProjection(t(e, i, o), t(e, o) if activation == "gpt_oss" else None, t(e, i, r), t(e, r, o), 0.5)

    gu, down = proj(hidden, 2 * inter), proj(inter, hidden)
    leaves = [x, weights, gu.weight, down.weight, gu.lora_a, gu.lora_b, down.lora_a, down.lora_b]
    leaves += [gu.bias, down.bias] if activation == "gpt_oss" else []
    out = moe_experts(x, index, weights, gu, down, activation, impl=impl)
    grads = torch.autograd.grad(out.pow(2).sum(), leaves)
    ref = _reference_moe(x, index, weights, gu, down, activation)
    ref_grads = torch.autograd.grad(ref.pow(2).sum(), leaves)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert grads[4][7].abs().sum() == 0  # the idle expert's LoRA A gets no gradient


def test_routing_offsets_and_order() -> None:
    index = torch.tensor([[2, 0], [2, 1], [0, 2]])
    routing = Routing.of(index, 4)
    assert routing.offsets.tolist() == [2, 3, 6, 6]
    assert routing.experts.tolist() == [0, 0, 1, 2, 2, 2]
    assert routing.tokens.tolist() == [0, 2, 1, 0, 1, 2]


def test_peft_expert_factors_take_torch_grouped_gemm() -> None:
    """PEFT's per-expert LoRA factors, as `expert_projections` hands them over, are laid out so
    torch's grouped GEMM takes them (no padded fallback with its host sync on the GPU)."""
    import copy

    from peft import LoraConfig, get_peft_model

    from kestrel.kernels.moe import grouped_impl
    from kestrel.model.moe import expert_projections
    from kestrel.model.registry import family_of
    from tests.support.tiny import tiny_model

    model = get_peft_model(copy.deepcopy(tiny_model("gpt_oss", 64)), LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    block = model.base_model.model.model.layers[0].mlp
    x = torch.randn(6, 128)
    for proj in expert_projections(block.experts, family_of("gpt_oss").moe):
        low = torch.randn(6, 8)
        assert grouped_impl(x if proj.lora_a.shape[1] == 128 else torch.randn(6, 64), proj.lora_a) == "grouped_mm"
        assert grouped_impl(low, proj.lora_b) == "grouped_mm"
