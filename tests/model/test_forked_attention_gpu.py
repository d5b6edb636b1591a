"""Forked samples through the real varlen kernel (torch.nn.attention.varlen, flash) on CUDA in bf16:
flash aligns a query sample shorter than its key sample bottom-right (causal and windowed), as
`reference_varlen_attn` does; and a DPO micro-batch scored with the prompt once gives the
separate-sequence log-probs and loss within bf16 rounding."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.varlen import varlen_attn

from kestrel.config import LoraSettings
from kestrel.model import attention as attn
from kestrel.model.loader import load
from kestrel.model.lora import attach_lora
from kestrel.model.patching import prompt_sharing_refusal
from tests.model.test_forked_attention import GROUPS
from tests.support.bf16_runs import rel_err
from tests.training.test_preference_shared import _run, _samples

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("window", [(-1, 0), (2, 0)], ids=["causal", "window3"])
def test_flash_aligns_short_query_samples_bottom_right(window: tuple[int, int]) -> None:
    real = sum(p + sum(b) for p, b in GROUPS)
    keys = real + sum(p * (len(b) - 1) for p, b in GROUPS)
    width, key_width = real + 3, keys + 3 + 5  # a padding tail holding five spare keys
    fork = attn.fork_layout(GROUPS, width, key_width, torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    q32 = torch.randn(1, 4, width, 64, generator=g, device="cuda")  # (B, Hq, T, D)
    k32, v32 = (torch.randn(1, 2, width, 64, generator=g, device="cuda") for _ in range(2))
    weight = torch.randn(1, width, 4 * 64, generator=g, device="cuda")
    weight[:, real:] = 0

    def run(fn, dtype):  # type: ignore[no-untyped-def]
        q, k, v = (x.to(dtype).requires_grad_(True) for x in (q32, k32, v32))
        out = attn.varlen_attention(q, k, v, attn.VarlenCall(fork.queries, window, fn, fork.keys), scale=0.125)
        grads = torch.autograd.grad((out.float() * weight).sum(), (q, k, v))
        return out.float(), [x.float() for x in grads]

    want, want_grads = run(attn.reference_varlen_attn, torch.float32)
    got, got_grads = run(varlen_attn, torch.bfloat16)
    ref16, ref16_grads = run(attn.reference_varlen_attn, torch.bfloat16)  # the reference's own bf16 error
    assert rel_err(got[:, :real], want[:, :real]) <= 2 * rel_err(ref16[:, :real], want[:, :real]) + 1e-2
    for a, b, c in zip(got_grads, want_grads, ref16_grads):
        assert a.isfinite().all() and rel_err(a, b) <= 2 * rel_err(c, b) + 1e-2


def test_shared_prompt_dpo_matches_separate_in_bf16(tiny_model_dir) -> None:
    model, tok = load(str(tiny_model_dir("llama")), 128, dtype="bf16", device="cuda")
    assert prompt_sharing_refusal(model) is None  # the default patch runs flash's varlen kernel here
    for p in model.parameters():
        p.requires_grad_(False)
    model = attach_lora(model, LoraSettings(r=4, alpha=8))
    with torch.no_grad():  # a fresh adapter is the identity (B = 0); give it something to say
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    samples = _samples(len(tok))
    separate, shared = _run(model, samples, share=False, device="cuda"), _run(model, samples, share=True, device="cuda")
    assert rel_err(shared["logp"], separate["logp"]) <= 2e-2
    assert abs(float(shared["loss"] - separate["loss"])) <= 2e-2
    for name, grad in separate["grads"].items():
        assert shared["grads"][name].isfinite().all() and rel_err(shared["grads"][name].float(), grad.float()) <= 5e-2, name
