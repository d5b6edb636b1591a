"""Qwen3-MoE and gpt-oss on Kestrel's decode forward (CPU, fp32) against Hugging Face.

The sparse block (router, top-k experts, LoRA on the experts; `kestrel/decode/moe.py`) and
gpt-oss's attention (sinks, sliding windows of 8 tokens, prompts longer than that) are checked
through their logits at prefill and at every step (any error in routing, sinks or windows moves
them far past fp32 rounding), and through greedy tokens equal to `model.generate`: batch 1, batch
3 left-padded, with and without adapters on attention and experts.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from kestrel.decode import model as decode_model
from kestrel.decode.generate import Generator
from kestrel.decode.model import DecodeModel
from kestrel.kernels.decode import expert_gemv
from kestrel.model.registry import DECODE_FAMILIES
from tests.decode.test_decode_hf import VOCAB, _hf_greedy, _prompt, assert_updates_are_seen
from tests.decode.test_decode_hf import _with_adapters as with_adapters
from tests.support.tiny import tiny_model

EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# The tiny gpt-oss at the default init repeats one token; a wider init gives varied greedy paths.
# Qwen3-MoE also with a dense MLP in layer 1 (`mlp_only_layers`), beside the sparse layer 0.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_mixed": ("qwen3_moe", dict(mlp_only_layers=[1])),
    "gpt_oss": ("gpt_oss", dict(initializer_range=0.1)),
}
PROMPTS = (5, 23, 11)  # gpt-oss's window is 8: one row inside it, two past it


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(case: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    family, overrides = CASES[case]
    model = tiny_model(family, VOCAB, seed=seed, dtype=dtype, **overrides)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _with_adapters(model: torch.nn.Module) -> torch.nn.Module:
    """"default" on every linear and both expert projections, "qv" on q/v only; B random."""
    return with_adapters(model, EXPERT_PARAMS)


def test_the_moe_families_decode_on_kestrels_forward() -> None:
    assert {"qwen3_moe", "gpt_oss"} <= set(DECODE_FAMILIES)
    assert "qwen3_5_moe_text" not in DECODE_FAMILIES  # linear attention: HF's forward and cache


def test_experts_the_block_cannot_read_fall_back_to_hf() -> None:
    """Experts without 3-D weights (gpt-oss's MXFP4 blocks as HF keeps them when not dequantized)
    decode through HF's forward, with the reason logged, rather than failing."""
    from kestrel.decode.hf_backend import HFDecodeBackend

    model = _model("gpt_oss")
    experts = model.model.layers[1].mlp.experts
    del experts.gate_up_proj
    experts.gate_up_proj_blocks = torch.nn.Parameter(torch.zeros(8, 128, 4, 16, dtype=torch.uint8), requires_grad=False)
    assert isinstance(Generator(model, max_seq_len=64, stop_ids=[]).backend, HFDecodeBackend)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("case", CASES)
def test_prefill_and_step_logits_match_hf(case: str, kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three left-padded rows: prefill's last logits and six steps' logits against HF's forward
    over each row's own tokens. `triton`: norms, RoPE and the step's attention (sinks included)
    as the Triton kernels (interpreted here), as on CUDA. gpt-oss's prefill sink softmax runs
    over chunks of 4 queries (as a long prompt's would). The steps' expert products: the kernel that
    reads the chosen experts in place (`kestrel.kernels.decode.expert_gemv`) under `triton`, the
    gathered slices under `torch`."""
    monkeypatch.setenv("KESTREL_KERNELS", kernels)
    launches: list[int] = []
    kernel = expert_gemv.expert_gemv
    monkeypatch.setattr(expert_gemv, "expert_gemv", lambda x, ids, w: launches.append(x.shape[0]) or kernel(x, ids, w))
    monkeypatch.setattr(decode_model, "_SINK_SCORES", 3 * 4 * max(PROMPTS) * 4)  # rows, heads, keys, queries
    model = _model(case)
    backend = DecodeModel(model, max_seq_len=128)
    rows = [_prompt(n, seed=n) for n in PROMPTS]
    t = max(PROMPTS)
    ids = torch.tensor([[0] * (t - len(r)) + r for r in rows])
    pad = torch.tensor([t - len(r) for r in rows])
    cache = backend.new_cache(3, 64)
    with torch.no_grad():
        logits = backend.prefill(ids, pad, cache, None)
        for step in range(7):
            ref = torch.cat([model(torch.tensor([r])).logits[:, -1] for r in rows]).float()
            torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5, msg=f"step {step}")
            tok = ref.argmax(-1)
            rows = [r + [int(x)] for r, x in zip(rows, tok)]
            logits = backend.step(tok, torch.tensor([t + step]), pad, cache, None)
    layers = len(backend.moe_blocks)
    assert launches == ([3 * 2] * (2 * layers * 7) if kernels == "triton" else [])  # 3 rows x top-2; 7 steps


@pytest.mark.parametrize("case", CASES)
def test_greedy_batch_1_and_3_left_padded_match_hf_generate(case: str) -> None:
    model = _model(case)
    gen = Generator(model, max_seq_len=256, stop_ids=[])
    assert isinstance(gen.backend, DecodeModel)
    prompts = [_prompt(n, seed=n) for n in PROMPTS]
    refs = [_hf_greedy(model, p, 40) for p in prompts]
    assert all(len(set(r)) > 5 for r in refs)  # varied paths: every step's choice is checked
    assert gen.generate(prompts[1:2], max_new_tokens=40).tokens[0] == refs[1]
    assert gen.generate(prompts, max_new_tokens=40).tokens == refs


@pytest.mark.parametrize("case", ["qwen3_moe_mixed", "gpt_oss"])
def test_adapters_on_attention_and_experts_match_peft(case: str) -> None:
    """Per request (base, "default", "qv") and per row in one left-padded batch; the expert
    adapters live in the decode block's bank, synced from PEFT's wrappers."""
    peft = _with_adapters(_model(case))
    gen = Generator(peft, max_seq_len=256, stop_ids=[])
    assert gen.adapters == ["default", "qv"]
    assert all(block.gate_up.lora is not None and block.down.lora is not None for block in gen.backend.moe_blocks)
    prompts = [_prompt(n, seed=n) for n in PROMPTS]
    refs = {}
    with peft.disable_adapter():
        refs[None] = [_hf_greedy(peft, p, 32) for p in prompts]
    for name in ("default", "qv"):
        peft.set_adapter(name)
        refs[name] = [_hf_greedy(peft, p, 32) for p in prompts]
    assert refs["default"] != refs[None] and refs["qv"] != refs[None]
    for adapter in (None, "default", "qv"):
        assert gen.generate(prompts, 32, adapter=adapter).tokens == refs[adapter], adapter
    mixed = gen.generate(prompts, 32, adapter=["qv", None, "default"]).tokens
    assert mixed == [refs["qv"][0], refs[None][1], refs["default"][2]]


def test_expert_adapter_updates_are_seen_without_rebuilding() -> None:
    """GRPO trains between rollouts: each request copies the experts' current factors in."""
    assert_updates_are_seen(_with_adapters(_model("qwen3_moe")), 24, part="experts")


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_grpo_rollout_of_a_patched_model_in_training_mode(case: str) -> None:
    """A GRPO rollout: Kestrel's patched model with its LoRA (attention and experts, `attach_lora`),
    in training mode under gradient checkpointing, decodes HF's greedy tokens after a training step
    changed the adapters (each request syncs them)."""
    from kestrel.config import LoraSettings
    from kestrel.model.lora import attach_lora
    from kestrel.model.patching import patch_model

    model = _model(case)
    patch_model(model)
    peft = attach_lora(model, LoraSettings(r=4, alpha=8))
    peft.gradient_checkpointing_enable()
    peft.train()
    gen = Generator(peft, max_seq_len=128, stop_ids=[])
    assert gen.adapters == ["default"] and all(b.gate_up.lora is not None for b in gen.backend.moe_blocks)
    ids = torch.tensor([_prompt(12, seed=8)])
    peft(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # B gets a gradient; step by hand
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.add_(p.grad.sign() * 0.05)
    prompts = [_prompt(n, seed=n) for n in PROMPTS]
    tokens = gen.generate(prompts, 24, adapter="default").tokens
    assert tokens != gen.generate(prompts, 24).tokens and peft.training  # the adapters act
    peft.eval()
    assert tokens == [_hf_greedy(peft, p, 24) for p in prompts]


def test_replaced_expert_weights_are_read_anew() -> None:
    """An experts parameter replaced between requests (a reload, NF4 undone): the next request
    reads the new tensor, not the one the decode block was built on."""
    model = _model("qwen3_moe")
    gen = Generator(model, max_seq_len=128, stop_ids=[])
    prompt = _prompt(10, seed=6)
    before = gen.generate([prompt], 24).tokens[0]
    experts = model.model.layers[0].mlp.experts
    experts.gate_up_proj = torch.nn.Parameter(-experts.gate_up_proj.detach().flip(0), requires_grad=False)
    after = gen.generate([prompt], 24).tokens[0]
    assert after == _hf_greedy(model, prompt, 24) and after != before


# --- CUDA: compiled and graph-captured steps (the lead's GPU runs) ------------------------------


def _assert_same_until_bf16_tie(bf16: torch.nn.Module, fp32: torch.nn.Module, prompt: list[int], ours: list[int],
                                theirs: list[int]) -> None:
    """Greedy tokens equal, or equal up to a step where bf16 itself cannot order the top tokens: there
    the fp32 twin's (same weights) logit of our token lies within twice HF's bf16 error of its best.

    The error is measured, not assumed: HF's bf16 logits at that step against the fp32 twin's,
    the largest over the vocabulary. (A fixed relative gap fails on the tiny gpt-oss, whose
    wide init moves bf16 logits by up to ~0.2 around tops ~3; two bf16 paths may part there.)
    """
    from tests.decode.test_decode_nf4 import parting

    parted = parting(bf16, prompt, ours, theirs)
    if parted is None:
        return
    diverged, ids = parted
    with torch.no_grad():
        exact = fp32(ids).logits[0, -1].float()
        error = float((bf16(ids).logits[0, -1].float() - exact).abs().max())
    short = float(exact.max() - exact[ours[diverged]])
    assert short <= 2 * error, (f"token {ours[diverged]} at step {diverged} is {short:.3f} below fp32's best, "
                                f"past bf16's error there ({error:.3f})")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_cuda_bf16_graphed_tokens_match_hf(case: str) -> None:
    """bf16 on CUDA, compiled and captured: three left-padded rows (gpt-oss's two past its window),
    each equal to HF's greedy tokens up to a step where bf16 cannot order the top tokens
    (`_assert_same_until_bf16_tie`); past it the paths differ by design."""
    from tests.decode.test_decode_gpu import _assert_graphed

    model = _model(case, dtype=torch.bfloat16).cuda()
    fp32 = copy.deepcopy(model).float()
    gen = Generator(model, max_seq_len=256, stop_ids=[])
    prompts = [_prompt(n, seed=n) for n in PROMPTS]
    tokens = gen.generate(prompts, 40).tokens
    _assert_graphed(gen)
    assert gen.compile
    refs = [_hf_greedy(model, prompt, 40) for prompt in prompts]
    for prompt, ours, ref in zip(prompts, tokens, refs):
        _assert_same_until_bf16_tie(model, fp32, prompt, ours, ref)
    _assert_same_until_bf16_tie(model, fp32, prompts[1], gen.generate(prompts[1:2], 40).tokens[0], refs[1])  # batch 1


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["qwen3_moe_mixed", "gpt_oss"])
def test_cuda_graphed_expert_adapters_match_eager(case: str) -> None:
    """fp32 on CUDA: per-request and per-row adapters (attention and experts), compiled and
    captured, give the eager loop's tokens exactly; and HF's for one adapter."""
    from tests.decode.test_decode_gpu import _assert_graphed

    peft = _with_adapters(_model(case)).cuda()
    fast = Generator(peft, max_seq_len=256, stop_ids=[])
    eager = Generator(peft, max_seq_len=256, stop_ids=[], compile=False, cuda_graphs=False)
    prompts = [_prompt(n, seed=n) for n in PROMPTS]
    for adapter in (["qv", None, "default"], "default", None):
        assert fast.generate(prompts, 32, adapter=adapter).tokens == eager.generate(prompts, 32, adapter=adapter).tokens
    _assert_graphed(fast)
    peft.set_adapter("default")
    assert fast.generate(prompts[1:2], 32, adapter="default").tokens[0] == _hf_greedy(peft, prompts[1], 32)
