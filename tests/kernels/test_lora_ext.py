"""The adapter folded into the base product's reduction (kernels.lora_ext) for NF4 gate/up:
X_ext's copy and shrink, W_ext's layout and its reuse, the strided NF4 dequantization, and
lora_mlp over it against fp32 math on the dequantized weights and the separate-adapter path."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import lora_ext, nf4
from kernels.lora import LoRAWeights, lora_mlp
from tests.kernels.test_lora import _close, _run

peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

HIDDEN, INTER = 128, 80  # rows of W_ext are whole NF4 blocks (64); INTER is not
MLP = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True)
def _fresh_workspace() -> None:
    nf4.WORKSPACE.clear()
    lora_ext.forget()


def _nf4_mlp(dtype: torch.dtype, ranks: dict[str, int] | None = None, alphas: dict[str, int] | None = None) -> nn.Module:
    torch.manual_seed(0)
    block = nn.Module()
    for name, (i, o) in zip(MLP, ((HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN))):
        q = bnb.nn.Linear4bit(i, o, bias=False, compute_dtype=dtype, quant_type="nf4")
        dense = torch.randn(o, i) / i**0.5
        q.weight = bnb.nn.Params4bit(dense.to(dtype), requires_grad=False, compress_statistics=True, quant_type="nf4")
        setattr(block, name, q)
    block = block.to("cpu")  # quantizes
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(MLP),
                             rank_pattern=ranks or {}, alpha_pattern=alphas or {})
    block = peft.inject_adapter_in_model(config, block)
    for name in MLP:
        nn.init.normal_(getattr(block, name).lora_B["default"].weight, std=0.2)
    return block


def _weights(block: nn.Module) -> list[LoRAWeights]:
    return [LoRAWeights.from_peft(getattr(block, n))[0] for n in MLP]


def _params(block: nn.Module) -> list[torch.Tensor]:
    return [p for n in MLP for p in (getattr(block, n).lora_A["default"].weight, getattr(block, n).lora_B["default"].weight)]


def _x(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn((2, 9, HIDDEN), generator=torch.Generator().manual_seed(2)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_shrink(backend: str, dtype: torch.dtype, poisoned: None) -> None:
    # Rank 12 + 5 (not a power of two, R < 16 padded inside the kernel), two scalings, M = 37.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 2 * HIDDEN, generator=gen).to(dtype)[:, :HIDDEN]  # rows 2H apart
    a = (torch.randn(17, HIDDEN, generator=gen) / HIDDEN**0.5).to(dtype)
    out = lora_ext.copy_shrink(x, a, [12, 5], [0.5, 3.0])
    assert out.shape == (37, HIDDEN + 17) and out.is_contiguous()
    assert torch.equal(out[:, :HIDDEN], x)
    expected = x.double() @ a.double().t() * torch.tensor([0.5] * 12 + [3.0] * 5, dtype=torch.float64)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    _close([out[:, HIDDEN:]], [expected], tol)


def test_strided_dequantize_writes_exactly_its_rows(backend: str) -> None:
    w = torch.randn(24, HIDDEN)
    packed, state = bnb.functional.quantize_4bit(w, quant_type="nf4", compress_statistics=True)
    buf = torch.full((30, HIDDEN + 7), float("nan"))
    nf4.dequantize(packed, state, out=buf[3:27, :HIDDEN])
    assert torch.equal(buf[3:27, :HIDDEN], nf4.dequantize_reference(packed, state, torch.float32))
    assert buf[:3].isnan().all() and buf[27:].isnan().all() and buf[:, HIDDEN:].isnan().all()
    with pytest.raises(ValueError, match="unit column stride"):
        nf4.dequantize(packed, state, out=torch.empty(HIDDEN, 24).t())
    narrow, narrow_state = bnb.functional.quantize_4bit(torch.randn(24, 96), quant_type="nf4")
    with pytest.raises(ValueError, match="multiple of 64"):  # a quant block would straddle two rows
        nf4.dequantize(narrow, narrow_state, out=torch.empty(24, 128)[:, :96])
    with pytest.raises(ValueError, match="shape"):
        nf4.dequantize(packed, state, out=torch.empty(24, HIDDEN + 64)[:, :HIDDEN + 1])


def test_weight_ext_layout(backend: str) -> None:
    block = _nf4_mlp(torch.float32, ranks={"up_proj": 4})
    gate, up, _ = _weights(block)
    buf = torch.full((2 * INTER, HIDDEN + 12), float("nan"))
    nf4.WORKSPACE.get((2 * INTER, HIDDEN + 12), torch.device("cpu"), torch.float32).copy_(buf)  # poison it
    w_ext = lora_ext.weight_ext([gate.weight, up.weight], [gate.quant_state, up.quant_state],
                                [gate.lora_B, up.lora_B], torch.float32)
    expected = torch.zeros(2 * INTER, HIDDEN + 12)
    expected[:INTER, :HIDDEN] = nf4.dequantize_reference(gate.weight, gate.quant_state, torch.float32)
    expected[INTER:, :HIDDEN] = nf4.dequantize_reference(up.weight, up.quant_state, torch.float32)
    expected[:INTER, HIDDEN : HIDDEN + 8] = gate.lora_B
    expected[INTER:, HIDDEN + 8 :] = up.lora_B
    assert torch.equal(w_ext, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where", ["shared", "own"])
def test_lora_mlp_ext_matches_peft_and_separate_path(
    backend: str, dtype: torch.dtype, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    block = _nf4_mlp(dtype, ranks={"up_proj": 4}, alphas={"gate_proj": 24})
    params = _params(block)
    fused = lambda x: lora_mlp(x, *_weights(block))  # noqa: E731
    monkeypatch.setenv("KESTREL_LORA_EXT", "off")
    separate = _run(fused, _x(dtype), params)
    monkeypatch.setenv("KESTREL_LORA_EXT", where)
    calls = []
    monkeypatch.setattr(lora_ext, "copy_shrink", lambda *a, _f=lora_ext.copy_shrink: calls.append(1) or _f(*a))
    got = _run(fused, _x(dtype), params)
    assert calls == [1]  # the folded path ran
    # The truth: fp32 over the dequantized weights (bitsandbytes 0.50's CPU dequantization is
    # wrong where quant blocks straddle rows, as in down_proj here, so PEFT on it is no oracle).
    truth = _run(_dense_mlp(block), _x(dtype).float(), params)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for reference in (separate, truth):
        _close(got[0], reference[0], tol)
        _close(got[1], reference[1], tol)


def _dense_mlp(block: nn.Module):
    """PEFT's MLP math in fp32 with each base weight replaced by its exact dequantization."""
    def proj(name: str, x: torch.Tensor) -> torch.Tensor:
        layer = getattr(block, name)
        weight = layer.get_base_layer().weight
        dense = nf4.dequantize_reference(weight, weight.quant_state, torch.float32)
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        return x @ dense.t() + (x @ a.float().t()) @ b.float().t() * layer.scaling["default"]

    return lambda x: proj("down_proj", F.silu(proj("gate_proj", x)) * proj("up_proj", x))


def test_own_buffer_is_reused_until_a_weight_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_LORA_EXT", "own")
    block = _nf4_mlp(torch.float32)
    gate, up, down = _weights(block)
    params = _params(block)
    dequantized = []
    real = nf4.dequantize
    monkeypatch.setattr(nf4, "dequantize", lambda w, *a, **k: dequantized.append(w) or real(w, *a, **k))

    def step() -> list[torch.Tensor]:
        return _run(lambda x: lora_mlp(x, gate, up, down), _x(torch.float32), params)[1]

    step()
    # Forward: gate, up (W_ext), down; backward: down only (W_ext is still what it was built from).
    assert [id(w) for w in dequantized] == [id(gate.weight), id(up.weight), id(down.weight), id(down.weight)]
    with torch.no_grad():
        up.lora_B.add_(0.5)  # an optimizer step: W_ext's copy of B is stale
    dequantized.clear()
    got = step()
    assert [id(w) for w in dequantized][:2] == [id(gate.weight), id(up.weight)]
    monkeypatch.setenv("KESTREL_LORA_EXT", "off")
    _close(got, step(), 1e-5)


def test_ext_needs_nf4_and_whole_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    block = _nf4_mlp(torch.float32)
    gate, up, down = _weights(block)
    assert lora_ext.usable([gate.weight, up.weight], [gate.quant_state, up.quant_state], HIDDEN)
    assert not lora_ext.usable([down.weight], [down.quant_state], INTER)  # 80 is not whole blocks
    assert not lora_ext.usable([torch.zeros(INTER, HIDDEN)], [None], HIDDEN)
    monkeypatch.setenv("KESTREL_LORA_EXT", "off")
    assert not lora_ext.usable([gate.weight], [gate.quant_state], HIDDEN)
    monkeypatch.setenv("KESTREL_LORA_EXT", "everywhere")
    with pytest.raises(ValueError, match="KESTREL_LORA_EXT"):
        lora_ext.usable([gate.weight], [gate.quant_state], HIDDEN)


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["shared", "own"])
def test_cuda_ext_matches_separate_path(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import bitsandbytes.functional as bnbf

    torch.manual_seed(0)
    ws = []
    for i, o in ((256, 320), (256, 320), (320, 256)):
        packed, state = bnbf.quantize_4bit(torch.randn(o, i, device="cuda", dtype=torch.bfloat16) / i**0.5,
                                           compress_statistics=True, quant_type="nf4")
        a = (torch.randn(16, i, device="cuda") / i**0.5).requires_grad_()
        b = (torch.randn(o, 16, device="cuda") * 0.2).requires_grad_()
        ws.append(LoRAWeights(packed, state, a, b, 2.0))
    params = [t for w in ws for t in (w.lora_A, w.lora_B)]
    x = torch.randn(3, 101, 256, device="cuda").bfloat16()
    monkeypatch.setenv("KESTREL_LORA_EXT", "off")
    separate = _run(lambda x: lora_mlp(x, *ws), x, params)
    monkeypatch.setenv("KESTREL_LORA_EXT", where)
    for _ in range(2):  # the second step finds W_ext built ("own")
        got = _run(lambda x: lora_mlp(x, *ws), x, params)
        _close(got[0], separate[0], 1e-2)
        _close(got[1], separate[1], 1e-2)
