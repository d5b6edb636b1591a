"""CUDA graphs of checkpointed decoder layers (`kestrel.recompute.layer_graphs`).

On CPU: the argument signatures and static copies, the input buffers' copy skipping, and that
nothing is graphed off CUDA. On CUDA (`gpu`): training with graphs gives the very losses and
adapter weights of training without them (16-bit LoRA and QLoRA, recompute and offload,
gradient accumulation), the graphs are really captured and replayed, and the layer's inputs
are copied in only where they must be.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import weakref
from pathlib import Path

import pytest
import torch

from kestrel.recompute import layer_graphs
from kestrel.recompute.graph_inputs import NotGraphable, StaticBuffers, signature, substitute


@dataclasses.dataclass(frozen=True)
class _Meta:
    starts: torch.Tensor
    longest: int


def test_signature_describes_shapes_and_values_and_substitute_puts_tensors_back(monkeypatch) -> None:
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # CPU stands in
    cos, starts = torch.zeros(1, 5, 4), torch.tensor([0, 5], dtype=torch.int32)
    args = {"position_embeddings": (cos, cos), "meta": _Meta(starts, 5), "mask": None, "fn": torch.add}
    leaves: list[torch.Tensor] = []
    sig = signature(args, leaves)
    assert leaves == [cos, cos, starts] and hash(sig) is not None
    other = {"position_embeddings": (cos, cos), "meta": _Meta(starts, 6), "mask": None, "fn": torch.add}
    assert signature(other, []) != sig  # an int inside the metadata is part of the key
    wider = {**args, "position_embeddings": (torch.zeros(1, 6, 4), cos)}
    assert signature(wider, []) != sig
    statics = [torch.ones(1, 5, 4), torch.ones(1, 5, 4) * 2, torch.tensor([0, 7], dtype=torch.int32)]
    out = substitute(args, iter(statics))
    assert out["position_embeddings"][0] is statics[0] and out["position_embeddings"][1] is statics[1]
    assert out["meta"].starts is statics[2] and out["meta"].longest == 5 and out["fn"] is torch.add
    assert args["meta"].starts is starts  # the original is untouched


def test_what_a_static_copy_cannot_stand_for_is_refused() -> None:
    with pytest.raises(NotGraphable, match="CPU"):
        signature(torch.zeros(3), [])  # not on CUDA
    with pytest.raises(NotGraphable, match="object"):
        signature({"cache": object()}, [])


def test_buffers_copy_only_what_they_do_not_hold() -> None:
    bufs = StaticBuffers()
    src = torch.arange(6.0).view(2, 3)
    buf = bufs.like("x", src)
    bufs.feed(buf, src)
    assert torch.equal(buf, src) and bufs.copies == 1
    bufs.feed(buf, src)
    assert bufs.copies == 1  # same tensor, same version
    src.add_(1)
    bufs.feed(buf, src)
    assert bufs.copies == 2 and torch.equal(buf, src)  # changed in place: copied again
    other = src.clone()
    bufs.feed(buf, other)
    assert bufs.copies == 3  # equal values but another tensor: copied
    bufs.hold(buf, src)
    bufs.feed(buf, src)
    assert bufs.copies == 3
    bufs.forget(buf)
    bufs.feed(buf, src)
    assert bufs.copies == 4
    assert bufs.like("x", src) is buf and bufs.like("x", torch.zeros(3, 3)) is not buf


def test_off_cuda_the_checkpoint_runs_the_plain_call() -> None:
    layer = torch.nn.Linear(4, 4)
    run = functools.partial(layer.__call__)
    fn = layer_graphs.wrap(run, torch.zeros(2, 4), (), layer_graphs.GraphRegistry())
    assert not isinstance(fn, layer_graphs.GraphedLayer)
    x = torch.randn(2, 4)
    assert torch.equal(fn(x), layer(x))


def test_a_kept_tensor_reads_as_held_only_inside_the_block_and_only_when_bound() -> None:
    """What a backward graph captured ahead of the first pass records (`backward_graph_capture: first_pass`):
    the recompute takes the bound buffer, as it will once the first pass has kept E there."""
    from kestrel.recompute.host_tensors import OffloadState, _KeptGate

    kept = _KeptGate(OffloadState())
    buf = torch.zeros(3, 4)
    kept.bind(buf)
    assert kept.take() is None  # nothing kept yet
    with kept.as_held():
        assert kept.take() is buf
    assert kept.take() is None and not kept.holds
    unbound = _KeptGate(OffloadState())
    unbound.bind(None)  # the first sighting kept nothing: nothing to read, held or not
    with unbound.as_held():
        assert unbound.take() is None


def test_the_runs_backward_capture_setting_reaches_its_graphs(tiny_model_dir, monkeypatch) -> None:
    from kestrel.model.loader import load
    from kestrel.recompute.checkpoint import set_gradient_checkpointing

    model, _ = load(str(tiny_model_dir("llama")), 64, dtype="fp32", device="cpu")
    monkeypatch.delenv("KESTREL_BACKWARD_CAPTURE", raising=False)
    assert set_gradient_checkpointing(model, "standard", "off").graphs.capture_ahead  # the default: first_pass
    assert not set_gradient_checkpointing(model, "offload", "off", backward_capture="backward").graphs.capture_ahead
    monkeypatch.setenv("KESTREL_BACKWARD_CAPTURE", "first_pass")  # the debugging override wins
    assert set_gradient_checkpointing(model, "offload", "off", backward_capture="backward").graphs.capture_ahead
    set_gradient_checkpointing(model, "off")


def test_buffers_of_one_slot_share_storage_across_shapes_and_never_mistake_one_for_another() -> None:
    bufs = StaticBuffers()
    big, small = torch.arange(12.0).view(3, 4), torch.arange(6.0).view(2, 3) + 100
    b_big = bufs.like("x", big)
    b_small = bufs.like("x", small)
    assert b_small.data_ptr() == b_big.data_ptr()  # one storage, viewed from its start
    bufs.feed(b_big, big)
    bufs.feed(b_small, small)  # overwrites the start of the big one's values
    assert torch.equal(b_small, small)
    bufs.feed(b_big, big)  # what the storage holds now is `small`: copied again
    assert torch.equal(b_big, big) and bufs.copies == 3
    huge = torch.zeros(5, 5)
    b_huge = bufs.like("x", huge)
    assert b_huge.numel() == 25 and bufs.like("x", huge) is b_huge  # the storage grew; views cached
    assert bufs.like("grad", big).data_ptr() != b_huge.data_ptr()  # other slots: their own storage


def test_buffers_made_again_after_a_release_start_at_what_was_asked_before_it() -> None:
    """A release keeps what the static buffers were asked for (`GraphRegistry.buffer_sizes`) and the next
    buffers start each slot's storage that large, so the layouts graphed again replace no storage (dropping no
    graph captured meanwhile); a size asked before one release but not before the next is forgotten (a large
    layout since decided eager holds nothing), and a slot never asked for is made to size."""
    cpu = torch.device("cpu")
    x = ("x", torch.float32, cpu)
    registry = layer_graphs.GraphRegistry()
    registry.devices[cpu] = layer_graphs._Device(StaticBuffers(), None, None)
    first = registry.devices[cpu].buffers
    first.get("x", (2, 3), torch.float32, cpu)
    first.get("x", (4, 3), torch.float32, cpu)  # the large layout, probed graphed
    assert first.replaced == 1
    registry.release()
    assert registry.buffer_sizes == {x: 12} and not registry.devices
    again = StaticBuffers(sizes=registry.buffer_sizes)  # as `GraphRegistry.device` makes them
    small = again.get("x", (2, 3), torch.float32, cpu)
    assert again.storage[x].numel() == 12 and small.shape == (2, 3)
    big = again.get("x", (4, 3), torch.float32, cpu)
    assert again.replaced == 0 and big.data_ptr() == small.data_ptr()
    assert again.get("y", (1, 2), torch.float32, cpu).numel() == 2
    registry.devices[cpu] = layer_graphs._Device(StaticBuffers(sizes=registry.buffer_sizes), None, None)
    registry.devices[cpu].buffers.get("x", (2, 3), torch.float32, cpu)  # the large layout not captured since
    registry.release()
    assert registry.buffer_sizes == {x: 6}
    assert StaticBuffers(sizes=registry.buffer_sizes).get("x", (1, 3), torch.float32, cpu).untyped_storage().nbytes() == 24


def test_graphs_on_a_replaced_storage_are_dropped_so_it_is_freed() -> None:
    registry = layer_graphs.GraphRegistry()
    bufs = StaticBuffers(layer_graphs._weak_call(registry.drop_viewing))
    layers = [torch.nn.Linear(2, 2) for _ in range(2)]
    small = torch.arange(6.0).view(2, 3)

    def add(name: str, shape: tuple[int, ...], registry: layer_graphs.GraphRegistry = registry) -> None:
        for layer in layers:
            registry.state(layer).graphs[name] = layer_graphs._Graphs(
                bufs.get("x", shape, torch.float32, small.device), [bufs.like(("arg", 0), small)])

    add("small", (2, 3))
    bufs.feed(registry.state(layers[0]).graphs["small"].x, small)
    base = bufs.storage[("x", torch.float32, small.device)]
    old, old_ptr = weakref.ref(base), base.data_ptr()
    del base
    add("smaller", (1, 3))  # views the same storage
    assert registry.dropped == 0 and bufs.replaced == 0 and old_ptr in bufs.holds
    add("big", (4, 3))  # grows "x": every graph on the old storage goes, and with them the storage
    assert [list(registry.state(layer).graphs) for layer in layers] == [["big"], ["big"]]
    assert registry.dropped == 4 and bufs.replaced == 1 and old() is None
    assert old_ptr not in bufs.holds  # what the old addresses held is forgotten: they may come back as another buffer
    del registry
    gc.collect()
    bufs.get("x", (9, 3), torch.float32, small.device)  # the registry gone: nothing to tell
    assert bufs.replaced == 2


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, hidden: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.lin(hidden) * scale


def test_an_observed_eager_call_counts_a_sighting_and_a_release_keeps_the_sightings() -> None:
    """`observe`: an eager forward (a layout's first, `GraphChooser.first_sighting`) runs the layer as it is and
    counts as the signature's sighting, so the layout's first graphed forward captures; a release drops the
    graphs and their counters but keeps the sightings (a layout graphed again captures at its next forward)."""
    registry, layer = layer_graphs.GraphRegistry(capture_ahead=True), _Scaled()
    hidden = torch.randn(2, 3, 4)
    run = functools.partial(layer.__call__, scale=2.0)
    with torch.no_grad():
        outs = [layer_graphs.GraphedLayer(run, hidden, (), registry, observe=True)(hidden) for _ in range(2)]
        want = layer(hidden, scale=2.0)
    assert all(torch.equal(out, want) for out in outs)
    state = registry.state(layer)
    assert list(state.seen.values()) == [2] and not state.graphs and not registry.devices
    state.graphs["stale"] = layer_graphs._Graphs(torch.zeros(1), [])
    state.captures, state.eager_backwards, state.off = 5, 1, True
    registry.release()
    assert not state.graphs and (state.captures, state.eager_backwards, state.off) == (0, 0, False)
    assert list(state.seen.values()) == [2] and registry.stats()["forward"] == 0


# --- CUDA ----------------------------------------------------------------------------------------


def _train(folder: Path, graphs: bool | None, monkeypatch, *, qlora: bool, mode: str, accumulate: int = 1,
           steps: int = 4, deferral=None, keep_attention: str = "off", keep_projection: str = "off",
           keep_qkv: str = "off", backward_capture: str = "backward",
           ) -> tuple[list[float], list[torch.Tensor], dict[str, int]]:
    """Train the tiny model `steps` steps with graphs on, off, or (None) as the environment says;
    `deferral`: the run's `kestrel.recompute.mlp_deferral.MLPDeferral` (None: the default); `keep_attention`:
    whether offloaded layers keep their attention output (off | auto | on, `kestrel.model.kept_attention`),
    `keep_projection` (off | on) their output projection's output with it, `keep_qkv` (off | on) Q, K and V;
    `backward_capture`: when the backward graphs are captured (`performance.backward_graph_capture`)."""
    from kestrel.recompute.checkpoint import set_gradient_checkpointing
    from kestrel.config import LoraSettings
    from kestrel.model.loader import load
    from kestrel.model.lora import attach_lora

    monkeypatch.delenv("KESTREL_CUDA_GRAPHS", raising=False)
    monkeypatch.delenv("KESTREL_BACKWARD_CAPTURE", raising=False)
    torch.manual_seed(0)
    model, _ = load(str(folder), 64, load_in_4bit=qlora, dtype="bf16", device="cuda")
    model = attach_lora(model, LoraSettings(r=8, alpha=16))
    run = set_gradient_checkpointing(model, mode, {True: "on", False: "off", None: "auto"}[graphs], deferral=deferral,
                                     keep_attention=keep_attention, keep_projection=keep_projection, keep_qkv=keep_qkv,
                                     backward_capture=backward_capture)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(5, 200, (2, 48), generator=gen).cuda() for _ in range(accumulate)]
    losses, copies = [], []
    for _ in range(steps):
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss
            (loss / accumulate).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        copies.append(run.graphs.stats()["copies"])
    stats = {**run.graphs.stats(), "last_step_copies": copies[-1] - copies[-2]}
    run.release()
    return losses, [p.detach().float().cpu() for p in params], stats


@pytest.mark.gpu
@pytest.mark.parametrize(("qlora", "mode", "accumulate"), [
    (False, "standard", 1), (True, "standard", 1), (True, "offload", 1), (True, "standard", 2),
], ids=["lora", "qlora", "qlora-offload", "qlora-accumulate"])
def test_graphed_training_equals_eager_training(tiny_model_dir, monkeypatch, qlora, mode, accumulate) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    folder = tiny_model_dir("llama")
    eager, eager_w, eager_stats = _train(folder, False, monkeypatch, qlora=qlora, mode=mode, accumulate=accumulate)
    graphed, graphed_w, stats = _train(folder, True, monkeypatch, qlora=qlora, mode=mode, accumulate=accumulate)
    layers = 2  # the tiny llama's
    assert eager_stats["forward"] == 0
    assert stats["forward"] == stats["backward"] == layers and stats["failed"] == 0, stats
    # Offloaded, each layer's graphs keep its MLP gate product in a static buffer, paged out
    # between the passes (the eager run pages it out from its own blocks).
    assert stats["gates"] == (layers if mode == "offload" else 0) and stats["eager_backwards"] == 0, stats
    # Same kernels on the same values: replays reproduce the eager step bit for bit, up to
    # cuBLAS picking another algorithm on the capture stream (not seen, allowed a bf16 ulp).
    for step, (a, b) in enumerate(zip(graphed, eager)):
        assert abs(a - b) <= 1e-3 * abs(b), f"loss {step}: graphed {a} vs eager {b}"
    for a, b in zip(graphed_w, eager_w):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-4)
    # Copies in a replayed step, per micro-batch: layer 0's input and the forward's three tables
    # (cos, sin, positions) in the first pass; each layer's saved input and the top layer's
    # incoming gradient in the backward. The other layers' inputs and gradients are already in
    # their buffers (without that it would be 2 x 4 + 2 x 5 = 18).
    assert 0 < stats["last_step_copies"] <= (1 + 3 + layers + 1) * accumulate, stats


@pytest.mark.gpu
@pytest.mark.parametrize(("qlora", "mode", "accumulate", "keep"), [
    (False, "standard", 1, "off"), (True, "offload", 1, "off"), (True, "offload", 1, "on"), (True, "standard", 2, "off"),
], ids=["lora", "qlora-offload", "qlora-offload-kept", "qlora-accumulate"])
def test_backward_graphs_captured_in_the_first_pass_train_as_eager(tiny_model_dir, monkeypatch, qlora, mode,
                                                                    accumulate, keep) -> None:
    """`backward_graph_capture: first_pass`: the second sighting captures the backward graph, then the first
    pass's, in its first pass, so it runs no eager first pass; the graphs recorded read what the first pass keeps
    (the gate product, the attention output with its projections) and train as the eager layers do."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kestrel.recompute.host_tensors import _KeptGate

    folder = tiny_model_dir("llama")
    kw = dict(qlora=qlora, mode=mode, accumulate=accumulate, keep_attention=keep, keep_projection=keep, keep_qkv=keep)
    eager, eager_w, _ = _train(folder, False, monkeypatch, **kw)
    taken: list[bool] = []  # in a capture, for each bound buffer: whether the recompute recorded reading it
    real_take = _KeptGate.take

    def take(self):
        got = real_take(self)
        if torch.cuda.is_current_stream_capturing() and self.static is not None:
            taken.append(got is not None)
        return got

    monkeypatch.setattr(_KeptGate, "take", take)
    graphed, graphed_w, stats = _train(folder, True, monkeypatch, backward_capture="first_pass", **kw)
    monkeypatch.setattr(_KeptGate, "take", real_take)
    layers = 2
    # Values cannot show it (a recomputed E equals the kept one): the recorded recompute read every kept tensor
    # (E; with kept attention also O and lse, at least) rather than recomputing it.
    assert all(taken) and (len(taken) >= layers * (1 + 2 * (keep == "on")) if mode == "offload" else not taken), taken
    assert stats["forward"] == stats["backward"] == layers and stats["failed"] == stats["eager_backwards"] == 0, stats
    assert stats["gates"] == (layers if mode == "offload" else 0) and stats["kept"] == (layers if keep == "on" else 0)
    for step, (a, b) in enumerate(zip(graphed, eager)):
        assert abs(a - b) <= 1e-3 * abs(b), f"loss {step}: graphed {a} vs eager {b}"
    for a, b in zip(graphed_w, eager_w):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-4)
    # The capture step: its first pass already replays (captured), where the default captures the first pass
    # a step later. One batch a step, so the second step is the second sighting.
    for capture, forwards in (("first_pass", layers), ("backward", 0)):
        *_, early = _train(folder, True, monkeypatch, qlora=qlora, mode=mode, steps=2, backward_capture=capture)
        assert early["backward"] == layers and early["forward"] == forwards, (capture, early)


@pytest.mark.gpu
def test_a_new_shape_runs_eagerly_then_gets_its_own_graphs(tiny_model_dir, monkeypatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kestrel.recompute.checkpoint import set_gradient_checkpointing
    from kestrel.config import LoraSettings
    from kestrel.model.loader import load
    from kestrel.model.lora import attach_lora

    model, _ = load(str(tiny_model_dir("llama")), 64, dtype="bf16", device="cuda")
    model = attach_lora(model, LoraSettings(r=8, alpha=16))
    run = set_gradient_checkpointing(model, "standard", "on")
    model.train()
    def steps(*lengths: int) -> dict[str, int]:
        for length in lengths:
            ids = torch.randint(5, 200, (2, length), device="cuda")
            model(input_ids=ids, labels=ids).loss.backward()
        return run.graphs.stats()

    stats = steps(40, 40, 32, 40, 32, 32)  # the smaller shape views the larger one's buffers
    assert stats["forward"] == stats["backward"] == 4 and stats["failed"] == stats["dropped"] == 0  # 2 layers x 2 shapes
    with model.disable_adapter():  # another adapter state: another signature, eager first
        ids = torch.randint(5, 200, (2, 32), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
    assert run.graphs.stats()["forward"] == 4
    # A larger shape replaces the static buffers: the graphs on the old ones go (freeing them),
    # and a shape seen before captures again at its next sighting, on the new buffers.
    stats = steps(48, 48)  # its second sighting captures both graphs (`backward_graph_capture: first_pass`)
    assert stats["dropped"] == 4 and stats["backward"] == stats["forward"] == 2, stats
    stats = steps(48, 32)  # 32's next sighting captures at once (seen twice before), both graphs
    assert stats["dropped"] == 4 and stats["backward"] == stats["forward"] == 4, stats
    stats = steps(32)
    assert stats["forward"] == stats["backward"] == 4 and stats["dropped"] == 4 and stats["failed"] == 0, stats
    set_gradient_checkpointing(model, "off")
    assert run.graphs.stats() == {"forward": 0, "backward": 0, "failed": 0, "gates": 0, "linked": 0,
                                  "eager_backwards": 0, "copies": 0, "dropped": 0, "kept": 0}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["offload", "standard"])
def test_auto_decides_each_layout_and_trains_as_the_forced_modes(tiny_model_dir, monkeypatch, mode) -> None:
    """Auto probes graphed and eager forwards, then keeps one per layout; every step's loss is
    the same whichever way it ran."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    auto, _, stats = _train(tiny_model_dir("llama"), None, monkeypatch, qlora=True, mode=mode, steps=12)
    eager, _, _ = _train(tiny_model_dir("llama"), False, monkeypatch, qlora=True, mode=mode, steps=12)
    for step, (a, b) in enumerate(zip(auto, eager)):
        assert abs(a - b) <= 1e-3 * abs(b), f"loss {step}: auto {a} vs eager {b}"
    assert stats["failed"] == 0
