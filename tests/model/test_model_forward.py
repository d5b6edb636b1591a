"""The model-level forward against the unpatched Hugging Face model, on every family (CPU).

Plain, padded and packed batches, and a sequence longer than the sliding window, with the mask
path (`varlen="off"`) and with the varlen path running the SDPA-loop reference
(`varlen="reference"`): logits, loss and LoRA gradients agree. Calls the forward does not handle
go to HF's own forward.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from kestrel.model import attention as attn
from kestrel.model import decoder_stack as model_forward
from kestrel.recompute.checkpoint import set_gradient_checkpointing
from kestrel.model.patching import PatchFlags, patch_lora_layers, patch_model
from kestrel.model.registry import FULL_PATH_FAMILIES as SUPPORTED
from tests.support.compare import assert_same_loss_and_grads, assert_same_trainable_grads
from tests.support.tiny import tiny_model
from tests.model.test_patching import VOCAB, _lora

WINDOW = 6
# Small windows so sequences exceed them; Gemma 3 gets one sliding and one full layer, Qwen2 a
# sliding second layer (layers >= max_window_layers slide).
OVERRIDES: dict[str, dict[str, Any]] = {
    "mistral": dict(sliding_window=WINDOW),
    "gemma3_text": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "gpt_oss": dict(sliding_window=WINDOW),  # sliding, then full (tests.support.tiny)
    "qwen3_moe": dict(use_sliding_window=True, sliding_window=WINDOW),
}


def _base(family: str, seed: int) -> torch.nn.Module:
    return tiny_model(family, VOCAB, seed=seed, **OVERRIDES.get(family, {}))


def _batch(case: str) -> dict[str, torch.Tensor]:
    """input_ids, labels and the case's attention_mask / position_ids, (2, T) each."""
    g = torch.Generator().manual_seed(hash(case) % 1000)
    t = 40 if case == "long" else 19
    ids = torch.randint(0, VOCAB, (2, t), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    batch: dict[str, torch.Tensor] = {"input_ids": ids, "labels": labels}
    if case == "padded":  # right padding, as kestrel.data.collate pads
        mask = torch.ones_like(ids)
        mask[1, 12:] = 0
        labels[1, 12:] = -100
        batch["attention_mask"] = mask
    if case == "left_padded":
        mask = torch.ones_like(ids)
        mask[0, :5] = 0
        labels[0, :5] = -100
        batch["attention_mask"] = mask
    if case == "holed":  # real tokens on both sides of a zero: HF's mask lets them see across it
        mask = torch.ones_like(ids)
        mask[1, 6:9] = 0
        labels[1, 6:9] = -100
        batch["attention_mask"] = mask
    if case == "packed":  # samples of 11 + 8 and 4 + 15 tokens; the first label of each masked
        cuts = [(0, 11), (0, 4)]
        batch["position_ids"] = torch.stack([torch.cat([torch.arange(c), torch.arange(t - c)]) for _, c in cuts])
        for row, (_, c) in enumerate(cuts):
            labels[row, c] = -100
    return batch


def mlp_discards(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each LoRA MLP call's `discard_output` (a checkpoint's recompute skipping the down product), in call order."""
    from kestrel import kernels

    seen: list[bool] = []
    real = kernels.lora_mlp

    def spy(*args: Any, discard_output: bool = False, **kwargs: Any) -> torch.Tensor:
        seen.append(discard_output)
        return real(*args, discard_output=discard_output, **kwargs)

    monkeypatch.setattr(kernels, "lora_mlp", spy)
    return seen


def _spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of model-level forwards run (not delegated) and of varlen reference calls."""
    counts = {"model": 0, "varlen": 0}
    layout, reference = model_forward.attention_inputs, attn.reference_varlen_attn

    def count_layout(*args: Any, **kwargs: Any) -> Any:
        counts["model"] += 1
        return layout(*args, **kwargs)

    def count_varlen(*args: Any, **kwargs: Any) -> torch.Tensor:
        counts["varlen"] += 1
        return reference(*args, **kwargs)

    monkeypatch.setattr(model_forward, "attention_inputs", count_layout)
    monkeypatch.setattr(attn, "reference_varlen_attn", count_varlen)
    return counts


# HF 5.17's GptOssModel builds its masks without position_ids, so packed samples see each other
# there; ours keeps them apart as in every family (tests/model/test_moe.py and
# tests/model/test_sink_attention.py check that). HF's Qwen3.5 linear-attention layers carry their
# state from one packed sample into the next; tests/model/test_linear_attention_packing.py checks
# ours against each sample alone.
PACKING_BLIND = frozenset({"gpt_oss", "qwen3_5_text", "qwen3_5_moe_text"})

# (case, varlen mode); "long" (40 tokens against a window of 6) only where layers slide.
CASES = [
    (family, case, mode)
    for family in SUPPORTED
    for case, mode in [("plain", "off"), ("padded", "off"), ("padded", "reference"), ("left_padded", "reference"),
                       ("holed", "reference"), ("packed", "off"), ("packed", "reference"),
                       ("long", "off"), ("long", "reference")]
    if (case != "long" or family in OVERRIDES) and (case != "packed" or family not in PACKING_BLIND)
]


@pytest.mark.parametrize("family,case,mode", CASES)
def test_logits_loss_and_lora_grads_match_hf(family: str, case: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _spy(monkeypatch)
    base = _base(family, seed=7)
    ref = _lora(copy.deepcopy(base), seed=8)
    patch_model(base, PatchFlags(varlen=mode))  # type: ignore[arg-type]
    fast = _lora(base, seed=8)
    assert patch_lora_layers(fast) > 0
    batch = _batch(case)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        ref_logits = ref(**inputs, use_cache=False).logits
        fast_logits = fast(**inputs, use_cache=False).logits
    keep = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()  # pad rows are HF's business
    torch.testing.assert_close(fast_logits[keep], ref_logits[keep], rtol=1e-4, atol=1e-4)
    ref.train(), fast.train()
    assert_same_loss_and_grads(fast, ref, batch)
    assert counts["model"] == 2  # the logits and the loss forward, neither delegated
    # Right-padded rows run as segments (real tokens, then padding) through varlen; left padding
    # and a mask with a hole take HF's mask.
    uses_varlen = mode == "reference" and case in ("packed", "long", "padded")
    assert (counts["varlen"] > 0) == uses_varlen


@pytest.mark.parametrize("family", ["llama", "gemma3_text"], ids=["swiglu", "geglu"])
def test_the_triton_kernels_match_hf_too(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check through the Triton kernels (interpreted here): norms, RoPE, the loss, and the 16-bit MLP's
    GLU with the adapters' rank terms inside it (`kestrel.kernels.glu_lowrank`)."""
    monkeypatch.setenv("KESTREL_KERNELS", "triton")
    test_logits_loss_and_lora_grads_match_hf(family, "plain", "off", monkeypatch)


@pytest.mark.parametrize("family", [f for f in SUPPORTED if f not in PACKING_BLIND])
def test_checkpointed_packed_training_matches_hf(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers called through __call__: HF checkpointing (our reentrant function) still recomputes
    them. In the recompute the fused MLP skips its down product where the MLP output goes
    straight into the residual sum (every family but Gemma's sandwich norms)."""
    discards = mlp_discards(monkeypatch)
    base = _base(family, seed=9)
    ref = _lora(copy.deepcopy(base), seed=10)
    patch_model(base, PatchFlags(varlen="reference"))
    fast = _lora(base, seed=10)
    patch_lora_layers(fast)
    set_gradient_checkpointing(fast, "standard")
    ref.train(), fast.train()
    batch = _batch("packed")
    ref(**batch, use_cache=False).loss.backward()
    fast(**batch, use_cache=False).loss.backward()
    assert_same_trainable_grads(fast, ref)
    # dense MLPs with LoRA (PEFT moves Qwen3-MoE's MLP targets onto its experts)
    layers = sum(hasattr(getattr(m, "gate_proj", None), "lora_A") for m in fast.modules())
    sandwich = family.startswith("gemma")
    # forward under no_grad (kept), then one recompute per dense-MLP layer (discarded unless sandwich)
    assert discards == [False] * layers + [not sandwich] * layers


def _four_d_mask(t: int) -> torch.Tensor:
    return torch.tril(torch.ones(t, t, dtype=torch.bool))[None, None]  # (1, 1, T, T)


@pytest.mark.parametrize(
    "call",
    [
        dict(use_cache=True),
        dict(use_cache=None),  # the tiny config says use_cache=True
        dict(use_cache=False, output_hidden_states=True),
        dict(use_cache=False, output_attentions=True),
        dict(use_cache=False, return_dict=False),
        dict(use_cache=False, attention_mask="4d"),
        dict(use_cache=False, some_new_kwarg=1),
    ],
    ids=["cache", "config-cache", "hidden-states", "attentions", "tuple", "4d-mask", "unknown-kwarg"],
)
def test_unhandled_calls_go_to_hf(call: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _spy(monkeypatch)
    ref = tiny_model("gemma3_text", VOCAB, seed=11, attn_implementation="eager")
    fast = copy.deepcopy(ref)
    patch_model(fast)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    call = dict(call)
    if call.get("attention_mask") == "4d":
        call["attention_mask"] = _four_d_mask(9)
    with torch.no_grad():
        if "some_new_kwarg" in call:  # HF's layers take **kwargs; only the stack is compared here
            call.pop("some_new_kwarg")
            out, want = fast.model(input_ids=ids, some_new_kwarg=1, **call), ref.model(input_ids=ids, **call)
        else:
            out, want = fast.model(input_ids=ids, **call), ref.model(input_ids=ids, **call)
    assert counts["model"] == 0
    assert type(out) is type(want)
    if isinstance(out, tuple):
        out, want = out[0], want[0]
    else:
        for key in ("hidden_states", "attentions"):
            assert (getattr(out, key) is None) == (getattr(want, key) is None)
        out, want = out.last_hidden_state, want.last_hidden_state
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_model_level_is_undone_and_optional() -> None:
    model = _base("gemma3_text", seed=12)
    stack = model.model
    handle = patch_model(model, PatchFlags(model=False))
    assert "forward" not in stack.__dict__
    handle.undo()
    del model.kestrel_patch
    handle = patch_model(model)
    assert "forward" in stack.__dict__
    handle.undo()
    assert "forward" not in stack.__dict__ and stack.forward.__func__ is type(stack).forward


def test_unpatched_attention_gets_hf_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With attention left to HF, the stack never picks varlen: HF's attention reads masks only."""
    counts = _spy(monkeypatch)
    ref = _base("gemma3_text", seed=13)
    fast = copy.deepcopy(ref)
    patch_model(fast, PatchFlags(attention=False, varlen="reference"))
    batch = _batch("packed")
    with torch.no_grad():
        want = ref(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        got = fast(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert counts == {"model": 1, "varlen": 0}
