"""Qwen3.5's linear-attention layers pick their kernel per call: with flash-linear-attention
installed, HF binds its CUDA-only kernels at import, so an unpatched model on the CPU fails; the
patched layers run HF's PyTorch reference there, with HF's numbers and decode state."""

from __future__ import annotations

import functools

import pytest
import torch
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
