"""kernels.glu_lora: the GLU passes with the LoRA MLP's rank-r products folded in, against their
torch references (Triton through the interpreter on a CPU), odd shapes, unequal ranks."""

from __future__ import annotations

import pytest
import torch

from kernels import glu, glu_lora
from kernels.glu_lora import glu_lora_backward, glu_lora_backward_reference, glu_shrink, glu_shrink_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Only the order of the fp32 sums differs, plus (bf16) one rounding of each reduced output.
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3}


def unfused():
    """The separate passes the fused kernels replace: the GLU through `kernels.glu`'s Triton
    kernels, the products in fp32 torch. (Under the interpreter bf16 casts truncate where the GPU
    and torch round to nearest, so in bf16 h would differ from torch's by an ulp here and there;
    the separate Triton GLU truncates the same way.) The torch references are checked in fp32."""

    def shrink(e, g, a, s, activation):
        h = glu.glu_forward(e, g, gelu=activation == "geglu")
        return (h.float() @ a.float().t() * s).to(e.dtype)

    def backward(dh, e, g, xa, r_g, dyb, activation):
        h = glu.glu_forward(e, g, gelu=activation == "geglu")
        de, dg = glu.glu_backward(dh, e, g, gelu=activation == "geglu", inplace=True)
        xf = xa.float()
        return de, dg, de.float().t() @ xf[:, :r_g], dg.float().t() @ xf[:, r_g:], dyb.float().t() @ h.float()

    return shrink, backward


def rand(*shape: int, dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    actual, expected = actual.float(), expected.float()
    assert actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    err, ref = (actual - expected).abs().max().item(), expected.abs().max().item()
    assert err <= tol * ref, f"max err {err:.3e} > {tol} * {ref:.3e}"


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles small enough that the odd shapes below take several of them, both ways."""
    monkeypatch.setattr(glu_lora, "_SHRINK_BM", 16)
    monkeypatch.setattr(glu_lora, "_SHRINK_BI", 32)
    monkeypatch.setattr(glu_lora, "_BWD_BM", 16)
    monkeypatch.setattr(glu_lora, "_BWD_BI", 32)
    glu_lora._shrink_plan.cache_clear()
    glu_lora._bwd_plan.cache_clear()
    yield
    glu_lora._shrink_plan.cache_clear()
    glu_lora._bwd_plan.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("rows, inter, rank", [(37, 200, 8), (64, 96, 16), (5, 33, 4)])
def test_glu_shrink_matches_reference(poisoned, dtype, activation, rows, inter, rank) -> None:
    e, g = rand(rows, inter, dtype=dtype, seed=1), rand(rows, inter, dtype=dtype, seed=2)
    a = rand(rank, inter, dtype=dtype, scale=inter**-0.5, seed=3)
    got = glu_shrink(e, g, a, 2.0, activation)
    want = unfused()[0](e, g, a, 2.0, activation)
    assert got.dtype == dtype
    assert_rel(got, want, TOL[dtype])
    if dtype == torch.float32:
        assert_rel(got, glu_shrink_reference(e, g, a, 2.0, activation), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("rows, inter, ranks", [(37, 200, (8, 8, 8)), (70, 96, (16, 4, 12)), (3, 33, (4, 4, 2))])
def test_glu_lora_backward_matches_reference(poisoned, dtype, activation, rows, inter, ranks) -> None:
    r_g, r_u, r_d = ranks
    e, g, dh = (rand(rows, inter, dtype=dtype, seed=s) for s in (1, 2, 3))
    xa = rand(rows, r_g + r_u, dtype=dtype, seed=4)
    dyb = rand(rows, r_d, dtype=dtype, seed=5)
    e2, g2, e3, g3 = e.clone(), g.clone(), e.clone(), g.clone()
    de, dg, db_g, db_u, da_d = glu_lora_backward(dh, e, g, xa, r_g, dyb, activation)
    want = unfused()[1](dh, e2, g2, xa, r_g, dyb, activation)
    if dtype == torch.float32:
        for got, ref in zip((de, dg, db_g, db_u, da_d), glu_lora_backward_reference(dh, e3, g3, xa, r_g, dyb, activation)):
            assert_rel(got, ref, TOL[dtype])
    assert de.data_ptr() == e.data_ptr() and dg.data_ptr() == g.data_ptr()  # written in place
    assert (db_g.shape, db_u.shape, da_d.shape) == ((inter, r_g), (inter, r_u), (r_d, inter))
    tol = TOL[dtype]
    for got, ref in zip((de, dg, db_g, db_u, da_d), want):
        assert_rel(got, ref, tol)
    # The in-place outputs are exactly the separate GLU backward's (same fp32 math, one rounding).
    assert torch.equal(de, want[0]) and torch.equal(dg, want[1])


def test_glu_lora_backward_bumps_versions() -> None:
    e, g, dh = (rand(4, 32, dtype=torch.float32, seed=s) for s in (1, 2, 3))
    versions = (e._version, g._version)
    glu_lora_backward(dh, e, g, rand(4, 8, dtype=torch.float32), 4, rand(4, 4, dtype=torch.float32), "swiglu")
    assert e._version > versions[0] and g._version > versions[1]


def test_rejects_strided_columns() -> None:
    e = rand(8, 64, dtype=torch.float32)[:, ::2]
    with pytest.raises(ValueError, match="unit column stride"):
        glu_shrink(e, e, rand(4, 32, dtype=torch.float32), 1.0, "swiglu")
