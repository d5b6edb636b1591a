"""Dropping layer graphs and capturing them again on CUDA (`gpu`; `kestrel.recompute.layer_graphs`,
`kestrel.recompute.checkpoint.Recompute.release`): a re-timed or undecided layout's eager forwards run with the
graphs dropped, a layout's first graphed forward captures at once, a release gives the graphs' pool back there
and then and leaves no memory behind across rounds, and the pool outlives its graphs so captures after a drop
work."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from pathlib import Path

import pytest
import torch


def _cuda_lora_llama(tiny_model_dir, monkeypatch, graphs: str, backward_capture: str = "first_pass"):
    """A tiny Llama with LoRA on CUDA under standard checkpointing with CUDA graphs `graphs` (auto / on), in
    training: (the checkpointing, one step on a fixed (2, 40) batch returning its loss)."""
    from kestrel.config import LoraSettings
    from kestrel.model.loader import load
    from kestrel.model.lora import attach_lora
    from kestrel.recompute.checkpoint import set_gradient_checkpointing

    monkeypatch.delenv("KESTREL_CUDA_GRAPHS", raising=False)
    model, _ = load(str(tiny_model_dir("llama")), 64, dtype="bf16", device="cuda")
    model = attach_lora(model, LoraSettings(r=8, alpha=16))
    run = set_gradient_checkpointing(model, "standard", graphs, backward_capture=backward_capture)
    model.train()
    ids = torch.randint(5, 200, (2, 40), device="cuda")

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item()

    return run, step


@pytest.mark.gpu
def test_a_graphed_layout_timed_again_runs_eagerly_without_its_graphs(tiny_model_dir, monkeypatch) -> None:
    """Once decided graphed, a layout whose graphed steps run slower than the eager time they beat is
    timed eagerly again: those forwards drop the graphs first (the eager working set never stacks on
    their pool), and if graphed still wins the layers capture again; losses stay those of eager steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run, step = _cuda_lora_llama(tiny_model_dir, monkeypatch, "auto")
    for _ in range(14):
        step()
    (layout,) = run.chooser.layouts.values()
    assert run.chooser.graphs_kept() and run.holds_graphs and run.graphs.stats()["forward"] > 0
    # The graphed way now reads slower than the eager time it won against: its next check re-times eager.
    layout.decision = dataclasses.replace(layout.decision, eager_s=layout.decision.graphed_s / 10)
    released = []
    for _ in range(layout.watch + 4):
        step()
        released.append(not run.holds_graphs and run.graphs.stats()["forward"] == 0)
    assert any(released), "the eager re-timing ran over the graphs' pool"
    for _ in range(12):
        last = step()
    assert layout.decision is not None and abs(last - step()) < 1e-2
    run.release()


@pytest.mark.gpu
def test_a_layouts_first_graphed_forward_captures_when_its_first_forward_ran_eagerly(tiny_model_dir, monkeypatch) -> None:
    """Auto: a layout's first forward runs eagerly and the layer graphs count it as their first sighting, so the
    first forward the chooser graphs captures and replays at once: no second eager forward beside the pool that
    other layouts' graphs hold (bench/RESULTS.md, session 43). Its loss is the eager forward's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run, step = _cuda_lora_llama(tiny_model_dir, monkeypatch, "auto")
    eager = step()
    assert run.graphs.stats()["forward"] == 0 and not run.holds_graphs
    monkeypatch.setattr(run.chooser, "begin", lambda key, tokens, name="": True)  # the chooser graphs it now
    graphed = step()
    stats = run.graphs.stats()
    assert stats["forward"] == stats["backward"] == 2 and stats["failed"] == stats["eager_backwards"] == 0, stats
    assert abs(graphed - eager) <= 1e-3 * abs(eager), (graphed, eager)
    run.release()


def _private_pool_bytes() -> int:
    """Bytes reserved in CUDA-graph private pools (segments whose pool id is not the default (0, 0))."""
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot() if tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0))


@pytest.mark.gpu
def test_released_graphs_give_their_pool_back_at_once(tiny_model_dir, monkeypatch) -> None:
    """`release` (a re-timing's, an all-eager decision's) frees the graphs' private pool there and then, with
    the automatic garbage collector off (a graph in a reference cycle would otherwise live, and hold its pool,
    until the collector's next pass): the eager steps that follow never run over the pool (a Qwen3-14B
    re-timing reserved the pool and the eager working set together; bench/RESULTS.md, session 41)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gc.collect()  # an earlier test's graphs in a reference cycle: their pool goes now, not in this test's count
    before = _private_pool_bytes()
    run, step = _cuda_lora_llama(tiny_model_dir, monkeypatch, "on")
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    graphs = [weakref.ref(g) for state in run.graphs.layers.values() for gs in state.graphs.values()
              for g in (gs.forward, gs.backward) if g is not None]
    assert graphs and _private_pool_bytes() > before
    gc.disable()
    try:
        run.release()
        alive = sum(ref() is not None for ref in graphs)
        pool = _private_pool_bytes()
    finally:
        gc.enable()
    assert alive == 0 and pool == before, f"{alive} graphs alive, {pool - before} bytes still in the graphs' pool after release"


@pytest.mark.gpu
def test_graphs_released_and_captured_again_leave_no_memory_behind(tiny_model_dir, monkeypatch) -> None:
    """Each release and recapture keeps the allocated memory where the first capture left it: an undecided layout's
    eager forwards drop the graphs (`GraphChooser.runs_alone`), so a padded run releases many times, and a new
    capture stream per release had left cuBLAS's workspaces for it behind (64 MiB each; bench/RESULTS.md,
    session 44)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run, step = _cuda_lora_llama(tiny_model_dir, monkeypatch, "on")
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    captured = torch.cuda.memory_allocated()
    streams = set(run.graphs.streams.values())
    for _ in range(4):
        run.release()
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    assert run.graphs.stats()["forward"] > 0 and set(run.graphs.streams.values()) == streams
    grown = torch.cuda.memory_allocated() - captured
    assert grown < 2**24, f"{grown / 2**20:.1f} MiB more allocated after four releases and recaptures"


_POOL_REUSE = """
import torch
from kestrel.recompute.layer_graphs import GraphRegistry

dev = GraphRegistry().device(torch.device("cuda", 0))
x = torch.ones(1 << 20, device="cuda")
for round in range(3):  # each round's graph is the pool's only layer graph, destroyed before the next capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=dev.pool, stream=dev.stream):
        y = x * 2
    graph.replay()
    torch.cuda.synchronize()
    assert float(y[0]) == 2.0
    del graph, y
    torch.cuda.empty_cache()
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_the_pool_outlives_its_graphs_so_captures_after_a_drop_work(alloc_conf: str) -> None:
    # Static buffers outgrown drop every graph on them (`drop_viewing`); the next capture shares the same pool.
    # Under expandable segments that failed torch's `use_count > 0` assert and left every layer eager (a
    # padded Llama-3.2-1B run 4x slower) until the registry held the pool (`capture_stream.pool_keeper`).
    import os
    import subprocess
    import sys

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": alloc_conf}
    done = subprocess.run([sys.executable, "-c", _POOL_REUSE], env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("capture", ["first_pass", "backward"])
def test_every_step_that_captures_a_graph_shows_in_the_capture_count(tiny_model_dir, monkeypatch, capture) -> None:
    """`GraphRegistry.captured` grows in each step that captures a graph, first passes and backwards alike, so the
    graph choice leaves every such step out of its times (`Recompute.spoil_after_capture`) and needs only one
    untimed graphed forward: under `backward` capture the backward graph is captured in one step and the first
    pass's in the next, and a count of new signatures grew in the first of the two only."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run, step = _cuda_lora_llama(tiny_model_dir, monkeypatch, "on", backward_capture=capture)
    counts = []
    for _ in range(5):
        step()
        counts.append(run.graphs.captured)
    layers = len(run.layers())
    grew = [b - a for a, b in zip([0, *counts], counts)]
    # first sighting eager; then first_pass captures both graphs in one step, backward in two steps
    assert grew == ([0, 2 * layers, 0, 0, 0] if capture == "first_pass" else [0, layers, layers, 0, 0]), grew
    stats = run.graphs.stats()
    assert stats["forward"] == stats["backward"] == layers and stats["failed"] == 0, stats
    run.release()
