"""The LoRA MLP's GLU backward fused with the rank-r products around it (`kernels.lora._LoRAMLP`).

For h = act(E) * G (E = gate(X), G = up(X)), Y = down(h), each a LoRA projection, given
dh_base = dY W_d and the down adapter's P = s_d dY B_d, the backward through the GLU is

    dh   = dh_base + P A_d                        (M, I)
    dE   = dh * G * act'(E)                       (M, I), written over E
    dG   = dh * act(E)                            (M, I), written over G
    dA_d = P^T h                                  (r, I)
    DYB  = [dE B_g | dG B_u]                      (M, 2r)  (the caller scales by s_g, s_u)
    dB_g = dE^T XG,   dB_u = dG^T XU              (I, r)   XG = s_g X A_g^T, XU = s_u X A_u^T

act(E) is rounded to E's dtype before use, and h, dE, dG are rounded to it before entering a
product, as the unfused path stores them. Unfused, each rank-r product reads or writes a whole
(M, I) tensor again: five more passes over 117 MB a layer on the 8B shape. Here each (BM, BN)
tile of E, G and dh_base is read once and dE, dG written once; the expansion P A_d is added in
registers; DYB is summed over the program's columns in registers, and the column-wise sums
(dA_d, dB_g, dB_u) across row blocks with fp32 atomic adds (their summation order, so their
last bits, vary from run to run). Grid: (row blocks, column groups).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._launch import launch
from kernels._utils import cdiv, interpreted, next_pow2
from kernels.glu import _act_and_grad as _act_and_grad_tl

_BM, _BN, _GROUPS, _WARPS = 128, 32, 8, 8  # rows and columns a tile, column groups, warps
MAX_RANK = 64  # a wider adapter takes the unfused path (registers)


@triton.jit
def _dot(a, b, DOT16: tl.constexpr):
    """a @ b with an fp32 result: 16-bit operands on the GPU, fp32 ones in the interpreter (whose
    16-bit dot is not exact)."""
    if DOT16:
        return tl.dot(a, b)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _glu_lora_bwd_kernel(
    E, G, DH, P, AD, BG, BU, XG, XU, DYB, DAD, DBG, DBU,
    M, I, R, s_e, s_g, s_dh, s_p, s_ad, s_bg, s_bu, s_xg, s_xu,
    TILES: tl.constexpr,  # column tiles a program: constexpr, as the interpreter (numpy >= 2.4)
    # cannot loop to a runtime bound (triton-lang/triton#9171); one compile per model width
    GELU: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, RP: tl.constexpr, DOT16: tl.constexpr,
):
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    ks = tl.arange(0, RP)
    rmask, kmask = rows < M, ks < R
    rk = rmask[:, None] & kmask[None, :]
    p = tl.load(P + rows[:, None] * s_p + ks[None, :], mask=rk, other=0.0).to(E.dtype.element_ty)
    xg = tl.load(XG + rows[:, None] * s_xg + ks[None, :], mask=rk, other=0.0).to(E.dtype.element_ty)
    xu = tl.load(XU + rows[:, None] * s_xu + ks[None, :], mask=rk, other=0.0).to(E.dtype.element_ty)
    acc_g = tl.zeros((BM, RP), dtype=tl.float32)
    acc_u = tl.zeros((BM, RP), dtype=tl.float32)
    for t in range(0, TILES):
        # Programs of one column group start at different tiles: those running side by side
        # then add into different columns of dA_d, dB_g, dB_u (fewer atomics on one address).
        tile = (t + tl.program_id(0)) % TILES
        cols = (tl.program_id(1) * TILES + tile) * BN + tl.arange(0, BN)
        cmask = cols < I
        ck = cmask[:, None] & kmask[None, :]
        kc = kmask[:, None] & cmask[None, :]
        inside = rmask[:, None] & cmask[None, :]
        ad = tl.load(AD + ks[:, None] * s_ad + cols[None, :], mask=kc, other=0.0).to(E.dtype.element_ty)
        bg = tl.load(BG + cols[:, None] * s_bg + ks[None, :], mask=ck, other=0.0).to(E.dtype.element_ty)
        bu = tl.load(BU + cols[:, None] * s_bu + ks[None, :], mask=ck, other=0.0).to(E.dtype.element_ty)
        dh = tl.load(DH + rows[:, None] * s_dh + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        dh += _dot(p, ad, DOT16)
        e = tl.load(E + rows[:, None] * s_e + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        g = tl.load(G + rows[:, None] * s_g + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        act, dact = _act_and_grad_tl(e, GELU)
        act = act.to(E.dtype.element_ty).to(tl.float32)
        h = (act * g).to(E.dtype.element_ty)
        de = (dh * g * dact).to(E.dtype.element_ty)
        dg = (dh * act).to(E.dtype.element_ty)
        tl.store(E + rows[:, None] * s_e + cols[None, :], de, mask=inside)
        tl.store(G + rows[:, None] * s_g + cols[None, :], dg, mask=inside)
        acc_g += _dot(de, bg, DOT16)
        acc_u += _dot(dg, bu, DOT16)
        tl.atomic_add(DBG + cols[:, None] * R + ks[None, :], _dot(tl.trans(de), xg, DOT16), mask=ck)
        tl.atomic_add(DBU + cols[:, None] * R + ks[None, :], _dot(tl.trans(dg), xu, DOT16), mask=ck)
        tl.atomic_add(DAD + ks[:, None] * I + cols[None, :], _dot(tl.trans(p), h, DOT16), mask=kc)
    tl.atomic_add(DYB + rows[:, None] * (2 * R) + ks[None, :], acc_g, mask=rk)
    tl.atomic_add(DYB + rows[:, None] * (2 * R) + R + ks[None, :], acc_u, mask=rk)


def act_and_grad(e: torch.Tensor, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(e), act'(e)) in e's dtype (call with fp32), PyTorch.
    silu(e) = e s, s = sigmoid(e):                silu'(e) = s (1 + e (1 - s))
    gelu_tanh(e) = e s, s = sigmoid(2z), z = sqrt(2/pi) (e + 0.044715 e^3):
                                                  gelu_tanh'(e) = s + 2 e s (1 - s) dz/de"""
    if not gelu:
        s = torch.sigmoid(e)
        return e * s, s * (1.0 + e * (1.0 - s))
    c = 0.7978845608028654
    s = torch.sigmoid(2.0 * c * (e + 0.044715 * e * e * e))
    return e * s, s + 2.0 * e * s * (1.0 - s) * c * (1.0 + 3.0 * 0.044715 * e * e)


Result = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def glu_lora_backward_reference(
    e: torch.Tensor, g: torch.Tensor, dh_base: torch.Tensor, p: torch.Tensor, a_d: torch.Tensor,
    b_g: torch.Tensor, b_u: torch.Tensor, xg: torch.Tensor, xu: torch.Tensor, gelu: bool,
) -> Result:
    """The module docstring's math in PyTorch (fp32, the same roundings as the kernel); dE, dG
    are written over e, g. Returns (DYB (M, 2r), dA_d (r, I), dB_g (I, r), dB_u (I, r)), fp32."""
    dtype = e.dtype
    f = [t.to(dtype).float() for t in (p, a_d, b_g, b_u, xg, xu)]
    p32, ad32, bg32, bu32, xg32, xu32 = f
    dh = dh_base.float() + p32 @ ad32
    act, dact = act_and_grad(e.float(), gelu)
    act = act.to(dtype).float()
    gf = g.float()
    h = (act * gf).to(dtype).float()
    de = (dh * gf * dact).to(dtype)
    dg = (dh * act).to(dtype)
    e.copy_(de)
    g.copy_(dg)
    de32, dg32 = de.float(), dg.float()
    dyb = torch.cat([de32 @ bg32, dg32 @ bu32], dim=1)
    return dyb, p32.t() @ h, de32.t() @ xg32, dg32.t() @ xu32


def glu_lora_backward(
    e: torch.Tensor, g: torch.Tensor, dh_base: torch.Tensor, p: torch.Tensor, a_d: torch.Tensor,
    b_g: torch.Tensor, b_u: torch.Tensor, xg: torch.Tensor, xu: torch.Tensor, gelu: bool,
) -> Result:
    """The fused backward (module docstring) on CUDA / the interpreter: e, g, dh_base (M, I)
    with unit column stride; p, xg, xu (M, r); a_d (r, I); b_g, b_u (I, r); r <= MAX_RANK. dE
    and dG are written over e and g (their version counters bumped). Returns (DYB (M, 2r),
    dA_d (r, I), dB_g (I, r), dB_u (I, r)) in fp32."""
    m, i = e.shape
    r = p.shape[1]
    for t in (e, g, dh_base, p, a_d, b_g, b_u, xg, xu):
        if t.stride(-1) != 1:
            raise ValueError("glu_lora_backward needs unit column strides")
    dyb = torch.zeros((m, 2 * r), device=e.device, dtype=torch.float32)
    dad = torch.zeros((r, i), device=e.device, dtype=torch.float32)
    dbg = torch.zeros((i, r), device=e.device, dtype=torch.float32)
    dbu = torch.zeros((i, r), device=e.device, dtype=torch.float32)
    if m and i:
        groups = min(_GROUPS, cdiv(i, _BN))
        tiles = cdiv(cdiv(i, _BN), groups)
        dot16 = e.dtype in (torch.bfloat16, torch.float16) and not interpreted()
        launch(
            _glu_lora_bwd_kernel, (cdiv(m, _BM), groups),
            e, g, dh_base, p, a_d, b_g, b_u, xg, xu, dyb, dad, dbg, dbu,
            m, i, r, e.stride(0), g.stride(0), dh_base.stride(0), p.stride(0), a_d.stride(0),
            b_g.stride(0), b_u.stride(0), xg.stride(0), xu.stride(0), tiles,
            gelu, _BM, _BN, max(16, next_pow2(r)), dot16, num_warps=_WARPS,
        )
    torch.autograd.graph.increment_version(e)
    torch.autograd.graph.increment_version(g)
    return dyb, dad, dbg, dbu
