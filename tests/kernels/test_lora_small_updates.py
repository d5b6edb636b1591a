"""An adapter update smaller than half a unit of the 16-bit output still moves the output.

After a first Adam step B is about lr in size, and s (X A^T) B^T is far below half a bf16 unit of
X W^T. Rounding X W^T to bf16 first and adding the adapter term after (PEFT: `result + lora(x)`)
loses it: round(round(X W^T) + d) = round(X W^T). Early training then sees a tenth of each
update's effect (bench/RESULTS.md, QLoRA "Session 13"). The fused path rounds once, after the sum
(on a CPU: adapter term written first, the base product accumulated onto it in the GEMM's fp32
epilogue; for NF4: W' = W + s B A formed in fp32 and rounded once), so the change of the output is
unbiased: over many elements, y(B) - y(0) regresses on the exact d with slope 1. A path that
drops small updates shows slope 0. On CUDA only the NF4 path rounds once (cuBLAS rounds before its
epilogue adds: see `kestrel.kernels.lora.lora`, "Rounding"), except for a 16-bit MLP's gate and up, whose
adapter terms the GLU adds in fp32 (`kestrel.kernels.glu_lowrank`).
"""

from __future__ import annotations

import pytest
import torch

from kestrel.kernels import nf4
from kestrel.kernels.lora.lora import LoRAWeights, lora_linear, lora_qkv
from kestrel.kernels.lora.mlp import lora_mlp

bnb = pytest.importorskip("bitsandbytes")


def _base(out: int, inp: int, quantized: bool, device: str, seed: int = 0) -> tuple[torch.Tensor, object, torch.Tensor]:
    """(weight, quant_state, exact W in fp64) of a random (out, inp) base; `seed` tells apart bases of one shape
    (gate and up must differ: with W_g = W_u, h = act(E) E rounds E's squares, whose low bits are not uniform,
    and the rounding of h then loses a quarter of a small update through its bias, not through the kernel)."""
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(out + 7 * inp + 1009 * seed)) / inp**0.5
    if not quantized:
        w = w.to(device, torch.bfloat16)
        return w, None, w.double()
    packed, state = bnb.functional.quantize_4bit(w.to(device), quant_type="nf4", compress_statistics=True)
    return packed, state, nf4.dequantize_reference(packed, state, torch.float64)


def _adapter(out: int, inp: int, device: str, b: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ~ U(+-1/sqrt(inp)) (PEFT's), B = +-b: the size of B after one Adam step of lr b."""
    gen = torch.Generator().manual_seed(seed)
    a = (torch.rand(16, inp, generator=gen) * 2 - 1) / inp**0.5
    sign = torch.randint(0, 2, (out, 16), generator=gen) * 2 - 1
    return a.to(device), (b * sign).float().to(device)


def _slope(moved: torch.Tensor, exact_delta: torch.Tensor, reference: torch.Tensor) -> float:
    """Least-squares slope of the output's change on the exact adapter term, after checking that
    the term is well under half a bf16 unit of the output (else the test would prove nothing)."""
    unit = torch.exp2(torch.floor(torch.log2(reference.abs().clamp_min(1e-30))) - 7)
    assert float((exact_delta.abs() / unit).median()) < 0.2
    d, m = exact_delta.flatten().double(), moved.flatten().double()
    return float((m * d).sum() / (d * d).sum())


_CASES = {"cpu": dict(rows=256, hidden=256, kv=128, inter=512), "cuda": dict(rows=2048, hidden=4096, kv=1024, inter=14336)}


def _setup(device: str, quantized: bool, outs: list[int], inp: int):
    rows = _CASES[device]["rows"]
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)
    bases = [_base(o, inp, quantized, device, seed=k) for k, o in enumerate(outs)]
    adapters = [_adapter(o, inp, device, 1e-4, seed=k) for k, o in enumerate(outs)]
    return x, bases, adapters


def _weights(bases, adapters, zero: bool) -> list[LoRAWeights]:
    return [LoRAWeights(w, qs, a, torch.zeros_like(b) if zero else b, 1.0) for (w, qs, _), (a, b) in zip(bases, adapters)]


def _check(device: str, quantized: bool, grouped: bool) -> None:
    c = _CASES[device]
    outs = [c["hidden"], c["kv"], c["kv"]] if grouped else [c["hidden"]]
    x, bases, adapters = _setup(device, quantized, outs, c["hidden"])
    run = (lambda ws: lora_qkv(x, *ws)) if grouped else (lambda ws: (lora_linear(x, ws[0]),))
    with torch.no_grad():
        y0, y1 = run(_weights(bases, adapters, True)), run(_weights(bases, adapters, False))
    for k, ((_, _, w), (a, b)) in enumerate(zip(bases, adapters)):
        exact = x.double() @ w.t()
        delta = (x.double() @ a.double().t()) @ b.double().t()
        slope = _slope(y1[k].double() - y0[k].double(), delta, exact)
        assert 0.85 < slope < 1.15, f"projection {k} ({outs[k]} x {c['hidden']}): slope {slope:.3f}"


@pytest.mark.parametrize("grouped", [False, True], ids=["linear", "qkv"])
@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "nf4"])
def test_small_adapter_update_moves_the_output(backend: str, quantized: bool, grouped: bool) -> None:
    _check("cpu", quantized, grouped)


def test_small_down_update_moves_the_mlp_output(backend: str) -> None:
    c = _CASES["cpu"]
    x, bases, adapters = _setup("cpu", False, [c["inter"], c["inter"]], c["hidden"])
    down = [_base(c["hidden"], c["inter"], False, "cpu")]
    down_adapter = [_adapter(c["hidden"], c["inter"], "cpu", 1e-4, seed=9)]
    gate_up = _weights(bases, adapters, True)
    with torch.no_grad():
        y0 = lora_mlp(x, *gate_up, *_weights(down, down_adapter, True))
        y1 = lora_mlp(x, *gate_up, *_weights(down, down_adapter, False))
    (wg, wu), (wd, (a, b)) = [w for _, _, w in bases], (down[0][2], down_adapter[0])
    h = torch.nn.functional.silu(x.double() @ wg.t()) * (x.double() @ wu.t())
    slope = _slope(y1.double() - y0.double(), (h @ a.double().t()) @ b.double().t(), h @ wd.t())
    assert 0.85 < slope < 1.15, f"down: slope {slope:.3f}"


# cuBLAS rounds X W^T to bf16 before it adds the adapter term in its epilogue (slope 0.13 at
# 4096 x 4096 on an H100, torch 2.11), as PEFT's own path does: a 16-bit base on CUDA still loses
# small updates. Strict, so that a fix (or a cuBLAS that rounds once) shows up here.
_CUBLAS_ROUNDS_TWICE = pytest.mark.xfail(strict=True, reason="cuBLAS rounds X W^T before adding C")


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [False, True], ids=["linear", "qkv"])
@pytest.mark.parametrize("quantized", [pytest.param(False, marks=_CUBLAS_ROUNDS_TWICE), True], ids=["bf16", "nf4"])
def test_cuda_small_adapter_update_moves_the_output(quantized: bool, grouped: bool) -> None:
    """At the 8B shapes, through cuBLAS and the Triton kernels."""
    _check("cuda", quantized, grouped)


@pytest.mark.gpu
def test_cuda_small_gate_and_up_updates_move_the_mlp_output() -> None:
    """A 16-bit base on CUDA: gate's and up's adapter terms go inside the GLU, in fp32, so their small updates
    reach the output (slope 1 on the first-order change through the GLU and down), where the base product's
    epilogue would round them away (the xfail above)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    c = _CASES["cuda"]
    x, bases, adapters = _setup("cuda", False, [c["inter"], c["inter"]], c["hidden"])
    down = [_base(c["hidden"], c["inter"], False, "cuda")]
    down_zero = _weights(down, [_adapter(c["hidden"], c["inter"], "cuda", 1e-4, seed=9)], True)
    with torch.no_grad():
        y0 = lora_mlp(x, *_weights(bases, adapters, True), *down_zero)
        y1 = lora_mlp(x, *_weights(bases, adapters, False), *down_zero)
    (wg, wu), wd = [w for _, _, w in bases], down[0][2]
    e, g = x.double() @ wg.t(), x.double() @ wu.t()
    de, dg = ((x.double() @ a.double().t()) @ b.double().t() for a, b in adapters)
    s = torch.sigmoid(e)
    dh = s * (1 + e * (1 - s)) * g * de + e * s * dg  # first order: silu'(E) G dE + silu(E) dG
    slope = _slope(y1.double() - y0.double(), dh @ wd.t(), (e * s * g) @ wd.t())
    assert 0.85 < slope < 1.15, f"gate/up: slope {slope:.3f}"
