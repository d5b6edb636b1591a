"""Batches for the variable-length attention path (`BatchPlan(flat=True)`): an unpacked batch as
one padding-free row, widths rounded to a few shapes, cu_seqlens padded to a capacity. The loss
and the LoRA gradients equal those of the padded batch through unpatched Hugging Face, for every
family; the shapes a run's batches take are few (what CUDA graphs need)."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from kestrel.model import attention as attn
from kestrel.data.collate import BatchPlan, bucket_width
from kestrel.data.tokenize import IGNORE, Sample
from kestrel.model.patching import PatchFlags, patch_lora_layers, patch_model, runs_varlen
from kestrel.model.registry import FULL_PATH_FAMILIES
from tests.support.compare import assert_same_trainable_grads
from tests.support.tiny import tiny_model
from tests.model.test_model_forward import PACKING_BLIND
from tests.model.test_patching import VOCAB, _lora


def test_bucket_width_adds_at_most_an_eighth_and_takes_few_values() -> None:
    for n in range(1, 5000):
        w = bucket_width(n)
        assert n <= w <= max(n, n * 9 // 8 + 1), n
    widths = {bucket_width(n) for n in range(1024, 8193)}
    assert len(widths) == 25  # 8 a doubling, over three doublings, and 8192 itself
    assert bucket_width(2048) == 2048 and bucket_width(2049) == 2304


def test_segment_capacity_pads_cu_seqlens_with_empty_samples() -> None:
    starts = torch.zeros(1, 20, dtype=torch.bool)
    starts[0, [0, 5, 12]] = True
    samples = attn.samples_from_starts(starts, torch.device("cpu"))
    assert samples.cu_seqlens.tolist() == [0, 5, 12, 20] + [20] * 12 and samples.max_len == 20
    assert attn.segment_capacity(17) == 64 and attn.segment_capacity(2) == 16 and attn.segment_capacity(65) == 256


def _samples(n: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(4, 17)
        ids = [rng.randrange(3, VOCAB) for _ in range(length)]
        labels = [IGNORE] * 2 + ids[2:]
        out.append(Sample(ids, labels))
    return out


# A packed padded batch is what HF's gpt-oss cannot read (its masks ignore the samples' bounds):
# there the padded batch holds one sample a row (tests/model/test_sink_attention.py packs it).
FLAT = [(f, packing) for f in FULL_PATH_FAMILIES for packing in (False, True) if not (packing and f in PACKING_BLIND)]


@pytest.mark.parametrize("family,packing", FLAT)
def test_a_flat_batch_trains_as_the_padded_batch_through_hf(family: str, packing: bool) -> None:
    samples = _samples(6, seed=3)
    padded = BatchPlan(samples, 3, packing, 32, 0, seed=1).batch(0, 0)
    flat = BatchPlan(samples, 3, packing, 32, 0, seed=1, flat=True).batch(0, 0)
    if not packing:
        assert flat.input_ids.shape[0] == 1 and flat.input_ids.shape[1] < padded.input_ids.numel()
    assert flat.tokens == padded.tokens
    base = tiny_model(family, VOCAB, seed=5)
    ref = _lora(copy.deepcopy(base), seed=6)
    patch_model(base, PatchFlags(varlen="reference"))
    fast = _lora(base, seed=6)
    patch_lora_layers(fast)
    assert runs_varlen(fast)
    ref.train(), fast.train()
    ref_loss = ref(input_ids=padded.input_ids, labels=padded.labels, attention_mask=padded.attention_mask,
                   position_ids=padded.position_ids, use_cache=False).loss
    fast_loss = fast(input_ids=flat.input_ids, labels=flat.labels, position_ids=flat.position_ids, use_cache=False,
                     **flat.model_kwargs()).loss  # the sample starts read on the host, as training hands them
    torch.testing.assert_close(fast_loss, ref_loss, rtol=1e-5, atol=1e-5)
    ref_loss.backward()
    fast_loss.backward()
    assert_same_trainable_grads(fast, ref)


@pytest.mark.parametrize("packing", [False, True])
def test_flat_batches_carry_their_host_starts(packing: bool) -> None:
    """A flat plan's batches carry the starts the forward would read from the device (`attn.segment_starts` of
    their own tensors), through `to`; a plan for a model without varlen attention hands the forward nothing."""
    samples = _samples(7, seed=4)
    flat = BatchPlan(samples, 3, packing, 32, 0, seed=2, flat=True)
    for i in range(len(flat)):
        b = flat.batch(0, i)
        want = attn.segment_starts(b.attention_mask, b.position_ids, b.input_ids.shape[0])
        assert b.starts is not None and torch.equal(b.starts.starts, want)
        moved = b.to(torch.device("cpu"))
        assert moved.model_kwargs() == {attn.STARTS_KWARG: b.starts}
    assert all(b.starts is not None for b in flat.in_order())
    plain = BatchPlan(samples, 3, packing, 32, 0, seed=2)
    assert plain.batch(0, 0).model_kwargs() == {} and plain.batch(0, 0).to(torch.device("cpu")).starts is None


def test_a_runs_batches_take_few_shapes() -> None:
    """Widths of flat and packed batches are bucket values (or the most a batch holds): at most 8
    per doubling of the range the batches' token counts span, however the samples fall."""
    samples = _samples(400, seed=4)
    # packed rows on HF's stack too; two rows of 100 a batch leave the longest short of full
    for packing, flat, max_len, rows in ((False, True, 64, 8), (True, True, 64, 8), (True, False, 100, 2),
                                         (True, True, 100, 2)):
        plan = BatchPlan(samples, rows, packing, max_len, 0, seed=2, flat=flat)
        batches = [plan.batch(e, i) for e in range(2) for i in range(len(plan))]
        used = [int((b.labels != IGNORE).sum() + 0) for b in batches]
        widths = {b.input_ids.shape[1] for b in batches}
        room = max_len if packing else max_len * rows
        assert all(w == bucket_width(w) or w == room for w in widths), widths
        span = max(b.input_ids.shape[1] for b in batches) / min(b.input_ids.shape[1] for b in batches)
        assert len(widths) <= 8 * (math.log2(span) + 1), widths
        assert all(b.input_ids.shape[0] == (rows if packing else 1) for b in batches) and used


def test_a_model_with_attention_sinks_takes_flat_batches_unless_varlen_is_off() -> None:
    for mode, flat in (("reference", True), ("off", False)):
        model = tiny_model("gpt_oss", VOCAB, seed=1)
        patch_model(model, PatchFlags(varlen=mode))
        assert runs_varlen(model) is flat


def test_an_unpatched_model_keeps_padded_batches() -> None:
    model = tiny_model("llama", VOCAB, seed=1)
    assert not runs_varlen(model)
    patch_model(model)  # varlen "auto": a CPU has no varlen kernel
    assert not runs_varlen(model)


@pytest.mark.gpu
def test_torch_varlen_kernel_takes_padded_cu_seqlens_and_a_loose_longest_sample() -> None:
    """On CUDA: cu_seqlens padded with empty samples and max_len = the row width give the same
    output and gradients as the exact bounds (what lets one graph replay any sample layout)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    fn = attn.varlen_backend("auto", torch.device("cuda"), torch.bfloat16, dropout=False)
    assert fn is not None
    torch.manual_seed(0)
    t, h, d = 300, 4, 64
    q, k, v = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    exact = torch.tensor([0, 17, 140, 141, 300], dtype=torch.int32, device="cuda")
    padded = torch.tensor([0, 17, 140, 141, 300, 300, 300, 300], dtype=torch.int32, device="cuda")
    outs, grads = [], []
    for cu, longest in ((exact, 159), (padded, t)):
        out = fn(q, k, v, cu, cu, longest, longest, scale=d**-0.5, window_size=(-1, 0))
        outs.append(out.float())
        grads.append(torch.autograd.grad(out.float().square().sum(), (q, k, v)))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
