"""chunked_token_logprobs vs `log_softmax(full logits / T).gather`: values and gradients, both
backends (Triton runs through the interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from kestrel.kernels import cross_entropy as ce
from kestrel.kernels.cross_entropy import chunked_token_logprobs, token_logprobs_reference

N, H, V = 37, 96, 1000
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """NaN-filled in place of torch.empty: an element the kernels forget to write shows up."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Five chunks (8 tokens, the last 5), two vocab blocks (1000 = 512 + 488), NaN buffers."""
    monkeypatch.setattr(ce, "_MIN_CHUNK", 8)
    monkeypatch.setattr(ce, "_MAX_BLOCK_V", 512)
    monkeypatch.setattr(ce, "_alloc", poisoned)


def make_inputs(n=N, h=H, v=V, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * (3.0 / h**0.5)).to(dtype).requires_grad_()
    ids = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, ids


def fp32_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().requires_grad_(t.requires_grad)


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """max |a - e| <= tol * max |e| (normwise), and no NaN/inf anywhere."""
    actual, expected = actual.detach().float(), expected.detach().float()
    assert actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    err, ref = (actual - expected).abs().max().item(), expected.abs().max().item()
    assert err <= tol * ref, f"max err {err:.3e} > {tol} * {ref:.3e}"


def run_both(hidden, weight, ids, temperature=1.0, softcap=None):
    """Both backpropagated with the same per-token weights (GRPO advantages can be negative)."""
    h_ref, w_ref = fp32_leaf(hidden), fp32_leaf(weight)
    ours = chunked_token_logprobs(hidden, weight, ids, temperature=temperature, softcap=softcap)
    ref = token_logprobs_reference(h_ref, w_ref, ids, temperature=temperature, softcap=softcap)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7)).to(ref.device)
    (ours * g).sum().backward()
    (ref * g).sum().backward()
    return ours, ref, h_ref, w_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["nocap", "cap5"])
def test_matches_log_softmax_gather(backend, dtype, temperature, softcap) -> None:
    hidden, weight, ids = make_inputs(dtype=dtype)
    ours, ref, h_ref, w_ref = run_both(hidden, weight, ids, temperature, softcap)
    assert ours.dtype == torch.float32 and (ours <= 0).all()
    tol = TOL[dtype]
    assert_rel(ours, ref, tol)
    assert_rel(hidden.grad, h_ref.grad, tol)
    assert_rel(weight.grad, w_ref.grad, tol)


def test_frozen_weight_batched_shape(backend) -> None:
    hidden, weight, ids = make_inputs(n=3 * 13)
    hidden = hidden.detach().reshape(3, 13, H).requires_grad_()
    weight.requires_grad_(False)
    ours, ref, h_ref, _ = run_both(hidden, weight, ids.reshape(3, 13), temperature=0.9)
    assert ours.shape == (3, 13) and weight.grad is None
    assert_rel(ours, ref, 1e-5)
    assert_rel(hidden.grad, h_ref.grad, 1e-5)


def test_padding_ids_give_zero(backend) -> None:
    hidden, weight, ids = make_inputs()
    ids[::4] = -100
    out = chunked_token_logprobs(hidden, weight, ids)
    out.sum().backward()
    keep = ids != -100
    ref = token_logprobs_reference(hidden.detach(), weight.detach(), ids.clamp(min=0))
    assert (out[~keep] == 0).all() and (hidden.grad[~keep] == 0).all()
    assert_rel(out[keep], ref[keep], 1e-5)


def test_backward_keeps_no_logits(backend) -> None:
    """Only hidden, weight, ids and lse `(N,)` are saved: the logits are recomputed."""
    hidden, weight, ids = make_inputs()
    out = chunked_token_logprobs(hidden, weight, ids)
    node = out.grad_fn
    while "PerTokenCE" not in type(node).__name__:  # under the negation and the reshape
        node = node.next_functions[0][0]
    saved = node.saved_tensors
    assert sum(t.numel() for t in saved) == hidden.numel() + weight.numel() + 2 * N


def _counting_passes(monkeypatch) -> list[bool]:
    """Each chunked sweep over the vocabulary, recorded as whether it formed hidden gradients."""
    passes: list[bool] = []
    real = ce._chunked_pass

    def spy(h, w, labels, loss, lse, scale, gh, gw, opts, compute_lse):
        passes.append(gh is not None)
        return real(h, w, labels, loss, lse, scale, gh, gw, opts, compute_lse)

    monkeypatch.setattr(ce, "_chunked_pass", spy)
    return passes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["nocap", "cap5"])
def test_frozen_weight_forms_hidden_grads_in_forward(backend, monkeypatch, dtype, softcap) -> None:
    """A frozen head (LoRA): one sweep in all, forming the unit hidden gradients with the
    log-probs; backward only scales them by each token's weight (signed, as DPO's are)."""
    passes = _counting_passes(monkeypatch)
    hidden, weight, ids = make_inputs(dtype=dtype)
    weight.requires_grad_(False)
    keep = torch.arange(N) % 5 != 0
    ours = chunked_token_logprobs(hidden, weight, ids.where(keep, -100), temperature=0.8, softcap=softcap)
    g = torch.randn(N, generator=torch.Generator().manual_seed(7))
    (ours * g).sum().backward()
    assert passes == [True]  # the forward's sweep only
    h_ref = fp32_leaf(hidden)
    ref = token_logprobs_reference(h_ref, weight.float(), ids, temperature=0.8, softcap=softcap)
    (ref * g * keep).sum().backward()
    assert (ours[~keep] == 0).all() and (hidden.grad[~keep] == 0).all()
    assert_rel(ours[keep], ref[keep], TOL[dtype])
    assert_rel(hidden.grad, h_ref.grad, TOL[dtype])


def test_frozen_weight_without_grad_forms_nothing_and_trainable_weight_recomputes(monkeypatch) -> None:
    passes = _counting_passes(monkeypatch)
    hidden, weight, ids = make_inputs()
    weight.requires_grad_(False)
    with torch.no_grad():
        chunked_token_logprobs(hidden, weight, ids)
    assert passes == [False]
    passes.clear()
    weight.requires_grad_(True)
    chunked_token_logprobs(hidden, weight, ids).sum().backward()  # grad_W needs the weights first
    assert passes == [False, True] and weight.grad is not None


def test_frozen_weight_backward_runs_once() -> None:
    hidden, weight, ids = make_inputs()
    weight.requires_grad_(False)
    out = chunked_token_logprobs(hidden, weight, ids).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        out.backward()


@pytest.mark.gpu
def test_gpu_matches_reference_and_peak_memory(monkeypatch) -> None:
    """Compiled kernel vs reference, then GRPO's shape (N=8192, H=4096, V=128256, frozen bf16
    lm_head): forward + backward stay within 0.25 GB of the inputs (full logits: 2.1 GB)."""
    monkeypatch.delenv("KESTREL_KERNELS", raising=False)
    monkeypatch.setattr(ce, "_MAX_BLOCK_V", 8192)
    monkeypatch.setattr(ce, "_MIN_CHUNK", 128)
    hidden, weight, ids = make_inputs(n=1000, h=256, v=50000, dtype=torch.bfloat16)
    hidden, weight = hidden.detach().cuda().requires_grad_(), weight.detach().cuda().requires_grad_()
    ours, ref, h_ref, w_ref = run_both(hidden, weight, ids.cuda(), temperature=0.8, softcap=5.0)
    assert_rel(ours, ref, 1e-2)
    assert_rel(hidden.grad, h_ref.grad, 1e-2)
    assert_rel(weight.grad, w_ref.grad, 1e-2)

    n, h, v = 8192, 4096, 128256
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device="cuda") * (3.0 / h**0.5)).to(torch.bfloat16)
    ids = torch.randint(0, v, (n,), device="cuda")
    chunked_token_logprobs(hidden, weight, ids).sum().backward()  # compile + cuBLAS workspace
    hidden.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    chunked_token_logprobs(hidden, weight, ids, temperature=0.9).sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 0.25e9, f"peak {extra / 1e9:.3f} GB beyond inputs"
