"""Which stream the layer graphs capture on (`performance.capture_stream`, `kestrel.recompute.capture_stream`):
`side` keeps the steps on the default stream and captures on a side stream; `steps` runs the steps on a stream of
their own and captures there, so no second stream holds cuBLAS workspaces and freed blocks of its own. The choice
on the CPU; on CUDA (`gpu`), graphed steps on the steps' stream give the eager steps' losses and gradients and
leave no block on a third stream."""

from __future__ import annotations

import pytest
import torch

from kestrel.recompute.capture_stream import capture_on, steps_on, steps_stream


class _Side:
    """A side stream factory that counts what it made."""

    def __init__(self) -> None:
        self.made = 0

    def __call__(self) -> str:
        self.made += 1
        return "side"


def test_graphs_capture_on_the_steps_stream_only_under_steps_and_never_on_the_default_stream() -> None:
    side = _Side()
    assert capture_on("steps'", "default", side, on_steps=True) == "steps'" and side.made == 0
    assert capture_on("default", "default", side, on_steps=True) == "side"  # a run whose steps were not moved
    assert capture_on("steps'", "default", side, on_steps=False) == "side"
    assert side.made == 2


def test_a_steps_stream_is_made_only_for_steps_on_a_gpu() -> None:
    assert steps_stream(torch.device("cpu"), "steps") is None
    assert steps_stream(torch.device("cuda", 0), "side") is None  # decided before anything touches CUDA


def test_no_steps_stream_runs_the_block_as_it_is() -> None:
    ran = []
    with steps_on(None):
        ran.append(True)
    assert ran == [True]
    with pytest.raises(KeyError):
        with steps_on(None):
            raise KeyError("the block's own error comes through")


def test_the_run_s_checkpointing_carries_the_setting_to_its_graphs(tiny_model_dir, monkeypatch) -> None:
    """`set_gradient_checkpointing` resolves the setting (KESTREL_CAPTURE_STREAM overrides it) and hands it to the
    run's graph registry and to the loop (`Recompute.capture_stream`)."""
    from kestrel.model.loader import load
    from kestrel.recompute.checkpoint import set_gradient_checkpointing

    model, _ = load(str(tiny_model_dir("llama")), 64, dtype="fp32")
    monkeypatch.delenv("KESTREL_CAPTURE_STREAM", raising=False)
    run = set_gradient_checkpointing(model, "standard", capture_stream="steps")
    assert run.capture_stream == "steps" and run.graphs.on_steps
    monkeypatch.setenv("KESTREL_CAPTURE_STREAM", "side")
    run = set_gradient_checkpointing(model, "standard", capture_stream="steps")
    assert run.capture_stream == "side" and not run.graphs.on_steps


def _lora_llama(tiny_model_dir, graphs: str, capture_stream: str):
    """A tiny Llama with LoRA (seeded) on CUDA under standard checkpointing with CUDA graphs `graphs`; (the
    checkpointing, its steps' stream, the model)."""
    from kestrel.config import LoraSettings
    from kestrel.model.loader import load
    from kestrel.model.lora import attach_lora
    from kestrel.recompute.checkpoint import set_gradient_checkpointing

    model, _ = load(str(tiny_model_dir("llama")), 64, dtype="bf16", device="cuda")
    torch.manual_seed(0)
    model = attach_lora(model, LoraSettings(r=8, alpha=16))
    run = set_gradient_checkpointing(model, "standard", graphs, capture_stream=capture_stream)
    model.train()
    return run, steps_stream(torch.device("cuda"), run.capture_stream), model


@pytest.mark.gpu
def test_graphed_steps_on_their_own_stream_match_eager_steps_and_use_no_third_stream(tiny_model_dir, monkeypatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.delenv("KESTREL_CUDA_GRAPHS", raising=False)
    monkeypatch.delenv("KESTREL_CAPTURE_STREAM", raising=False)
    ids = torch.randint(5, 200, (2, 40), device="cuda")

    def losses(run, stream, model) -> tuple[list[float], dict[str, torch.Tensor]]:
        out = []
        for _ in range(4):  # the first sighting eager, then the captures, then replays
            with steps_on(stream):
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            out.append(loss.item())
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        return out, grads

    # streams holding segments already (earlier tests' cuBLAS workspaces stay for good): not this run's
    before = {seg["stream"] for seg in torch.cuda.memory_snapshot()}
    run, stream, model = _lora_llama(tiny_model_dir, "on", "steps")
    assert stream is not None
    graphed, graphed_grads = losses(run, stream, model)
    stats = run.graphs.stats()
    assert stats["forward"] > 0 and stats["failed"] == stats["eager_backwards"] == 0, stats
    assert run.graphs.streams == {}, "a side capture stream was made under capture_stream: steps"
    assert all(dev.stream == stream for dev in run.graphs.devices.values())
    allowed = before | {torch.cuda.default_stream().cuda_stream, stream.cuda_stream}
    others = {seg["stream"] for seg in torch.cuda.memory_snapshot()} - allowed
    assert not others, f"blocks cached for streams other than the default and the steps' own: {others}"
    run.release()

    eager_run, eager_stream, eager_model = _lora_llama(tiny_model_dir, "off", "side")
    assert eager_stream is None
    eager, eager_grads = losses(eager_run, eager_stream, eager_model)
    assert all(abs(g - e) <= 1e-3 * abs(e) for g, e in zip(graphed, eager)), (graphed, eager)
    assert graphed_grads.keys() == eager_grads.keys() and graphed_grads
    for name, g in graphed_grads.items():
        e = eager_grads[name]
        assert torch.allclose(g, e, rtol=2e-2, atol=1e-3 * e.abs().max().item()), name
