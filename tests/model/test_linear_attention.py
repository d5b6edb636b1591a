"""Qwen3.5's linear-attention layers pick their kernel per call: with flash-linear-attention
installed, HF binds its CUDA-only kernels at import, so an unpatched model on the CPU fails; the
patched layers run HF's PyTorch reference there, with HF's numbers and decode state."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

from kestrel.model.patching import patch_model
from tests.support.tiny import tiny_model

VOCAB = 256


def _cuda_only(reference):  # what HF binds when flash-linear-attention is installed
    @functools.wraps(reference)
    def kernel(*args, **kwargs):
        raise RuntimeError("0 active drivers: a Triton kernel on a CPU tensor")

    return kernel


def test_patched_linear_attention_runs_where_hfs_bound_kernel_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
    model = tiny_model("qwen3_5_text", VOCAB, seed=1)
    with torch.no_grad():
        want = model(input_ids=ids).logits  # HF's reference functions (tests/conftest.py)
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        monkeypatch.setattr(qwen3_5, name, _cuda_only(getattr(qwen3_5, name)))
    with pytest.raises(RuntimeError, match="active drivers"), torch.no_grad():
        model(input_ids=ids)
    patch_model(model)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, want, rtol=1e-5, atol=1e-5)
        # prefill, then one cached step: the recurrent form on the state the chunked form left
        out = model(input_ids=ids[:, :-1], use_cache=True)
        step = model(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, want[:, -1], rtol=1e-4, atol=1e-4)


class _RefusingBackward(torch.autograd.Function):
    """A chunked kernel whose forward runs and whose backward refuses, as flash-linear-attention
    0.6's does on Hopper under Triton 3.4-3.7.0."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta):  # type: ignore[no-untyped-def]
        return q * 1.0

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results\nmore")


def _refusing_chunk(q, k, v, g, beta, **kwargs):  # type: ignore[no-untyped-def]
    return _RefusingBackward.apply(q, k, v, g, beta), None


def _working_chunk(q, k, v, g, beta, **kwargs):  # type: ignore[no-untyped-def]
    return q * beta[..., None] + k * v + g[..., None], None


@pytest.mark.parametrize(("chunk", "trains"), [(_refusing_chunk, False), (_working_chunk, True)])
def test_fla_trains_only_where_its_backward_runs(chunk, trains: bool, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    from kestrel.model import linear_attention as la

    la.fla_backward_works.cache_clear()
    ops = (chunk, _working_chunk)
    monkeypatch.setattr(la, "_fla_ops", lambda: ops)
    cpu = torch.device("cpu")
    with caplog.at_level("INFO", logger="kestrel"):
        assert la.fla_for(True, cpu, needs_grad=True) == (ops if trains else None)
        assert la.fla_for(True, cpu, needs_grad=True) == (ops if trains else None)  # probed once
    assert la.fla_for(True, cpu, needs_grad=False) == ops  # passes without gradients keep the kernels
    assert la.fla_for(False, cpu, needs_grad=False) is None  # CUDA-only
    # a first run on a machine tunes fla's kernels for minutes: the log says so before, once
    assert sum("takes minutes on a machine" in r.getMessage() for r in caplog.records) == 1
    warnings = [r.getMessage() for r in caplog.records if "cannot train" in r.getMessage()]
    assert len(warnings) == (0 if trains else 1)
    if warnings:
        assert "Hopper" in warnings[0] and "more" not in warnings[0]
    la.fla_backward_works.cache_clear()


def _scaled(factor: float):  # a stand-in whose output is off by `factor`
    def chunk(q, k, v, **kwargs):  # type: ignore[no-untyped-def]
        out, state = qwen3_5.torch_chunk_gated_delta_rule(q, k, v, **kwargs)
        return out * factor, state

    return chunk


def _raising(q, k, v, **kwargs):  # type: ignore[no-untyped-def]
    raise RuntimeError("an illegal memory access was encountered")


def _way(quality):  # type: ignore[no-untyped-def]
    """A stand-in whose refused stage's ways behave as `quality` says (way -> function)."""
    def chunk(q, k, v, dqkwg: str, **kwargs):  # type: ignore[no-untyped-def]
        return quality[dqkwg](q, k, v, **kwargs)
    return chunk


GOOD, OFF = _scaled(1.0), _scaled(1.2)


def _refusing_tile(q, k, v, **kwargs):  # type: ignore[no-untyped-def]
    from kestrel.kernels import gated_delta

    raise gated_delta.TileRefused("the stage's kernel runs only with a key tile of 128 here")


@pytest.mark.parametrize(("ways", "chosen", "says"), [
    ({"kernel": _refusing_tile, "torch": GOOD}, "torch", ["'kernel' way is not for this layer", "done the 'torch' way"]),
    ({"kernel": GOOD, "torch": GOOD}, "kernel", ["done the 'kernel' way"]),
    ({"kernel": OFF, "torch": GOOD}, "torch", ["'kernel' way", "is off on cpu (relative errors output 0.200",
                                               "done the 'torch' way"]),
    ({"kernel": _raising, "torch": GOOD}, "torch", ["'kernel' way", "failed on cpu (an illegal memory access",
                                                    "done the 'torch' way"]),
    ({"kernel": OFF, "torch": _raising}, None, ["'kernel' way", "is off on cpu", "'torch' way", "failed on cpu",
                                                "train on PyTorch's reference functions"]),
])
def test_the_stand_in_takes_the_first_way_whose_probe_matches_the_reference(
        ways, chosen: str | None, says: list[str], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The probe compares each way's output and five gradients with HF's reference (fp32) at the
    layer's head shape, fastest way first, once per (device, shape, dtype)."""
    from kestrel.kernels import gated_delta
    from kestrel.model import linear_attention as la

    la.stand_in_way.cache_clear()
    monkeypatch.setattr(gated_delta, "available", lambda: True)
    monkeypatch.setattr(gated_delta, "DQKWG", dict.fromkeys(("kernel", "torch")))
    monkeypatch.setattr(gated_delta, "chunk_gated_delta_rule", _way(ways))
    args = (torch.device("cpu"), 2, 8, 16, torch.float32, qwen3_5.torch_chunk_gated_delta_rule)
    with caplog.at_level("INFO", logger="kestrel"):
        fn = la.stand_in_way(*args)
        assert la.stand_in_way(*args) is fn
    assert (fn is None) if chosen is None else fn.keywords == {"dqkwg": chosen}
    said = " | ".join(r.getMessage() for r in caplog.records)
    position = 0
    for part in says:  # in this order, each once
        assert said.count(part) == 1 and said.index(part) >= position, (part, said)
        position = said.index(part)
    la.stand_in_way.cache_clear()


@pytest.mark.parametrize(("fla_trains", "stand_in_ok", "want"), [
    (True, True, "fla"), (False, True, "stand-in"), (False, False, "reference"),
])
def test_a_pass_needing_gradients_takes_the_stand_in_only_where_fla_refuses_and_the_probe_passes(
        fla_trains: bool, stand_in_ok: bool, want: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel.kernels import gated_delta
    from kestrel.model import linear_attention as la

    ops = (_working_chunk if fla_trains else _refusing_chunk, _working_chunk)
    monkeypatch.setattr(la, "_fla_ops", lambda: ops)
    monkeypatch.setattr(la, "fla_backward_works", lambda device, chunk: fla_trains)
    probed: list[tuple] = []
    stand_in = functools.partial(gated_delta.chunk_gated_delta_rule, dqkwg="kernel")
    monkeypatch.setattr(la, "stand_in_way", lambda *args: probed.append(args) or (stand_in if stand_in_ok else None))
    reference = qwen3_5.torch_chunk_gated_delta_rule
    cpu = torch.device("cpu")
    chosen = la.chunked_for(True, cpu, True, (4, 16, 32), torch.bfloat16, lambda: reference)
    assert chosen is {"fla": ops[0], "stand-in": stand_in, "reference": reference}[want]
    assert probed == ([] if fla_trains else [(cpu, 4, 16, 32, torch.bfloat16, reference)])
    assert la.chunked_for(True, cpu, False, (4, 16, 32), torch.bfloat16, lambda: reference) is ops[0]  # no gradients
    assert la.chunked_for(False, cpu, True, (4, 16, 32), torch.bfloat16, lambda: reference) is reference  # CUDA-only


@pytest.mark.gpu
def test_patched_qwen3_5_trains_on_cuda_with_whatever_fla_allows(monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """On CUDA with flash-linear-attention installed: the patched model's loss and gradients equal
    those of the same model on the PyTorch functions, whether the probe lets the kernel's backward
    run or not (flash-linear-attention 0.6 refuses it on Hopper under Triton 3.4-3.7.0), and every
    probe passes there: the layers ran on kernels, not on the fallbacks."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from kestrel.model import linear_attention as la

    if la._fla_ops() is None:
        pytest.skip("flash-linear-attention is not installed")
    la.fla_backward_works.cache_clear(), la.stand_in_way.cache_clear(), la.norm_kernel_agrees.cache_clear()
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    fast, ref = (tiny_model("qwen3_5_text", VOCAB, seed=1).cuda() for _ in range(2))
    patch_model(fast), patch_model(ref)
    with caplog.at_level("WARNING", logger="kestrel"):
        loss = fast(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    fallbacks = [r.getMessage() for r in caplog.records if r.name == "kestrel" and "cannot train" not in r.getMessage()]
    assert fallbacks == []
    monkeypatch.setenv("KESTREL_KERNELS", "torch")
    want = ref(input_ids=ids, labels=ids, use_cache=False).loss
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-3, atol=1e-3)
    for (name, p), q in zip(fast.named_parameters(), ref.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-3, msg=name)


def _norm_like_fla(calls: list[str]):  # flash-linear-attention's rms_norm_gated, in PyTorch
    def norm(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False,
             eps=1e-6):  # type: ignore[no-untyped-def]
        calls.append("norm")
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        return (y * F.silu(g.float())).to(x.dtype)

    return norm


def test_passes_without_a_cache_take_kestrels_convolution_and_the_norm_kernel_with_hfs_numbers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Passes without a cache take Kestrel's short convolution and, where flash-linear-attention's
    gated norm runs (stood in for here by the same math in PyTorch, with its call signature), hand
    it the norm's weight, epsilon and gate, so that logits and gradients equal HF's; passes with a
    cache keep HF's functions."""
    from kestrel.model import linear_attention as la

    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(3))
    ref, fast = (tiny_model("qwen3_5_text", VOCAB, seed=4) for _ in range(2))
    for m in (ref, fast):
        for name, p in m.named_parameters():  # HF starts the gated norm's weight at ones
            if "linear_attn.norm" in name:
                torch.nn.init.normal_(p, 1.0, 0.2, generator=torch.Generator().manual_seed(5))
    patch_model(fast)
    calls: list[str] = []
    norm, conv = _norm_like_fla(calls), la.short_conv

    def counted_conv(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append("conv")
        return conv(*args, **kwargs)

    monkeypatch.setattr(la, "short_conv", counted_conv)
    monkeypatch.setattr(la, "norm_kernel", lambda module, x, cache: None if cache is not None else norm)
    want = ref(input_ids=ids, labels=ids, use_cache=False)
    got = fast(input_ids=ids, labels=ids, use_cache=False)
    layers = sum(1 for m in fast.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    assert layers > 0 and calls == ["conv", "norm"] * layers
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5)  # the patched loss keeps no logits
    with torch.no_grad():
        torch.testing.assert_close(fast(input_ids=ids, use_cache=False).logits, want.logits, rtol=1e-5, atol=1e-5)
    want.loss.backward()
    got.loss.backward()
    for (name, p), q in zip(fast.named_parameters(), ref.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    calls.clear()
    with torch.no_grad():
        fast(input_ids=ids, use_cache=True)
    assert calls == []


def test_the_norm_kernel_serves_only_cuda_passes_without_a_cache_where_it_agrees(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel.model import linear_attention as la

    layer = next(m for m in tiny_model("qwen3_5_text", VOCAB, seed=1).modules() if hasattr(m, "conv1d"))
    kernel, agree = object(), [True]
    monkeypatch.setattr(la, "_fla_norm", lambda: kernel)
    monkeypatch.setattr(la, "norm_kernel_agrees", lambda *args: agree[0])
    cuda_like = torch.empty(0, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self.device.type == "meta"))
    assert la.norm_kernel(layer, cuda_like, None) is kernel
    assert la.norm_kernel(layer, cuda_like, cache=object()) is None
    assert la.norm_kernel(layer, torch.empty(0), None) is None
    agree[0] = False
    assert la.norm_kernel(layer, cuda_like, None) is None
    agree[0] = True
    monkeypatch.setenv("KESTREL_KERNELS", "torch")
    assert la.norm_kernel(layer, cuda_like, None) is None


def _scaled_norm(calls: list[str]):  # a gated norm whose output is off by a fifth
    norm = _norm_like_fla(calls)
    return lambda *args, **kwargs: norm(*args, **kwargs) * 1.2


@pytest.mark.parametrize(("norm", "agree", "says"), [
    (_norm_like_fla, True, None), (_scaled_norm, False, "is off there (largest relative error 0.440"),  # 1.2^2 - 1: gradients of out^2
    (lambda calls: lambda *args, **kwargs: _raising(*args[:3]), False, "failed (an illegal memory access"),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_kernel_is_probed_against_hfs_math(norm, agree: bool, says: str | None, dtype: torch.dtype,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    from kestrel.model import linear_attention as la

    calls: list[str] = []
    monkeypatch.setattr(la, "_fla_norm", lambda: norm(calls))
    la.norm_kernel_agrees.cache_clear()
    with caplog.at_level("WARNING", logger="kestrel"):
        assert la.norm_kernel_agrees(torch.device("cpu"), 8, dtype) is agree
    said = [r.getMessage() for r in caplog.records if r.name == "kestrel"]
    assert (said == []) if says is None else (len(said) == 1 and says in said[0]), said
    la.norm_kernel_agrees.cache_clear()


@pytest.mark.parametrize("around", ["no_grad", "inference_mode", "checkpoint_hooks"])
def test_the_probes_run_as_on_their_own_inside_any_pass(around: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer's first pass may be an evaluation without gradients or a checkpointed layer whose
    saved-tensor hooks take every saved tensor: the probes still run their backward, and leave
    the hooks untouched."""
    from kestrel.kernels import gated_delta
    from kestrel.model import linear_attention as la

    calls: list[str] = []
    monkeypatch.setattr(la, "_fla_norm", lambda: _norm_like_fla(calls))
    monkeypatch.setattr(gated_delta, "available", lambda: True)
    monkeypatch.setattr(gated_delta, "DQKWG", dict.fromkeys(("kernel",)))
    monkeypatch.setattr(gated_delta, "chunk_gated_delta_rule", _way({"kernel": GOOD}))
    la.norm_kernel_agrees.cache_clear(), la.stand_in_way.cache_clear(), la.fla_backward_works.cache_clear()
    packed: list[torch.Tensor] = []

    def pack(x: torch.Tensor):  # type: ignore[no-untyped-def]
        packed.append(x)
        raise AssertionError("a probe's tensor reached the layer's saved-tensor hooks")

    context = {"no_grad": torch.no_grad(), "inference_mode": torch.inference_mode(),
               "checkpoint_hooks": torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x)}[around]
    cpu = torch.device("cpu")
    with context:
        assert la.norm_kernel_agrees(cpu, 8, torch.float32)
        assert la.stand_in_way(cpu, 2, 8, 16, torch.float32, qwen3_5.torch_chunk_gated_delta_rule) is not None
        assert la.fla_backward_works(cpu, _working_chunk)
    assert packed == []
    la.norm_kernel_agrees.cache_clear(), la.stand_in_way.cache_clear(), la.fla_backward_works.cache_clear()
