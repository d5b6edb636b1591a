"""Fused LoRA (kernels/lora.py) against PEFT itself: outputs and the gradients of x and of every
lora_A / lora_B, for a linear, Q/K/V and a gated MLP, over 16-bit and NF4 base weights."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kestrel.kernels import nf4
from kestrel.kernels.lora.lora import LoRAWeights, lora_linear, lora_projections, lora_qkv
from kestrel.kernels.lora.mlp import lora_mlp

peft = pytest.importorskip("peft")

HIDDEN, Q_OUT, KV_OUT, INTER = 40, 40, 24, 72  # small, not powers of two
QKV, MLP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj", "down_proj")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


class Block(nn.Module):
    """The projections of one Llama-like decoder layer, bias-free unless asked."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, Q_OUT, bias=bias)
        self.k_proj = nn.Linear(HIDDEN, KV_OUT, bias=bias)
        self.v_proj = nn.Linear(HIDDEN, KV_OUT, bias=bias)
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=bias)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=bias)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=bias)


def _peft_block(
    dtype: torch.dtype = torch.float32, adapter_dtype: torch.dtype | None = None, **cfg
) -> nn.Module:
    torch.manual_seed(0)
    block = Block(bias=cfg.pop("bias", False)).to(dtype)
    dropout = cfg.pop("lora_dropout", 0.0)
    config = peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=dropout, target_modules=[*QKV, *MLP], **cfg
    )
    block = peft.inject_adapter_in_model(config, block)
    for name in (*QKV, *MLP):
        layer = getattr(block, name)
        # PEFT starts B at zero, which would hide every mistake in the adapter path.
        nn.init.normal_(layer.lora_B["default"].weight, std=0.2)
        if adapter_dtype is not None:
            layer.lora_A["default"].to(adapter_dtype)
            layer.lora_B["default"].to(adapter_dtype)
    return block


def _weights(block: nn.Module, names: tuple[str, ...]) -> list[LoRAWeights]:
    out = []
    for name in names:
        w, reason = LoRAWeights.from_peft(getattr(block, name))
        assert w is not None, reason
        out.append(w)
    return out


def _adapter_params(block: nn.Module, names: tuple[str, ...]) -> list[torch.Tensor]:
    layers = [getattr(block, n) for n in names]
    return [p for l in layers for p in (l.lora_A["default"].weight, l.lora_B["default"].weight)]


def _run(fn, x: torch.Tensor, params: list[torch.Tensor], x_grad: bool = True):
    """Outputs of fn(x) and the gradients of sum_k <out_k, fixed random cotangent_k>."""
    x = x.detach().clone().requires_grad_(x_grad)
    outs = fn(x)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(1)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in outs)
    wrt = [x, *params] if x_grad else params
    return outs, torch.autograd.grad(loss, wrt)


def _close(got, expected, tol: float) -> None:
    """Elementwise, with absolute slack `tol` of each expected tensor's largest magnitude."""
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape
        scale = e.float().abs().max().item()
        torch.testing.assert_close(g.float(), e.float(), rtol=tol, atol=tol * scale)


def _x(dtype: torch.dtype, shape: tuple[int, ...] = (2, 7, HIDDEN)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)


def _check(
    block: nn.Module, names: tuple[str, ...], ours, reference, x: torch.Tensor,
    x_grad: bool = True, twin: nn.Module | None = None,
) -> None:
    """ours(weights) and reference(block) map x to outputs; compare outputs and gradients.

    fp32: against PEFT at 1e-5. 16-bit: PEFT's own run is itself ~1e-2 away from exact, so both
    ours and PEFT's are compared with an fp32 twin of the block (same bf16-valued weights) at
    1e-2: ours must be as accurate as the tolerance PEFT's 16-bit path is held to."""
    params = _adapter_params(block, names)
    got = _run(ours(_weights(block, names)), x, params, x_grad)
    expected = _run(reference(block), x, params, x_grad)
    for g, e in zip((*got[0], *got[1]), (*expected[0], *expected[1])):
        assert g.dtype == e.dtype
    if x.dtype == torch.float32 and not torch.is_autocast_enabled("cpu"):
        _close(got[0], expected[0], 1e-5)
        _close(got[1], expected[1], 1e-5)
        return
    twin = twin if twin is not None else copy.deepcopy(block).float()
    with torch.autocast("cpu", enabled=False):
        truth = _run(reference(twin), x.float(), _adapter_params(twin, names), x_grad)
    for result in (got, expected):
        _close(result[0], truth[0], 1e-2)
        _close(result[1], truth[1], 1e-2)


def _peft_mlp(activation: str):
    act = F.silu if activation == "swiglu" else (lambda t: F.gelu(t, approximate="tanh"))
    return lambda b: lambda x: b.down_proj(act(b.gate_proj(x)) * b.up_proj(x))


def _peft_qkv(b: nn.Module):
    return lambda x: (b.q_proj(x), b.k_proj(x), b.v_proj(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear_matches_peft(dtype: torch.dtype) -> None:
    ours = lambda ws: lambda x: lora_linear(x, ws[0])  # noqa: E731
    _check(_peft_block(dtype), ("q_proj",), ours, lambda b: b.q_proj, _x(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_qkv_matches_peft(dtype: torch.dtype) -> None:
    ours = lambda ws: lambda x: lora_qkv(x, *ws)  # noqa: E731
    _check(_peft_block(dtype), QKV, ours, _peft_qkv, _x(dtype))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_mlp_matches_peft(
    dtype: torch.dtype, activation: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KESTREL_KERNELS", backend)  # triton: the GLU kernels, interpreted on CPU
    ours = lambda ws: lambda x: lora_mlp(x, *ws, activation=activation)  # noqa: E731
    _check(_peft_block(dtype), MLP, ours, _peft_mlp(activation), _x(dtype))


@pytest.mark.parametrize("discard", [False, True], ids=["first-pass", "recompute"])
def test_a_16_bit_mlp_under_triton_adds_gate_and_up_adapters_inside_the_glu(discard: bool, monkeypatch) -> None:
    """E and G are the base products alone, and the GLU adds s (X A^T) B^T as it reads them (forward, then the
    in-place backward): the same values and gradients as PEFT, with no (M, I) expansion pass."""
    from kestrel.kernels import glu_lowrank
    from kestrel.kernels.lora import lora as lora_module

    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    calls: list[str] = []
    expands: list[bool] = []
    real_expand, real_fwd, real_bwd = lora_module._expand, glu_lowrank.glu_lowrank, glu_lowrank.glu_lowrank_backward_

    def expand(*args, adapter: bool = True, **kwargs):
        expands.append(adapter)
        return real_expand(*args, adapter=adapter, **kwargs)

    monkeypatch.setattr(lora_module, "_expand", expand)
    monkeypatch.setattr(glu_lowrank, "glu_lowrank", lambda *a, **k: calls.append("forward") or real_fwd(*a, **k))
    monkeypatch.setattr(glu_lowrank, "glu_lowrank_backward_", lambda *a, **k: calls.append("backward") or real_bwd(*a, **k))
    block = _peft_block(torch.float32)
    params = _adapter_params(block, MLP)
    got = _run(lambda x: lora_mlp(x, *_weights(block, MLP), discard_output=discard), _x(torch.float32), params)
    truth = _run(_peft_mlp("swiglu")(block), _x(torch.float32), params)
    assert calls.count("forward") >= 1 and calls.count("backward") == 1
    assert expands[:2] == [False, False]  # gate's and up's products: the base alone
    if not discard:
        _close(got[0], truth[0], 1e-5)
    _close(got[1], truth[1], 1e-5)


def test_fp32_adapters_over_bf16_base() -> None:
    # PEFT's default keeps adapters in fp32 over a bf16 model; gradients come back in fp32.
    block = _peft_block(torch.bfloat16, adapter_dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in _adapter_params(block, MLP))
    ours = lambda ws: lambda x: lora_mlp(x, *ws)  # noqa: E731
    _check(block, MLP, ours, _peft_mlp("swiglu"), _x(torch.bfloat16))


def test_autocast_bf16_matches_peft() -> None:
    ours = lambda ws: lambda x: lora_qkv(x, *ws)  # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _check(_peft_block(torch.float32), QKV, ours, _peft_qkv, _x(torch.float32))
        (q, _, _) = _weights(_peft_block(torch.float32), QKV)
        assert lora_linear(_x(torch.float32), q).dtype == torch.bfloat16


def test_input_without_grad_still_trains_adapters() -> None:
    ours = lambda ws: lambda x: lora_mlp(x, *ws)  # noqa: E731
    _check(_peft_block(), MLP, ours, _peft_mlp("swiglu"), _x(torch.float32), x_grad=False)


def test_mlp_backward_runs_once() -> None:
    block = _peft_block()
    gate, up, down = _weights(block, MLP)
    y = lora_mlp(_x(torch.float32).requires_grad_(), gate, up, down)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        y.sum().backward()


@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")
@pytest.mark.parametrize(
    ("cfg", "reason"),
    [
        ({"lora_dropout": 0.1}, "dropout"),
        ({"use_dora": True}, "DoRA"),
        ({"lora_bias": True}, "lora_B has a bias"),
    ],
)
def test_from_peft_refuses_unsupported(cfg: dict, reason: str) -> None:
    w, why = LoRAWeights.from_peft(_peft_block(**cfg).q_proj)
    assert w is None and reason in why


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`")
def test_from_peft_refuses_several_adapters_merged_and_plain_modules() -> None:
    block = _peft_block()
    layer = block.q_proj
    other = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    peft.inject_adapter_in_model(other, block, adapter_name="other")
    layer.set_adapter(["default", "other"])
    w, reason = LoRAWeights.from_peft(layer)
    assert w is None and reason == "2 active adapters (fused path takes exactly one)"
    layer.set_adapter("default")
    assert LoRAWeights.from_peft(layer)[0] is not None
    layer.merge()
    assert "merged" in LoRAWeights.from_peft(layer)[1]
    assert "not a PEFT LoRA layer" in LoRAWeights.from_peft(nn.Linear(4, 4))[1]


# --- NF4 base weights -----------------------------------------------------------------------


def _nf4_block(dtype: torch.dtype, device: str = "cpu") -> nn.Module:
    """Block with bitsandbytes Linear4bit projections (NF4, double quant), LoRA from PEFT."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    dense = Block().to(dtype)
    block = nn.Module()
    for name in (*QKV, *MLP):
        lin = getattr(dense, name)
        q = bnb.nn.Linear4bit(
            lin.in_features, lin.out_features, bias=False, compute_dtype=dtype, quant_type="nf4"
        )
        q.weight = bnb.nn.Params4bit(
            lin.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4"
        )
        setattr(block, name, q)
    block = block.to(device)  # quantizes
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=[*QKV, *MLP])
    block = peft.inject_adapter_in_model(config, block)
    for name in (*QKV, *MLP):
        nn.init.normal_(getattr(block, name).lora_B["default"].weight, std=0.2)
    return block


def _dense_twin(block: nn.Module) -> nn.Module:
    """fp32 PEFT block whose base weights are the NF4 weights dequantized (the exact truth)."""
    twin = _peft_block(torch.float32).to(next(block.parameters()).device)
    for name in (*QKV, *MLP):
        src, dst = getattr(block, name), getattr(twin, name)
        weight = src.get_base_layer().weight
        dense = nf4.dequantize_reference(weight, weight.quant_state, torch.float32)
        dst.get_base_layer().weight.data = dense
        for part in ("lora_A", "lora_B"):
            adapter = getattr(src, part)["default"].weight.data
            getattr(dst, part)["default"].weight.data = adapter.float()
    return twin


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nf4_base_equals_dequantized_base(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Same math over the same weight values: bit-identical in fp32 (NF4 dequant is exact there).
    monkeypatch.setenv("KESTREL_KERNELS", backend)
    block = _nf4_block(torch.float32)
    packed = _weights(block, MLP)
    assert all(w.quant_state is not None for w in packed)
    dense = [
        LoRAWeights(nf4.dequantize_reference(w.weight, w.quant_state), None, *w._flat()[2:])
        for w in packed
    ]
    params = _adapter_params(block, MLP)
    mlp = lambda ws: lambda x: lora_mlp(x, *ws)  # noqa: E731
    linear = lambda ws: lambda x: lora_linear(x, ws[0])  # noqa: E731
    for fn, wrt in ((mlp, params), (linear, params[:2])):
        got = _run(fn(packed), _x(torch.float32), wrt)
        expected = _run(fn(dense), _x(torch.float32), wrt)
        for g, e in zip((*got[0], *got[1]), (*expected[0], *expected[1])):
            torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_matches_peft_over_bitsandbytes(dtype: torch.dtype) -> None:
    block = _nf4_block(dtype)
    mlp = lambda ws: lambda x: lora_mlp(x, *ws)  # noqa: E731
    qkv = lambda ws: lambda x: lora_qkv(x, *ws)  # noqa: E731
    _check(block, MLP, mlp, _peft_mlp("swiglu"), _x(dtype), twin=_dense_twin(block))
    _check(block, QKV, qkv, _peft_qkv, _x(dtype), twin=_dense_twin(block))


def test_nf4_workspace_is_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    block = _nf4_block(torch.float32)
    gate, up, down = _weights(block, MLP)
    ptrs: list[int] = []
    real = nf4.dequantize

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        ptrs.append(out.data_ptr())
        return out

    monkeypatch.setattr(nf4, "dequantize", spy)
    nf4.WORKSPACE.clear()
    for _ in range(2):
        lora_mlp(_x(torch.float32).requires_grad_(), gate, up, down).sum().backward()
    # Forward dequantizes gate, up, down; backward down, gate, up: 12 calls, one buffer (the
    # largest weight is dequantized first, so the buffer never grows).
    assert len(ptrs) == 12 and len(set(ptrs)) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_bitsandbytes_peft_matches_fused(dtype: torch.dtype) -> None:
    block = _nf4_block(dtype, device="cuda")
    assert type(block.q_proj).__module__.startswith("peft.tuners.lora")
    x = _x(dtype, (3, 33, HIDDEN)).cuda()
    mlp = lambda ws: lambda x: lora_mlp(x, *ws)  # noqa: E731
    qkv = lambda ws: lambda x: lora_qkv(x, *ws)  # noqa: E731
    twin = _dense_twin(block)
    _check(block, MLP, mlp, _peft_mlp("swiglu"), x, twin=twin)
    _check(block, QKV, qkv, _peft_qkv, x, twin=twin)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_group_with_different_ranks_and_scalings_matches_peft(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # rank_pattern / alpha_pattern give one input's projections different ranks and scalings:
    # the stacked shrink product and the one dA product must split them back exactly (triton: and the GLU's
    # rank terms, gate's and up's of their own ranks).
    monkeypatch.setenv("KESTREL_KERNELS", backend)
    block = _peft_block(rank_pattern={"k_proj": 4, "up_proj": 12}, alpha_pattern={"v_proj": 5, "gate_proj": 3})
    scalings = {n: getattr(block, n).scaling["default"] for n in (*QKV, *MLP)}
    assert len({scalings[n] for n in QKV}) == 3 and len({scalings[n] for n in MLP[:2]}) == 2
    assert getattr(block, "k_proj").lora_A["default"].weight.shape[0] == 4
    _check(block, QKV, lambda ws: lambda x: lora_qkv(x, *ws), _peft_qkv, _x(torch.float32))
    _check(block, MLP, lambda ws: lambda x: lora_mlp(x, *ws), _peft_mlp("swiglu"), _x(torch.float32))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(("rows", "in_forward", "in_backward"), [(4, [], [4, 4, 4, 2]), (2048, [14], [])])
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_discarded_mlp_output_keeps_every_gradient(
    backend: str, rows: int, in_forward: list[int], in_backward: list[int], activation: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A checkpoint's recompute throws the MLP output's values away. With 14 tokens and chunks
    # of 4 rows, deferring pays: the forward computes nothing and the backward runs forward and
    # backward together in 3 full chunks and a partial one. In one chunk it would not: then the
    # down product is skipped and h is kept, not formed again. Either way x's and every
    # adapter's gradient are those of PEFT's MLP.
    from kestrel.kernels.lora import mlp as mlp_module

    monkeypatch.setenv("KESTREL_KERNELS", backend)
    monkeypatch.setattr(mlp_module, "DEFERRED_ROWS", rows)
    block = _peft_block()
    params = _adapter_params(block, MLP)
    expected = _run(_peft_mlp(activation)(block), _x(torch.float32), params)
    glu_rows: list[int] = []
    real = mlp_module._glu_forward
    monkeypatch.setattr(mlp_module, "_glu_forward", lambda e, *a: glu_rows.append(e.shape[0]) or real(e, *a))
    ours = lambda x: lora_mlp(x, *_weights(block, MLP), activation=activation, discard_output=True)  # noqa: E731
    x = _x(torch.float32).requires_grad_()
    y = ours(x)
    assert glu_rows == in_forward and y.shape == x.shape and y.requires_grad
    glu_rows.clear()
    got = _run(ours, _x(torch.float32), params)
    assert glu_rows == in_forward + in_backward  # h once per row
    _close(got[1], expected[1], 1e-5)
    # Without an input gradient (the first layer under frozen embeddings) only the adapters'.
    got = _run(ours, _x(torch.float32), params, x_grad=False)
    _close(got[1], expected[1][1:], 1e-5)


def test_deferring_pays_only_where_it_lowers_the_peak() -> None:
    # The Llama-8B MLP over NF4: keeping W'_g and W'_u (2 x 4096 x 14336) beats keeping E, G, h
    # for every row only beyond 2048 + 2 x 4096 / 3 rows; over a 16-bit base beyond one chunk.
    from kestrel.kernels.lora import mlp as mlp_module

    def proj(out: int, inp: int, nf4_base: bool) -> LoRAWeights:
        meta = torch.empty(out, inp, device="meta")
        state = type("State", (), {"shape": (out, inp)})() if nf4_base else None
        return LoRAWeights(meta, state, torch.empty(16, inp, device="meta"), torch.empty(out, 16, device="meta"), 2.0)

    for nf4_base, threshold in ((True, 2048 + 2 * 4096 // 3), (False, 2048)):
        gate, up = proj(14336, 4096, nf4_base), proj(14336, 4096, nf4_base)
        assert not mlp_module.lowers_peak(threshold, gate, up)
        assert mlp_module.lowers_peak(threshold + 1, gate, up)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deferred_mlp_in_16_bit_matches_peft(dtype: torch.dtype, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel.kernels.lora import mlp as mlp_module

    monkeypatch.setenv("KESTREL_KERNELS", backend)  # triton: the adapters' terms inside the GLU (glu_lowrank)
    monkeypatch.setattr(mlp_module, "DEFERRED_ROWS", 5)  # 14 tokens: deferred, in 3 chunks
    block = _peft_block(dtype)
    params = _adapter_params(block, MLP)
    got = _run(lambda x: lora_mlp(x, *_weights(block, MLP), discard_output=True), _x(dtype), params)
    twin = copy.deepcopy(block).float()
    truth = _run(_peft_mlp("swiglu")(twin), _x(dtype).float(), _adapter_params(twin, MLP))
    assert all(g.dtype == p.dtype for g, p in zip(got[1][1:], params))
    _close(got[1], truth[1], TOL[dtype])


@pytest.mark.parametrize("nf4_base", [False, True], ids=["16-bit", "nf4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_known_output_back_propagates_as_the_projection_without_its_product(
    nf4_base: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A checkpoint's recompute that kept the output projection's output (`keep_projection`): lora_linear_known
    # returns that output and gives lora_linear's gradients (x, A, B), and forms no base weight in its forward.
    from kestrel.kernels.lora import lora as lora_module
    from kestrel.kernels.lora.lora import lora_linear_known

    block = _nf4_block(dtype) if nf4_base else _peft_block(dtype)
    (w,) = _weights(block, ("down_proj",))
    params = _adapter_params(block, ("down_proj",))
    x = _x(dtype, (2, 7, w.in_features))
    expected = _run(lambda t: lora_linear(t, w), x, params)
    known = lora_linear(x, w).detach()
    bases: list[int] = []
    real_base = lora_module._base
    monkeypatch.setattr(lora_module, "_base", lambda *a: bases.append(1) or real_base(*a))
    monkeypatch.setattr(lora_module, "_merged", lambda *a, **k: pytest.fail("a known output formed W'"))
    got = _run(lambda t: lora_linear_known(t, w, known), x, params, x_grad=True)
    torch.testing.assert_close(got[0][0], expected[0][0], rtol=0, atol=0)  # the kept value itself
    for g, e in zip(got[1], expected[1]):
        torch.testing.assert_close(g, e, rtol=TOL[dtype], atol=TOL[dtype])
    assert len(bases) == 1  # the backward's dX product only: none in the forward


@pytest.mark.parametrize("nf4_base", [False, True], ids=["16-bit", "nf4"])
def test_known_qkv_outputs_back_propagate_as_their_projections(nf4_base: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # A checkpoint's recompute that kept Q, K and V (`keep_qkv`): lora_projections_known returns them, each a
    # fresh tensor (RoPE then turns q and k in place), and gives lora_projections' gradients, with no base product.
    from kestrel.kernels.lora import lora as lora_module
    from kestrel.kernels.lora.lora import lora_projections_known

    dtype, names = torch.float32, ("q_proj", "k_proj", "v_proj")
    block = _nf4_block(dtype) if nf4_base else _peft_block(dtype)
    ws = tuple(_weights(block, names))
    params = _adapter_params(block, names)
    x = _x(dtype, (2, 7, ws[0].in_features))
    expected = _run(lambda t: lora_projections(t, *ws), x, params)
    known = tuple(y.detach() for y in lora_projections(x, *ws))
    monkeypatch.setattr(lora_module, "_merged", lambda *a, **k: pytest.fail("known outputs formed W'"))

    def recompute(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = lora_projections_known(t, ws, known)
        return q.mul_(1.0), k, v  # in place, as RoPE: allowed on the Function's outputs

    got = _run(recompute, x, params)
    for g, e in zip(got[0], expected[0], strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    for g, e in zip(got[1], expected[1], strict=True):
        torch.testing.assert_close(g, e, rtol=TOL[dtype], atol=TOL[dtype])
