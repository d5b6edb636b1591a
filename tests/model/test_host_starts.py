"""Sample starts read on the host before the batch moved (`attn.HostStarts`, keyword `attn.STARTS_KWARG`):
the model forward then reads nothing back from the device, with the same logits, loss and gradients as
the forward that reads them itself and as Hugging Face's (CPU, the varlen reference); on CUDA, a forward
and backward under torch's sync check raise nothing, while the same call without them does."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from kestrel.model import attention as attn
from kestrel.model.patching import PatchFlags, patch_lora_layers, patch_model
from tests.model.test_model_forward import _base, _batch
from tests.model.test_patching import VOCAB, _lora
from tests.support.compare import assert_same_trainable_grads
from tests.support.tiny import tiny_model


def _host(batch: dict[str, torch.Tensor]) -> attn.HostStarts:
    return attn.host_starts(batch.get("attention_mask"), batch.get("position_ids"), batch["input_ids"].shape[0])


@pytest.mark.parametrize("case", ["plain", "padded", "left_padded", "holed", "packed", "long"])
def test_host_starts_are_the_forwards_own(case: str) -> None:
    batch = _batch(case)
    own = attn.segment_starts(batch.get("attention_mask"), batch.get("position_ids"), 2)
    host = _host(batch).starts
    assert (host is None) == (own is None) and (host is None or torch.equal(host, own))
    # None: nothing to detect (no positions, no mask), or a hole or left padding (HF's mask)
    assert (host is None) == (case in ("plain", "long", "left_padded", "holed"))


def test_host_starts_need_the_host_copy() -> None:
    on_device = torch.zeros(1, 8, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="host position_ids .*before moving the batch"):
        attn.host_starts(None, on_device, 1)


def _no_device_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the forward's own read of the starts fail the test."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the forward read the sample starts back although the caller gave them")

    monkeypatch.setattr(attn, "segment_starts", refuse)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "mistral"])
@pytest.mark.parametrize("case", ["packed", "padded", "long"])
def test_given_starts_train_as_the_read_ones(family: str, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    base = _base(family, seed=3)
    ref = _lora(copy.deepcopy(base), seed=4)
    patch_model(base, PatchFlags(varlen="reference"))
    fast = _lora(base, seed=4)
    patch_lora_layers(fast)
    ref.train(), fast.train()
    batch = _batch(case)
    read = copy.deepcopy(fast)
    read_loss = read(**batch, use_cache=False).loss
    host = _host(batch)
    _no_device_read(monkeypatch)
    given_loss = fast(**batch, use_cache=False, **{attn.STARTS_KWARG: host}).loss
    ref_loss = ref(**batch, use_cache=False).loss
    torch.testing.assert_close(given_loss, read_loss, rtol=0, atol=0)
    torch.testing.assert_close(given_loss, ref_loss, rtol=1e-5, atol=1e-5)
    for model, loss in ((fast, given_loss), (read, read_loss), (ref, ref_loss)):
        loss.backward()
    assert_same_trainable_grads(fast, read)
    assert_same_trainable_grads(fast, ref)


def test_starts_of_another_batch_are_refused() -> None:
    model = tiny_model("llama", VOCAB, seed=5)
    patch_model(model, PatchFlags(varlen="reference"))
    batch = _batch("packed")
    wrong = attn.HostStarts(torch.ones(2, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"shape \(2, 7\) for a batch of 2 x 19 tokens"):
        model(**batch, use_cache=False, **{attn.STARTS_KWARG: wrong})


def test_a_call_for_hf_drops_them() -> None:
    """A call the forward hands to HF's (a cache here) does not pass the keyword on, which HF's layers do not take."""
    ref = tiny_model("llama", VOCAB, seed=6)
    fast = copy.deepcopy(ref)
    patch_model(fast, PatchFlags(varlen="reference"))
    batch = {k: v for k, v in _batch("plain").items() if k != "labels"}
    with torch.no_grad():
        want = ref(**batch, use_cache=True).logits
        got = fast(**batch, use_cache=True, **{attn.STARTS_KWARG: _host(batch)}).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["packed", "flat"])
def test_a_cuda_step_with_given_starts_never_syncs(layout: str) -> None:
    """Packed rows and one flat row through `BatchPlan`, as training collates them, on the varlen kernel:
    forward and backward under torch.cuda.set_sync_debug_mode("error") raise nothing with the batch's
    host starts, and raise without them (the forward's own read is a sync), so the check can fail."""
    from kestrel.data.collate import BatchPlan
    from kestrel.data.tokenize import Sample

    model = tiny_model("llama", VOCAB, seed=8, dtype=torch.bfloat16).cuda()
    patch_model(model)
    model = _lora(model, seed=9)
    patch_lora_layers(model)
    model.train()
    g = torch.Generator().manual_seed(1)
    samples = [Sample(ids, ids) for ids in (torch.randint(0, VOCAB, (int(n),), generator=g).tolist()
                                            for n in torch.randint(5, 40, (12,), generator=g))]
    plan = BatchPlan(samples, 4, layout == "packed", 64, 0, seed=0, flat=True)
    batch = plan.batch(0, 0)
    assert batch.starts is not None
    b = batch.to(torch.device("cuda"))
    inputs = dict(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids, labels=b.labels,
                  use_cache=False)
    model(**inputs, **b.model_kwargs()).loss.backward()  # first calls: compile, autotune, allocate
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(**inputs, **b.model_kwargs()).loss.backward()
        with pytest.raises(RuntimeError, match="synchroniz"):
            model(**inputs).loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graphs", ["off", "on"])
def test_an_offloaded_step_with_given_starts_never_syncs(tiny_model_dir, graphs: str) -> None:
    """As the matrix's cells train (QLoRA, offloaded checkpointing keeping attention, the layer graphs replayed
    once captured, fused AdamW): a warm step over a packed flat batch with its host starts syncs nowhere, so the
    host runs a step ahead of the GPU."""
    from kestrel.config import LoraSettings
    from kestrel.data.collate import BatchPlan
    from kestrel.data.tokenize import Sample
    from kestrel.model.loader import load
    from kestrel.model.lora import attach_lora
    from kestrel.recompute.checkpoint import set_gradient_checkpointing

    torch.manual_seed(0)
    model, _ = load(str(tiny_model_dir("llama")), 64, load_in_4bit=True, dtype="bf16", device="cuda")
    model = attach_lora(model, LoraSettings(r=8, alpha=16))
    run = set_gradient_checkpointing(model, "offload", graphs, keep_attention="on")
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(2)
    samples = [Sample(ids, ids) for ids in (torch.randint(5, 60, (int(n),), generator=g).tolist()
                                            for n in torch.randint(8, 30, (16,), generator=g))]
    b = BatchPlan(samples, 8, True, 48, 0, seed=0, flat=True).batch(0, 0).to(torch.device("cuda"))

    def step() -> None:
        model(input_ids=b.input_ids, position_ids=b.position_ids, labels=b.labels, use_cache=False,
              **b.model_kwargs()).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        for _ in range(4):  # captures (graphs on), allocations, the pinned pool's buffers
            step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if graphs == "on":
            assert run.graphs.stats()["forward"] > 0
    finally:
        run.release()
