"""The GLU with the adapters' rank-r terms inside (`kestrel.kernels.glu_lowrank`) against the plain GLU of
the summed products: E' = E + U_e V_e^T and G' = G + U_g V_g^T formed in fp64, then Hugging Face's activation
times G'; and its in-place backward against autograd through that. Ranks below, at and above one dot step
(16, 32), with strided U (a column slice of the group's shrink product) and shapes off the tile grid."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from kestrel.kernels.glu_lowrank import DEFAULT_TILES, Tiles, glu_lowrank, glu_lowrank_backward_
from tests.kernels.tolerance import assert_close

# M, I, r: ranks under one dot step (8, 1), at one (16), over two with a masked rest (40), two whole steps (64)
SHAPES = [(14, 72, 8), (70, 130, 16), (3, 200, 40), (33, 150, 64), (1, 1, 1)]

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _inputs(m: int, i: int, r: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    e = (3.0 * torch.randn(m, i, generator=gen)).to(dtype)
    g = torch.randn(m, i, generator=gen).to(dtype)
    xa = (torch.randn(m, 2 * r, generator=gen) / r**0.5).to(dtype)  # [U_e | U_g], as the shrink product lays them out
    ve, vg = ((torch.randn(i, r, generator=gen)).to(dtype) for _ in range(2))
    dh = torch.randn(m, i, generator=gen).to(dtype)
    return e, g, (xa[:, :r], xa[:, r:]), (ve, vg), dh


def _truth(e, g, us, vs, dh, act_name: str):
    """h and (dE', dG') through autograd over fp64 E', G' (the activation rounded to the input dtype, as HF)."""
    ep = (e.double() + us[0].double() @ vs[0].double().t()).requires_grad_()
    gp = (g.double() + us[1].double() @ vs[1].double().t()).requires_grad_()
    act = ACT2FN[act_name](ep)
    rounded = act + (act.to(e.dtype).double() - act).detach()  # HF's rounding, its gradient untouched
    h = rounded * gp
    de, dg = torch.autograd.grad(h, (ep, gp), dh.double())
    return h.to(e.dtype), de.to(e.dtype), dg.to(e.dtype)


# The shipped tiles and a sweep's other candidates (`bench/glu_lowrank_tiles.py`)
TILINGS = [DEFAULT_TILES, Tiles(64, 128, 8), Tiles(16, 64, 4, 3), Tiles(8, 256, 2, 8)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gelu", [False, True], ids=["swiglu", "geglu"])
@pytest.mark.parametrize("tiles", TILINGS, ids=lambda t: f"{t.rows}x{t.cols}w{t.warps}s{t.row_steps}")
def test_forward_and_in_place_backward_match_the_summed_products(backend, poisoned, shape, dtype, gelu, tiles) -> None:
    e, g, us, vs, dh = _inputs(*shape, dtype)
    h_true, de_true, dg_true = _truth(e, g, us, vs, dh, "gelu_pytorch_tanh" if gelu else "silu")
    h = glu_lowrank(e, g, us, vs, gelu, tiles)
    assert h.dtype == dtype and torch.isfinite(h).all()
    assert_close(h, h_true)
    e_storage, g_storage = e.data_ptr(), g.data_ptr()
    de, dg = glu_lowrank_backward_(dh, e, g, us, vs, gelu, tiles)
    assert de.data_ptr() == e_storage and dg.data_ptr() == g_storage  # written over E and G
    assert_close(de, de_true)
    assert_close(dg, dg_true)


def test_gate_and_up_may_have_ranks_of_their_own(backend) -> None:
    e, g, _, _, dh = _inputs(20, 150, 8, torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    us = (torch.randn(20, 8, generator=gen), torch.randn(20, 40, generator=gen))  # r_e 8, r_g 40: two dot steps
    vs = (torch.randn(150, 8, generator=gen), torch.randn(150, 40, generator=gen))
    h_true, de_true, dg_true = _truth(e, g, us, vs, dh, "silu")
    assert_close(glu_lowrank(e, g, us, vs, False), h_true)
    de, dg = glu_lowrank_backward_(dh, e, g, us, vs, False)
    assert_close(de, de_true)
    assert_close(dg, dg_true)


def test_the_rank_terms_are_added_in_fp32_not_lost_to_a_16_bit_product(monkeypatch) -> None:
    # An update under half a bf16 unit of G: rounded into G first it would vanish; here it moves h. The math of
    # both implementations (the fp32 cases above hold the kernel to the reference at fp32 tolerance); checked on
    # the reference, since the interpreter rounds fp32 to bf16 toward zero, where CUDA rounds to nearest.
    monkeypatch.setenv("KESTREL_KERNELS", "torch")
    e = torch.full((4, 32), 3.0, dtype=torch.bfloat16)
    g = torch.full((4, 32), 1.0, dtype=torch.bfloat16)
    u = torch.full((4, 16), 2e-4, dtype=torch.bfloat16)
    v = torch.ones(32, 16, dtype=torch.bfloat16)
    zero = torch.zeros_like(u)
    with_update = glu_lowrank(e, g, (zero, u), (v, v), gelu=False)  # G' = 1 + 0.0032, E' = E
    without = glu_lowrank(e, g, (zero, zero), (v, v), gelu=False)
    assert torch.equal((g.float() + 0.0032).to(torch.bfloat16), g)  # rounded into G, the update is gone...
    assert (with_update.float() > without.float()).all()  # ...added in fp32, silu(3) (1.0032) rounds a unit up


def test_mismatched_operands_are_refused() -> None:
    e, g, us, vs, _ = _inputs(6, 20, 4, torch.float32)
    with pytest.raises(ValueError, match="must have one shape"):
        glu_lowrank(e, g[:, :10], us, vs, False)
    with pytest.raises(ValueError, match="V_e"):
        glu_lowrank(e, g, us, (vs[0][:10], vs[1]), False)
    with pytest.raises(ValueError, match="V_g"):
        glu_lowrank(e, g, us, (vs[0], vs[1][:, :3]), False)
    with pytest.raises(ValueError, match="dh"):
        glu_lowrank_backward_(e[:3], e, g, us, vs, False)


def test_kernels_compile_for_sm90_with_tensor_core_dots_for_16_bit_operands() -> None:
    """Forward and backward, on two tilings, 16-bit and fp32 operands, U and V loading as wide vectors, ranks under, at and over one dot step, through Triton and
    ptxas for an H100/H200 (no GPU needed; its own process, uninterpreted: the interpreter runs what the compiler
    refuses). 16-bit operands take tensor-core instructions; fp32 ones (exact products) none."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.support.sm90_compile", "glu_lowrank"], capture_output=True,
                          text=True, env=env, cwd=Path(__file__).resolve().parents[2], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    mma, narrow = ([int(c) for c in line.split()] for line in lines[-2:])
    for k in range(0, 16, 4):  # (shipped tiles, 32 x 128 x 4 steps) x (fwd, bwd): bf16 r16, bf16 r8 (GeGLU), fp16 r64,
        kernel = mma[k:k + 4]  # fp32 r16
        assert kernel[0] > 0 and kernel[1] > 0 and kernel[2] > kernel[0] and kernel[3] == 0
        # U's and V's rows load as wide vectors, never element by element, the rank a whole number of dot steps
        # (16, 64) or not (8)
        assert narrow[k:k + 3] == [0, 0, 0], f"variants {k}..{k + 2}: {narrow[k:k + 3]} two-byte loads"
