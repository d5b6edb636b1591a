"""Packed rows for Qwen3.5: several samples side by side in one row train as if each were alone.
The patched stack tells its linear-attention layers where each sample starts (from position_ids),
the short convolution sees only its own sample (`kestrel.kernels.short_conv`, tested on its own in
tests/kernels), and the gate at a sample's first token empties the recurrent state."""

from __future__ import annotations

import inspect
import os

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen3_5_moe

from kestrel.kernels.gated_delta import relative_errors
from kestrel.model import attention as attn
from kestrel.model import linear_attention as la
from kestrel.model.patching import PatchFlags, packing_refusal, patch_model, unpatch_model
from tests.support.tiny import tiny_model

VOCAB = 256
ROWS = [(9, 70, 5), (30, 50, 4)]  # sample lengths per row: boundaries inside and across 64-token chunks


def test_segment_offsets_follow_hfs_rule_for_where_a_sample_starts() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3],  # three samples
                              [5, 6, 7, 0, 1, 2, 3, 0, 0],  # a row starting mid-count; repeated positions
                              [0, 1, 2, 3, 4, 5, 6, 7, 8]])  # one sample
    want = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3],
                         [0, 1, 2, 0, 1, 2, 3, 0, 0],
                         [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    assert torch.equal(la.segment_offsets(positions), want)


def _packed(rows: list[tuple[int, ...]], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, list[list[slice]]]:
    """(ids (B, T), position_ids (B, T), each row's samples as slices of T)."""
    gen = torch.Generator().manual_seed(7)
    width = max(sum(r) for r in rows)
    ids = torch.randint(0, VOCAB, (len(rows), width), generator=gen)
    positions, spans = torch.zeros_like(ids), []
    for i, row in enumerate(rows):
        at, row_spans = 0, []
        for n in row:
            positions[i, at : at + n] = torch.arange(n)
            row_spans.append(slice(at, at + n))
            at += n
        spans.append(row_spans)
    return ids.to(device), positions.to(device), spans


def _alone_and_packed(model: torch.nn.Module, rows: list[tuple[int, ...]], device: str = "cpu") -> tuple[
        torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """(packed logits, each sample alone's logits laid out as packed, and the parameter gradients
    of the same weighted sum of logits both ways)."""
    ids, positions, spans = _packed(rows, device)
    params = [p for p in model.parameters() if p.requires_grad]
    packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    weights = torch.randn(packed.shape, generator=torch.Generator().manual_seed(3)).to(packed)
    packed_grads = torch.autograd.grad((packed.float() * weights).sum(), params, allow_unused=True)
    alone = torch.zeros_like(packed)
    total = 0
    for i, row_spans in enumerate(spans):
        for span in row_spans:
            out = model(input_ids=ids[i : i + 1, span], use_cache=False).logits
            alone[i, span] = out[0].detach()
            total = total + (out[0].float() * weights[i, span]).sum()
    alone_grads = torch.autograd.grad(total, params, allow_unused=True)
    return packed.detach(), alone, list(packed_grads), list(alone_grads)


def _worst_gradient(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest relative error (in norm) over the parameters' gradients."""
    pairs = [(a.float(), b.float()) for a, b in zip(got, want) if b is not None]
    return max(relative_errors(*zip(*pairs)))


@pytest.mark.parametrize(("family", "kernels", "varlen"), [
    ("qwen3_5_text", "torch", "off"), ("qwen3_5_text", "torch", "reference"), ("qwen3_5_text", "triton", "off"),
    ("qwen3_5_moe_text", "torch", "off"), ("qwen3_5_moe_text", "torch", "reference")])
def test_packed_rows_give_each_sample_what_it_gets_alone(family: str, kernels: str, varlen: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Logits and every parameter's gradient of the patched model, on Kestrel's PyTorch references
    and on its Triton kernels (the interpreter here); HF's own layers, which carry the state and
    convolution from one sample into the next, do not (the check has teeth). With `varlen` "reference",
    Qwen3.5's full-attention layers run the variable-length path (Kestrel's stack; its SDPA-loop
    reference here) beside the linear-attention layers' sample offsets."""
    if kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs CPU tensors only in its interpreter (a GPU host runs the CUDA test below)")
    monkeypatch.setenv("KESTREL_KERNELS", kernels)
    for module in (qwen3_5, qwen3_5_moe):  # HF's own functions, not the CUDA-only fla it binds where installed
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            monkeypatch.setattr(module, name, inspect.unwrap(getattr(module, name)))
    model = tiny_model(family, VOCAB, seed=2)
    assert any(t == "linear_attention" for t in model.config.layer_types)
    packed, alone, got, want = _alone_and_packed(model, ROWS)
    assert (packed - alone).abs().max() > 1e-3  # HF: the next sample starts from the last one's state
    assert _worst_gradient(got, want) > 5e-2
    calls = []
    reference = attn.reference_varlen_attn
    monkeypatch.setattr(attn, "reference_varlen_attn", lambda *a, **k: calls.append(1) or reference(*a, **k))
    patch_model(model, PatchFlags(varlen=varlen))  # type: ignore[arg-type]
    packed, alone, got, want = _alone_and_packed(model, ROWS)
    assert bool(calls) == (varlen == "reference")
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)
    # fp32 sums in another order; the gate's parameters (A_log, dt_bias) sum per-token terms that
    # mostly cancel, so theirs are the largest, near 2e-3, against HF's leak's 5e-2 and more
    assert _worst_gradient(got, want) < 5e-3
    unpatch_model(model)  # the stack's own forward is back
    assert (_alone_and_packed(model, ROWS)[0] - alone).abs().max() > 1e-3


def test_packing_is_refused_only_where_kestrels_linear_attention_forward_is_off() -> None:
    model = tiny_model("qwen3_5_text", VOCAB, seed=2)
    assert "carry their state" in packing_refusal(model)  # unpatched
    patch_model(model, PatchFlags(attention=False))
    assert "fast kernels off" in packing_refusal(model)
    unpatch_model(model)
    patch_model(model)
    assert packing_refusal(model) is None
    assert packing_refusal(tiny_model("qwen3", VOCAB, seed=2)) is None  # attention keeps inside samples by masks


def test_a_pass_with_a_cache_ignores_the_offsets() -> None:
    """Prefill and decode carry their own states: positions handed in with a cache mark no samples."""
    model = tiny_model("qwen3_5_text", VOCAB, seed=2)
    patch_model(model)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=True).logits
        odd = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8]])  # would mark two samples without a cache
        got = model(input_ids=ids, position_ids=odd, use_cache=True).logits
    torch.testing.assert_close(got[:, :3], want[:, :3])
    assert torch.isfinite(got).all()


@pytest.mark.gpu
def test_packed_rows_give_each_sample_what_it_gets_alone_on_cuda() -> None:
    """The same on CUDA in bf16, on flash-linear-attention's kernels (or Kestrel's stand-in
    where its backward is refused) with the boundary gate: within bf16 tolerance."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = tiny_model("qwen3_5_text", VOCAB, seed=2).to("cuda", torch.bfloat16)
    patch_model(model)
    packed, alone, got, want = _alone_and_packed(model, ROWS, "cuda")
    assert torch.isfinite(packed).all()
    torch.testing.assert_close(packed.float(), alone.float(), rtol=3e-2, atol=3e-2)
    assert _worst_gradient(got, want) < 5e-2
