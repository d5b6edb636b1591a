"""The fused GLU + rank-r backward (`kernels.glu_lora`) against its PyTorch reference, and its use
by `lora_mlp`. Under the interpreter on CPU (small, odd shapes), compiled on CUDA (`gpu`)."""

from __future__ import annotations

import pytest
import torch

from kernels import glu_lora
from kernels.glu_lora import glu_lora_backward, glu_lora_backward_reference
from kernels.lora import LoRAWeights, lora_mlp


def _inputs(m: int, i: int, r: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def make(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.5).to(dtype).to(device)

    e, g, dh = make(m, i), make(m, i), make(m, i)
    p, xg, xu = make(m, r), make(m, r), make(m, r)
    return e, g, dh, p, make(r, i), make(i, r), make(i, r), xg, xu


def _compare(m: int, i: int, r: int, dtype: torch.dtype, gelu: bool, device: str, tol: float) -> None:
    args = _inputs(m, i, r, dtype, device)
    e, g = args[0].clone(), args[1].clone()
    got = glu_lora_backward(*args, gelu=gelu)
    expected = glu_lora_backward_reference(e, g, *args[2:], gelu=gelu)
    names = ["[dE B_g | dG B_u]", "dA_d", "dB_g", "dB_u"]
    for name, a, b in zip(names, got, expected, strict=True):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * scale, msg=name)
    # dE and dG over E and G, every element written. 16-bit: two roundings (act(E), then dE) may
    # each land one ulp apart (the interpreter's fp32 -> bf16 cast truncates).
    ulp = 0.0 if dtype == torch.float32 else 2.0 ** -6
    for a, b in ((args[0], e), (args[1], g)):
        torch.testing.assert_close(a.float(), b.float(), rtol=ulp + 1e-6, atol=1e-6)


@pytest.mark.parametrize("gelu", [False, True], ids=["swiglu", "geglu"])
@pytest.mark.parametrize(("m", "i", "r"), [(37, 96, 8), (130, 70, 16), (5, 33, 3), (3, 300, 32)])
def test_fused_backward_matches_reference_fp32(m: int, i: int, r: int, gelu: bool, monkeypatch) -> None:
    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    _compare(m, i, r, torch.float32, gelu, "cpu", 1e-5)


def test_fused_backward_matches_reference_bf16() -> None:
    # bf16: dE, dG may round one ulp apart (fp32 sums in another order), which moves the
    # reductions by up to ~2^-8 of their largest term.
    _compare(37, 160, 16, torch.bfloat16, False, "cpu", 2e-2)


def test_lora_mlp_takes_the_fused_backward_where_it_can(monkeypatch) -> None:
    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    calls = []
    real = glu_lora.glu_lora_backward
    monkeypatch.setattr(glu_lora, "glu_lora_backward", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(0)

    def weights(out: int, inp: int, r: int) -> LoRAWeights:
        return LoRAWeights(torch.randn(out, inp, generator=gen), None, torch.randn(r, inp, generator=gen).requires_grad_(),
                           torch.randn(out, r, generator=gen).requires_grad_(), 0.5)

    x = torch.randn(2, 5, 24, generator=gen, requires_grad=True)
    lora_mlp(x, weights(40, 24, 4), weights(40, 24, 4), weights(24, 40, 4)).sum().backward()
    assert calls == [1]
    lora_mlp(x, weights(40, 24, 4), weights(40, 24, 2), weights(24, 40, 4)).sum().backward()
    assert calls == [1]  # ranks differ (a rank pattern): the unfused path


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_backward_on_cuda_at_an_llm_width(dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _compare(1000, 14336, 16, dtype, False, "cuda", 2e-2)
    _compare(77, 5000, 64, dtype, True, "cuda", 2e-2)
