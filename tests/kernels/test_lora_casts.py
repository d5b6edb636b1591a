"""kestrel.kernels.lora.casts: 16-bit copies of adapter weights reused until the weight may have changed."""

from __future__ import annotations

import pytest
import torch

from kestrel.kernels.lora import casts as lora_casts
from kestrel.kernels.lora.casts import cast, mm_to, stacked


@pytest.fixture(autouse=True)
def _fresh() -> None:
    lora_casts.clear()


def test_cast_is_kept_until_the_weight_changes_in_place() -> None:
    p = torch.nn.Parameter(torch.randn(4, 8))
    first = cast(p, torch.bfloat16)
    assert first.dtype == torch.bfloat16 and torch.equal(first, p.detach().bfloat16())
    assert cast(p, torch.bfloat16) is first  # reused
    assert cast(p, torch.float32) is p  # already in that dtype: no copy
    with torch.no_grad():
        p.copy_(torch.randn(4, 8))  # bumps the version counter
    again = cast(p, torch.bfloat16)
    assert again is not first and torch.equal(again, p.detach().bfloat16())


@pytest.mark.parametrize("flavour", [{"fused": True}, {"foreach": True}, {"foreach": False}])
def test_an_optimizer_step_invalidates_every_copy(flavour: dict) -> None:
    # torch's fused AdamW updates parameters without bumping their version counters.
    a, b = torch.nn.Parameter(torch.randn(2, 8)), torch.nn.Parameter(torch.randn(3, 2))
    other = torch.nn.Parameter(torch.randn(5))  # a different optimizer's step counts too
    opt = torch.optim.AdamW([a, b], lr=0.1, **flavour)
    old_a, old_stack = cast(a, torch.bfloat16), stacked([a, a], torch.bfloat16)
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    opt.step()
    assert torch.equal(cast(a, torch.bfloat16), a.detach().bfloat16())
    assert not torch.equal(old_a, a.detach().bfloat16())
    assert torch.equal(stacked([a, a], torch.bfloat16), torch.cat([a, a]).detach().bfloat16())
    kept = cast(b, torch.bfloat16)
    other.grad = torch.ones_like(other)
    torch.optim.SGD([other], lr=0.1).step()
    # Dropped, not just stale: a copy no use can hit again (a CUDA graph casts for itself) is freed.
    assert len(lora_casts._CASTS) == 0 and len(lora_casts._STACKS) == 0
    assert cast(b, torch.bfloat16) is not kept
    assert old_stack is not stacked([a, a], torch.bfloat16)


def test_a_data_swap_is_seen() -> None:
    p = torch.nn.Parameter(torch.randn(4, 8))
    first = cast(p, torch.bfloat16)
    p.data = torch.randn(4, 8)
    assert torch.equal(cast(p, torch.bfloat16), p.detach().bfloat16()) and not torch.equal(first, cast(p, torch.bfloat16))


def test_stacked_tracks_every_member() -> None:
    a1, a2 = torch.nn.Parameter(torch.randn(2, 8)), torch.nn.Parameter(torch.randn(3, 8))
    s = stacked([a1, a2], torch.bfloat16)
    assert s.shape == (5, 8) and torch.equal(s, torch.cat([a1, a2]).detach().bfloat16())
    assert stacked([a1, a2], torch.bfloat16) is s
    with torch.no_grad():
        a2.mul_(2)  # only the second member changes
    assert torch.equal(stacked([a1, a2], torch.bfloat16), torch.cat([a1, a2]).detach().bfloat16())
    a3 = torch.nn.Parameter(a2.detach().clone())  # same values, another weight: not the same stack
    assert stacked([a1, a3], torch.bfloat16) is not stacked([a1, a2], torch.bfloat16)


def test_copies_go_with_their_weight() -> None:
    p = torch.nn.Parameter(torch.randn(4, 8))
    cast(p, torch.bfloat16)
    assert len(lora_casts._CASTS) == 1
    del p
    assert len(lora_casts._CASTS) == 0


def test_mm_to_returns_the_requested_dtype() -> None:
    a, b = torch.randn(6, 5, dtype=torch.bfloat16), torch.randn(5, 3, dtype=torch.bfloat16)
    out = mm_to(a, b, torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out, torch.mm(a, b).float())
    assert mm_to(a, b, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.gpu
def test_mm_to_on_cuda_writes_fp32_from_the_accumulator() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    a = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    out = mm_to(a, b.t(), torch.float32)
    exact = a.double() @ b.double().t()
    assert out.dtype == torch.float32
    # fp32 sums of exact bf16 products: far closer than one bf16 rounding of the result
    assert ((out.double() - exact).abs() <= 1e-5 * (a.double().abs() @ b.double().abs().t())).all()
    transposed = mm_to(a.t().contiguous().t(), b.t(), torch.float32)
    assert torch.equal(transposed, out)


def test_casts_during_a_capture_are_made_afresh_and_kept_nowhere(monkeypatch) -> None:
    w = torch.randn(4, 8)
    kept = cast(w, torch.bfloat16)
    monkeypatch.setattr(lora_casts, "_capturing", lambda t: True)
    fresh, pair = cast(w, torch.bfloat16), stacked([w, w.clone()], torch.bfloat16)
    other = torch.randn(4, 8)
    cast(other, torch.bfloat16)
    monkeypatch.undo()
    assert fresh is not kept and torch.equal(fresh, kept) and pair.shape == (8, 8)
    assert cast(w, torch.bfloat16) is kept  # the kept copy is still the one in use
    assert lora_casts._CASTS.get(other) is None  # nothing was kept for the call in the capture


class _CastsInBackward(torch.autograd.Function):
    """y = x; its backward casts `w` and records the copy it got (as the LoRA Functions' backward does)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, got: list) -> torch.Tensor:
        ctx.w, ctx.got = w, got
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        copy = cast(ctx.w, torch.bfloat16)
        ctx.got.append(copy)
        return grad * copy.float().sum(), None, None


@pytest.mark.gpu
def test_a_backward_run_from_a_capture_casts_afresh_on_autograds_device_thread() -> None:
    """`torch.autograd.grad` called in a capture on the main thread runs CUDA backward nodes on autograd's
    device thread: the cast there must see the capture too, and not bake in the copy kept eagerly (freed at
    the next optimizer step, which left a graph captured in a first pass reading freed memory)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    w = torch.randn(4, 8, device="cuda")
    kept = cast(w, torch.bfloat16)
    x = torch.randn(16, device="cuda")
    got: list[torch.Tensor] = []
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        h = x.detach().requires_grad_(True)
        (dx,) = torch.autograd.grad(_CastsInBackward.apply(h, w, got), h, torch.ones_like(x))
    assert len(got) == 1 and got[0] is not kept, "the backward in the capture used the eagerly kept copy"
    assert cast(w, torch.bfloat16) is kept  # and it kept nothing of its own
    graph.replay()
    torch.testing.assert_close(dx, torch.full_like(x, float(kept.float().sum())))


def test_a_run_timing_its_graphs_keeps_no_casts_and_others_do(tiny_model_dir, monkeypatch) -> None:
    """`cuda_graphs: auto` runs a layer eagerly only where the GPU sets the pace, so its adapters' casts are made
    at each use and none stands at the step's memory peak; graphs forced off keep them as before, and turning
    checkpointing off unmarks the adapters."""
    from kestrel.config import LoraSettings
    from kestrel.model.loader import load
    from kestrel.model.lora import attach_lora
    from kestrel.recompute.checkpoint import set_gradient_checkpointing

    monkeypatch.delenv("KESTREL_CUDA_GRAPHS", raising=False)
    model, _ = load(str(tiny_model_dir("llama")), 64, dtype="bf16", device="cpu")
    model = attach_lora(model, LoraSettings(r=8, alpha=16))
    model.train()
    adapters = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(5, 200, (2, 24))

    def kept_after_a_step(graphs: str) -> int:
        set_gradient_checkpointing(model, "standard", graphs)
        lora_casts.clear()
        model(input_ids=ids, labels=ids).loss.backward()
        return len(lora_casts._CASTS) + len(lora_casts._STACKS)

    assert kept_after_a_step("auto") == 0  # none, whatever object a backward's saved weight comes back as
    assert kept_after_a_step("off") > 0
    set_gradient_checkpointing(model, "standard", "auto")
    set_gradient_checkpointing(model, "off")
    assert not any(lora_casts._FRESH in p.__dict__ for p in adapters)
