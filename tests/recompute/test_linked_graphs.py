"""CUDA graphs of linked decoder layers (`kestrel.recompute.linked_graphs`): Gemma 4's per-layer
inputs and shared K/V as a graphed layer's static inputs and outputs.

On CPU: how the ties map onto the graphs' flat argument lists and back, the zero-filled dw, the
signature keys, the strided static buffers; and a whole checkpointed Gemma 4 trained through
`GraphedLayer` with each CUDA graph stood in for by its body (`_fake_graphs`: a capture runs the
body's Python but leaves the static buffers as fed, a replay runs the body on them), which must
train exactly as the eager checkpointing does. On CUDA (`gpu`): the same with real graphs, 16-bit
LoRA and QLoRA, standard and offloaded checkpointing.
"""

from __future__ import annotations

import copy
import functools
from collections import UserDict

import pytest
import torch

from kestrel.recompute import layer_graphs
from kestrel.recompute.graph_inputs import NotGraphable, StaticBuffers
from kestrel.recompute.linked import LinkedCall
from kestrel.recompute.linked_graphs import GraphLinks, WrittenLike, feed_dw, grad_lists, split_grads
from tests.support.tiny import tiny_model

VOCAB = 97


# --- The ties' mapping ---------------------------------------------------------------------------


def test_split_grads_gives_each_input_its_gradient_and_none_to_those_without_grad() -> None:
    dh, a, c, p1, p2 = (torch.full((1,), float(i)) for i in range(5))
    got_dh, links, params = split_grads((dh, a, c, p1, p2), [True, False, True], 2)
    assert got_dh is dh and links[0] is a and links[1] is None and links[2] is c
    assert params[0] is p1 and params[1] is p2
    with pytest.raises(ValueError, match="4 gradients"):
        split_grads((dh, a, c, p1), [True, False, True], 2)


def test_grad_lists_pair_each_written_tensor_with_its_dw_and_take_only_inputs_that_need_grad() -> None:
    h = torch.ones(2, requires_grad=True)
    a = torch.full((2,), 2.0, requires_grad=True)
    frozen = torch.full((2,), 3.0)
    p = torch.full((2,), 5.0, requires_grad=True)
    y = h * a * p
    w_far, w_const = h * 7.0, torch.zeros(2)  # the second: autograd cannot reach it
    dy, dw_far, dw_const = torch.ones(2), torch.full((2,), 10.0), torch.full((2,), 100.0)
    outputs, inputs, douts = grad_lists(h, y, dy, [w_const, w_far], [dw_const, dw_far], [a, frozen], [p])
    assert outputs[0] is y and outputs[1] is w_far and len(outputs) == 2
    assert douts[0] is dy and douts[1] is dw_far and len(douts) == 2
    assert inputs[0] is h and inputs[1] is a and inputs[2] is p and len(inputs) == 3
    dh, links, params = split_grads(torch.autograd.grad(outputs, inputs, douts), [True, False], 1)
    assert torch.equal(dh, a * p + 70.0) and torch.equal(links[0], h * p) and links[1] is None
    assert torch.equal(params[0], h * a)


def test_missing_dw_is_zero_filled_and_fed_ones_are_copied() -> None:
    bufs = StaticBuffers()
    dw = [bufs.get(("dout", i), (3,), torch.float32, torch.device("cpu")) for i in range(2)]
    for buf in dw:
        buf.fill_(7.0)
    grad = torch.arange(3.0)
    feed_dw(bufs, dw, (None, grad))
    assert torch.equal(dw[0], torch.zeros(3)) and torch.equal(dw[1], grad)
    dw[1].fill_(-1.0)  # a replay's neighbour overwrote it; what it holds is forgotten only by feed_dw
    bufs.forget(dw[1])
    feed_dw(bufs, dw, (grad, grad))
    assert torch.equal(dw[0], grad) and torch.equal(dw[1], grad)
    with pytest.raises(ValueError, match="1 gradients for 2"):
        feed_dw(bufs, dw, (grad,))


def _layer_call(shared: UserDict | None, writes: str | None = None) -> tuple[functools.partial, tuple]:
    """A stand-in decoder layer: y = x * a + (the K it reads, if any); writes K = 2x under `writes`."""
    module = torch.nn.Linear(4, 4)

    def forward(x, a, shared_kv_states=None, scale=1.0, reads=None):
        if writes is not None:
            shared_kv_states[writes] = (x * 2.0, x * 3.0)
        k = shared_kv_states[reads][0] if reads else 0.0
        return x * a * scale + k

    module.forward = forward
    a = torch.ones(2, 4, requires_grad=True)
    kwargs = {"shared_kv_states": shared, "scale": 1.0} if shared is not None else {"scale": 1.0}
    return functools.partial(module.__call__, **kwargs), (a,)


def test_the_key_tells_a_publishing_call_from_a_reading_one_and_masks_the_ties() -> None:
    writer_map, reader_map = UserDict(), UserDict(full=(torch.zeros(2, 4), torch.zeros(2, 4)))
    keys = []
    for shared in (writer_map, reader_map):
        run, args = _layer_call(shared)
        linked = LinkedCall.of(run, args, "shared_kv_states")
        links = GraphLinks(linked, run.keywords)
        masked_args, masked_kwargs = links.masked(args, run.keywords)
        assert masked_args == (None,) and masked_kwargs == {"scale": 1.0}
        keys.append(links.key(torch.device("cpu")))
    assert keys[0] != keys[1]
    assert keys[1][1] == (("full", 0), ("full", 1))  # the slots it reads
    run, args = _layer_call(reader_map)
    wide = (torch.zeros(2, 6), torch.zeros(2, 4))  # another K shape: another signature
    other = GraphLinks(LinkedCall.of(run, args, "shared_kv_states"), run.keywords)
    other_wide = GraphLinks(LinkedCall(run, args, UserDict(full=wide)), run.keywords)
    assert other.key(torch.device("cpu")) == keys[1] != other_wide.key(torch.device("cpu"))
    with pytest.raises(NotGraphable, match="device"):
        other.key(torch.device("meta"))


def test_bind_runs_the_call_on_the_static_ties_in_a_fresh_mapping() -> None:
    real = UserDict(sliding=(torch.ones(2, 4), torch.ones(2, 4)))
    run, args = _layer_call(real, writes="full")
    linked = LinkedCall.of(run, args, "shared_kv_states")
    links = GraphLinks(linked, run.keywords)
    margs, mkwargs = links.masked(args, run.keywords)
    statics = [torch.full((2, 4), 5.0), torch.full((2, 4), 7.0), torch.full((2, 4), 11.0)]  # a, then the K/V read
    like = [WrittenLike(("full", i), (2, 4), (4, 1), torch.float32) for i in range(2)]
    fn = links.bind(run.func, margs, {**mkwargs, "reads": "sliding"}, statics, like)
    x = torch.ones(2, 4)
    y, written = fn(x)
    assert torch.equal(y, x * 5.0 + 7.0)  # the static a and the static K, not the real ones
    assert torch.equal(written[0], x * 2.0) and torch.equal(written[1], x * 3.0)
    assert set(real) == {"sliding"} and torch.equal(real["sliding"][0], torch.ones(2, 4))  # untouched
    wrong = links.bind(run.func, margs, mkwargs, statics, like[:1])
    with pytest.raises(NotGraphable, match="wrote"):
        wrong(x)


def test_strided_buffers_keep_a_transposed_layout_and_are_never_mistaken_for_another_layout() -> None:
    bufs = StaticBuffers()
    kv = torch.randn(2, 5, 3, 4).transpose(1, 2)  # (B, H, T, D) view of (B, T, H, D)
    buf = bufs.get_strided("k", tuple(kv.shape), kv.stride(), kv.dtype, kv.device)
    assert buf.stride() == kv.stride()
    plain = torch.randn(2, 3, 5, 4)
    flat = bufs.get_strided("k", tuple(plain.shape), plain.stride(), plain.dtype, plain.device)
    assert flat.is_contiguous() and flat.shape == buf.shape and flat.data_ptr() == buf.data_ptr()
    bufs.feed(buf, kv)
    bufs.feed(flat, kv)  # same storage, same shape, other layout: copied again
    assert bufs.copies == 2 and torch.equal(flat, kv)
    sliced = torch.randn(2, 5, 3, 4)[:, :, 1, :]  # a per-layer input: not dense, so contiguous
    assert bufs.get_strided("p", tuple(sliced.shape), sliced.stride(), sliced.dtype, sliced.device).is_contiguous()
    assert bufs.get_strided("s", (), (), torch.float32, torch.device("cpu")).shape == ()  # a 0-d tensor kept


# --- A whole Gemma 4 through GraphedLayer, graphs stood in for by their bodies (CPU) -------------


class _Replayed:
    """A captured CUDA graph's stand-in: a replay runs the body (on the static buffers)."""

    def __init__(self, body) -> None:
        self.body = body

    def replay(self) -> None:
        self.body()


def _fake_graphs(monkeypatch: pytest.MonkeyPatch, fail: set | None = None) -> list[_Replayed]:
    """Graph CPU layers: what checks for CUDA sees it, a capture runs the body's Python and puts
    the static buffers back as they were fed (a capture records kernels, it does not run them).
    The layers in `fail` do not capture."""
    captured: list[_Replayed] = []

    def as_cuda(fn):
        def call(*args, **kwargs):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
                mp.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
                return fn(*args, **kwargs)
        return call

    def device(self, dev):
        return self.devices.setdefault(dev, layer_graphs._Device(StaticBuffers(), None, None))

    def capture(self, g, body):
        if self.layer in (fail or ()):
            g.failed = True
            return None
        bufs = self.registry.device(g.x.device).buffers
        fed = {k: v.clone() for k, v in bufs.storage.items()}
        body()
        for k, v in fed.items():
            bufs.storage[k].copy_(v)
        captured.append(_Replayed(body))
        return captured[-1]

    for name in ("graphable", "signature"):
        monkeypatch.setattr(layer_graphs, name, as_cuda(getattr(layer_graphs, name)))
    monkeypatch.setattr(layer_graphs.GraphRegistry, "device", device)
    monkeypatch.setattr(layer_graphs.GraphedLayer, "_capture", capture)
    return captured


def _batch(step: int) -> dict[str, torch.Tensor]:
    """Two right-padded rows, new tokens every step (a replay must read this step's ties)."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(4, VOCAB, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


@pytest.mark.parametrize("mode", ["standard", "offload"])
@pytest.mark.parametrize("family", ["gemma4_text", "llama"])
def test_graphed_layers_train_as_eager_checkpointing(monkeypatch, family, mode) -> None:
    """Gemma 4's layers, all linked, and Llama's, none linked, through their graphs' bodies."""
    from kestrel.recompute.checkpoint import set_gradient_checkpointing

    captured = _fake_graphs(monkeypatch)
    ref = tiny_model(family, VOCAB, seed=3)
    fast = copy.deepcopy(ref)
    set_gradient_checkpointing(ref, mode, "off")
    run = set_gradient_checkpointing(fast, mode, "on")
    for model in (ref, fast):
        model.train()
    for step in range(4):  # eager, backward captured, first pass captured, replayed
        losses = []
        for model in (ref, fast):
            model.zero_grad(set_to_none=True)
            loss = model(**_batch(step), use_cache=False).loss
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(fast.named_parameters(), ref.parameters()):
            if q.grad is None:
                assert p.grad is None or not p.grad.any(), name
                continue
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"step {step}: {name}")
        with torch.no_grad():
            for p, q in zip(fast.parameters(), ref.parameters()):
                if q.grad is not None:
                    p.sub_(0.1 * p.grad)
                    q.sub_(0.1 * q.grad)
    layers = fast.config.num_hidden_layers
    stats = run.graphs.stats()
    assert stats["forward"] == stats["backward"] == layers and stats["failed"] == 0, stats
    assert stats["linked"] == (layers if family == "gemma4_text" else 0), stats
    assert len(captured) == 2 * layers


def _train_lora(graphs: bool, steps: int = 4) -> tuple[list[float], list[torch.Tensor], dict[str, int]]:
    """Kestrel's Gemma 4 (patched, fused LoRA) trained `steps` SGD steps, graphs forced on or off."""
    from kestrel.config import LoraSettings
    from kestrel.model.lora import attach_lora
    from kestrel.model.patching import patch_model
    from kestrel.recompute.checkpoint import set_gradient_checkpointing

    model = tiny_model("gemma4_text", VOCAB, seed=0)
    patch_model(model)
    torch.manual_seed(0)
    model = attach_lora(model, LoraSettings(r=8, alpha=16))
    run = set_gradient_checkpointing(model, "standard", "on" if graphs else "off")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    losses = []
    for step in range(steps):
        loss = model(**_batch(step), use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, [p.detach().clone() for p in params], run.graphs.stats()


def test_graphed_patched_lora_gemma4_trains_as_eager(monkeypatch) -> None:
    """Kestrel's forwards and fused LoRA layers (adapters updated in place between replays)."""
    eager, eager_w, _ = _train_lora(False)
    _fake_graphs(monkeypatch)
    graphed, graphed_w, stats = _train_lora(True)
    assert stats["forward"] == stats["backward"] == stats["linked"] == 4 and stats["failed"] == 0, stats
    assert graphed == pytest.approx(eager, rel=1e-6)
    for a, b in zip(graphed_w, eager_w):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_linked_call_that_does_not_capture_runs_eagerly_through_its_graphed_layer(monkeypatch) -> None:
    """A reader of shared K/V whose capture fails (as `GraphedLayer._capture` reports it) runs
    `LinkedCall`'s eager passes from then on, between replaying neighbours, with eager
    checkpointing's gradients."""
    from kestrel.recompute.checkpoint import set_gradient_checkpointing

    ref = tiny_model("gemma4_text", VOCAB, seed=3)
    fast = copy.deepcopy(ref)
    reader = fast.model.layers[2]
    assert reader.self_attn.is_kv_shared_layer
    _fake_graphs(monkeypatch, fail={reader})
    set_gradient_checkpointing(ref, "standard", "off")
    run = set_gradient_checkpointing(fast, "standard", "on")
    for step in range(4):
        for model in (ref, fast):
            model.train()
            model.zero_grad(set_to_none=True)
            model(**_batch(step), use_cache=False).loss.backward()
        for (name, p), q in zip(fast.named_parameters(), ref.parameters()):
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"step {step}: {name}")
    stats = run.graphs.stats()
    layers = fast.config.num_hidden_layers
    assert stats["forward"] == stats["backward"] == stats["linked"] == layers - 1 and stats["failed"] == 1, stats


def test_auto_mode_times_linked_layouts(monkeypatch) -> None:
    """The chooser sees a Gemma 4 forward's layout (its first layer is linked) and times it."""
    from kestrel.recompute.checkpoint import set_gradient_checkpointing

    _fake_graphs(monkeypatch)
    model = tiny_model("gemma4_text", VOCAB, seed=3)
    run = set_gradient_checkpointing(model, "standard", "auto")
    model.train()
    for step in range(2):
        model(**_batch(step), use_cache=False).loss.backward()
    assert [lay.sightings for lay in run.chooser.layouts.values()] == [2]


# --- CUDA ----------------------------------------------------------------------------------------


def _train_cuda(folder, graphs: bool, monkeypatch, *, qlora: bool, mode: str, steps: int = 4):
    """Train the tiny Gemma 4 `steps` steps on one padded batch, graphs forced on or off: the
    losses, the trainable weights after, the graphs' counters."""
    from kestrel.config import LoraSettings
    from kestrel.model.loader import load
    from kestrel.model.lora import attach_lora
    from kestrel.recompute.checkpoint import set_gradient_checkpointing

    monkeypatch.delenv("KESTREL_CUDA_GRAPHS", raising=False)
    torch.manual_seed(0)
    model, _ = load(str(folder), 64, load_in_4bit=qlora, dtype="bf16", device="cuda")
    model = attach_lora(model, LoraSettings(r=8, alpha=16))
    run = set_gradient_checkpointing(model, mode, "on" if graphs else "off")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    ids = torch.randint(5, 200, (2, 48), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0  # padded: Hugging Face then builds full (not broadcast) attention masks
    ids, mask = ids.cuda(), mask.cuda()
    labels = ids.masked_fill(mask == 0, -100)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    stats = run.graphs.stats()
    run.release()
    return losses, [p.detach().float().cpu() for p in params], stats


@pytest.mark.gpu
@pytest.mark.parametrize(("qlora", "mode"), [(False, "standard"), (False, "offload"), (True, "standard"), (True, "offload")],
                         ids=["lora", "lora-offload", "qlora", "qlora-offload"])
def test_graphed_gemma4_trains_as_eager_gemma4(tiny_model_dir, monkeypatch, qlora, mode) -> None:
    """Every Gemma 4 layer (each linked: a per-layer input; the first two publish K/V, the last
    two read them) is captured and replayed, with the losses and adapter weights of eager
    checkpointing."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    folder = tiny_model_dir("gemma4_text")
    eager, eager_w, eager_stats = _train_cuda(folder, False, monkeypatch, qlora=qlora, mode=mode)
    graphed, graphed_w, stats = _train_cuda(folder, True, monkeypatch, qlora=qlora, mode=mode)
    layers = 4  # the tiny Gemma 4's
    assert eager_stats["forward"] == 0
    assert stats["forward"] == stats["backward"] == stats["linked"] == layers, stats
    assert stats["failed"] == 0 and stats["eager_backwards"] == 0, stats
    # Same kernels on the same values (the shared K/V's static buffers keep their strides):
    # replays reproduce the eager steps up to cuBLAS picking another algorithm on the capture stream.
    for step, (a, b) in enumerate(zip(graphed, eager)):
        assert abs(a - b) <= 1e-3 * abs(b), f"loss {step}: graphed {a} vs eager {b}"
    for a, b in zip(graphed_w, eager_w):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-4)
