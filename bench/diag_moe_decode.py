"""Which fast path parts gpt-oss's graphed bf16 decode from HF's greedy tokens (a diagnosis run):
the test case as is, with the expert GEMV off (gathered experts), with the attention kernel off
(its PyTorch reference), and with both off; one line each: passed, or the assertion."""
import sys

import pytest

import kestrel.decode.model as decode_model
from kestrel.kernels.decode import attention, expert_gemv
from tests.decode import test_decode_moe

case = sys.argv[1] if len(sys.argv) > 1 else "gpt_oss"
variants = {"as is": {}, "experts gathered": {"gemv": False}, "attention reference": {"attn": False},
            "both off": {"gemv": False, "attn": False}}
for name, off in variants.items():
    with pytest.MonkeyPatch.context() as mp:
        if off.get("gemv") is False:
            mp.setattr(expert_gemv, "applies", lambda *a: False)
        if off.get("attn") is False:
            mp.setattr(decode_model, "decode_attention", lambda q, k, v, col, pad, scale, window, softcap, counters,
                       sinks: attention.decode_attention_reference(q, k, v, col, pad, scale, window, softcap, sinks))
        try:
            test_decode_moe.test_cuda_bf16_graphed_tokens_match_hf(case)
            print(f"{case} {name}: passed", flush=True)
        except AssertionError as e:
            print(f"{case} {name}: {str(e).splitlines()[0]}", flush=True)
