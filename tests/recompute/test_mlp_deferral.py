"""kestrel.recompute.mlp_deferral: when a recomputed MLP defers to its backward, and that a run follows it."""

from __future__ import annotations

import json

import pytest
import torch

from kestrel.kernels.lora.lora import LoRAWeights
from kestrel.kernels.lora.mlp import extra_bytes
from kestrel.recompute.mlp_deferral import available_host_bytes, DeferDecision, MLPDeferral

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)  # the policy only reads the device's type
GIB = 2**30


def _proj(out: int, inp: int, nf4_base: bool = True) -> LoRAWeights:
    meta = torch.empty(out, inp, device="meta")
    state = type("State", (), {"shape": (out, inp)})() if nf4_base else None
    return LoRAWeights(meta, state, torch.empty(16, inp, device="meta"), torch.empty(out, 16, device="meta"), 2.0)


def _policy(mode: str, device_room: int | None, host_room: int | None = None, paged: int = 0,
            link: float | None = 1e12, layer_s: float | None = 1.0):
    """A policy with these rooms, a host link of `link` bytes/s and a first pass of `layer_s` seconds
    timed at 8,192 rows (None: not measured)."""
    seen: list[DeferDecision] = []
    policy = MLPDeferral(mode, headroom=lambda d: device_room if d.type == "cuda" else None,  # type: ignore[arg-type]
                         on_decision=seen.append, host_room=lambda: host_room, link_rate=lambda d: link)
    policy.paged_layers = paged
    if layer_s is not None:
        policy.link.layer_seconds[8192] = layer_s
    return policy, seen


GATE, UP = _proj(7040, 2176), _proj(7040, 2176)  # an MLP over NF4 of a width no issue or bench model has


def test_extra_bytes_is_what_deferring_saves() -> None:
    # 8,192 rows: E, G, h whole (3 x 8192 x I) against three 2,048-row chunks plus the dense W'_g, W'_u.
    assert extra_bytes(8192, 7040, 2 * 7040 * 2176) == 2 * (3 * 8192 * 7040 - 3 * 2048 * 7040 - 2 * 7040 * 2176)
    assert extra_bytes(2048, 7040, 0) == 0  # one chunk holds every row: nothing saved


@pytest.mark.parametrize("mode, deferred", [("memory", True), ("off", False)])
def test_forced_modes_ignore_the_room(mode: str, deferred: bool) -> None:
    policy, seen = _policy(mode, device_room=0)
    assert policy.defers(8192, GATE, UP, GPU) is deferred
    assert [d.deferred for d in seen] == [deferred] and mode in seen[0].reason


def test_fit_keeps_whole_rows_where_twice_their_extra_fits() -> None:
    extra = extra_bytes(8192, 7040, 2 * 7040 * 2176)
    roomy, _ = _policy("fit", device_room=2 * extra)
    tight, seen = _policy("fit", device_room=2 * extra - 1)
    assert not roomy.defers(8192, GATE, UP, GPU)
    assert tight.defers(8192, GATE, UP, GPU)
    assert "would not fit" in seen[0].reason


def test_nothing_to_save_never_defers() -> None:
    policy, seen = _policy("memory", device_room=0)
    assert not policy.defers(3000, GATE, UP, GPU)  # NF4: below the point where the dense weights pay
    assert "would not lower the peak" in seen[0].reason


def test_fit_off_cuda_keeps_the_memory_rule() -> None:
    policy, seen = _policy("fit", device_room=None)
    assert policy.defers(8192, GATE, UP, CPU)
    assert not policy.defers(1024, GATE, UP, CPU)
    assert "off CUDA" in seen[0].reason


def test_each_row_count_is_decided_once() -> None:
    # Both passes of a layer, and every later step, get the first answer even when the room changes,
    # so a first pass that paged E out always meets a recompute that takes it back.
    room = [64 * GIB]
    seen: list[DeferDecision] = []
    policy = MLPDeferral("fit", headroom=lambda d: room[0], on_decision=seen.append, host_room=lambda: None)
    assert not policy.defers(8192, GATE, UP, GPU)
    room[0] = 0
    assert not policy.defers(8192, GATE, UP, GPU)
    assert policy.defers(16384, GATE, UP, GPU)  # a new row count reads the room again
    assert [(d.rows, d.deferred) for d in seen] == [(8192, False), (16384, True)]


def test_paged_gate_products_must_fit_the_host() -> None:
    # Offloading 36 layers' E at 8,192 rows pins 36 x 8192 x 7040 x 2 bytes (3.9 GiB).
    pages = 36 * 8192 * 7040 * 2
    fits, _ = _policy("fit", device_room=64 * GIB, host_room=2 * pages, paged=36)
    short, seen = _policy("fit", device_room=64 * GIB, host_room=2 * pages - 1, paged=36)
    unknown, _ = _policy("fit", device_room=64 * GIB, host_room=None, paged=36)
    assert not fits.defers(8192, GATE, UP, GPU)
    assert short.defers(8192, GATE, UP, GPU) and "pin" in seen[0].reason
    assert unknown.defers(8192, GATE, UP, GPU)
    not_offloaded, _ = _policy("fit", device_room=64 * GIB, host_room=None, paged=0)
    assert not not_offloaded.defers(8192, GATE, UP, GPU)


def test_paging_counts_the_graphs_static_gate_buffers_on_the_device() -> None:
    # Paged, whole rows also hold two static (rows, I) E buffers (a graphed layer's): they must fit too.
    extra = extra_bytes(8192, 7040, 2 * 7040 * 2176) + 2 * 8192 * 7040 * 2
    fits, _ = _policy("fit", device_room=2 * extra, host_room=64 * GIB, paged=36)
    short, seen = _policy("fit", device_room=2 * extra - 1, host_room=64 * GIB, paged=36)
    assert not fits.defers(8192, GATE, UP, GPU)
    assert short.defers(8192, GATE, UP, GPU) and "would not fit" in seen[0].reason


PAGED = 8192 * (7040 + 2176) * 2  # a paging layer's E and input at 8,192 rows, 16-bit


@pytest.mark.parametrize("link", [25e9, 64e9, 400e9])
def test_fit_keeps_whole_rows_only_where_the_link_keeps_up_with_a_layer(link: float) -> None:
    # Whole rows page E and the layer input out during the first pass: at most a layer's first pass long.
    within, _ = _policy("fit", device_room=64 * GIB, host_room=64 * GIB, paged=36, link=link, layer_s=PAGED / link)
    behind, seen = _policy("fit", device_room=64 * GIB, host_room=64 * GIB, paged=36, link=link,
                           layer_s=0.99 * PAGED / link)
    assert not within.defers(8192, GATE, UP, GPU)
    assert behind.defers(8192, GATE, UP, GPU)
    assert "longer than its first pass" in seen[0].reason and f"{link / 1e9:.1f} GB/s" in seen[0].reason


def test_kept_attention_pages_count_against_the_link() -> None:
    # keep_attention sends each row's attention output too: a first pass that hides E and the input
    # alone can be too short once those bytes ride along.
    link = 50e9
    alone, _ = _policy("fit", device_room=64 * GIB, host_room=64 * GIB, paged=36, link=link, layer_s=PAGED / link)
    keeping, seen = _policy("fit", device_room=64 * GIB, host_room=64 * GIB, paged=36, link=link,
                            layer_s=PAGED / link)
    keeping.kept_bytes = lambda rows: 32 * (128 * 2 + 4)
    assert not alone.defers(8192, GATE, UP, GPU)
    assert keeping.defers(8192, GATE, UP, GPU) and "longer than" in seen[0].reason
    # keep_attention auto keeps only at row counts a layer asked about (long enough rows), what was decided
    # there once decided: elsewhere the output's bytes do not ride along
    from kestrel.recompute.checkpoint import Recompute
    from kestrel.recompute.graph_choice import GraphChooser

    from kestrel.model.kept_attention import KeptBytes, Keeping

    for asked, decided, defers in ((set(), {}, False), ({8192}, {}, True), ({8192}, {8192: Keeping()}, False)):
        auto, _ = _policy("fit", device_room=64 * GIB, host_room=64 * GIB, paged=36, link=link, layer_s=PAGED / link)
        run = Recompute(True, None, GraphChooser("off"), deferral=auto, keep_attention="auto")
        run.kept_sizes, run.attention_asked, run.kept = KeptBytes(32 * (128 * 2 + 4)), asked, decided
        auto.kept_bytes = run.kept_bytes_at
        assert auto.defers(8192, GATE, UP, GPU) is defers, (asked, decided)


def test_kept_bytes_read_heads_and_head_size() -> None:
    from types import SimpleNamespace

    from kestrel.model.kept_attention import KeptBytes, Keeping

    def kept_bytes_per_row(config, projection: bool = False, qkv: bool = False) -> int:
        return KeptBytes.of_model(config).of(Keeping(True, projection, qkv))

    class Config(SimpleNamespace):
        def to_dict(self) -> dict:
            return dict(vars(self))

    qwen3_like = Config(num_attention_heads=32, head_dim=128, hidden_size=2560)  # heads x head_dim != hidden
    assert kept_bytes_per_row(qwen3_like) == 32 * (128 * 2 + 4)
    assert kept_bytes_per_row(qwen3_like, projection=True) == 32 * (128 * 2 + 4) + 2560 * 2  # o_proj's output too
    grouped = Config(num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=2560)
    assert kept_bytes_per_row(grouped, qkv=True) == 32 * (128 * 2 + 4) + (32 + 2 * 8) * 128 * 2  # Q, K, V too
    assert kept_bytes_per_row(qwen3_like, qkv=True) == 32 * (128 * 2 + 4) + 96 * 128 * 2  # no KV heads given: MHA
    no_head_dim = Config(num_attention_heads=12, hidden_size=1536)
    assert kept_bytes_per_row(no_head_dim) == 12 * (128 * 2 + 4)
    image_text = SimpleNamespace(text_config=qwen3_like, vision_config=SimpleNamespace())
    assert kept_bytes_per_row(image_text) == kept_bytes_per_row(qwen3_like)
    # layers of two head sizes (Gemma 4's per-layer config): the widest layer's pages
    per_layer = Config(num_attention_heads=8, head_dim=256, hidden_size=1536,
                       per_layer_config={"4": {"head_dim": 512}, "9": {"sliding_window": 512}})
    assert kept_bytes_per_row(per_layer) == 8 * (512 * 2 + 4)
    # Qwen3.5's q_proj yields each head's query and output gate: Q's pages are twice the heads'
    gated = Config(model_type="qwen3_5_text", num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                   hidden_size=4096)
    assert kept_bytes_per_row(gated, qkv=True) == 16 * (256 * 2 + 4) + (2 * 16 + 2 * 4) * 256 * 2


def test_the_link_is_measured_once_a_device_and_an_unmeasured_one_defers() -> None:
    unmeasured, seen = _policy("fit", device_room=64 * GIB, host_room=64 * GIB, paged=36, link=None)
    assert unmeasured.defers(8192, GATE, UP, GPU) and "could not be measured" in seen[0].reason
    asked: list[torch.device] = []
    policy = MLPDeferral("fit", headroom=lambda d: 64 * GIB, host_room=lambda: 64 * GIB,
                         link_rate=lambda d: asked.append(d) or 1e12)
    policy.paged_layers = 36
    policy.link.layer_seconds.update({8192: 1.0, 4096: 1.0})
    assert not policy.defers(8192, GATE, UP, GPU) and not policy.defers(4096, GATE, UP, GPU)
    assert asked == [GPU]


def test_only_fit_on_a_paging_cuda_run_asks_for_layer_times(monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel.kernels.lora import mlp as mlp_module

    monkeypatch.setattr(mlp_module, "DEFERRED_ROWS", 2048)
    fit, _ = _policy("fit", device_room=64 * GIB, paged=36, layer_s=None)
    assert fit.wants_layer_time(4096, GPU) and not fit.wants_layer_time(2048, GPU)  # one chunk: nothing to defer
    assert not fit.wants_layer_time(4096, CPU)
    fit.link.layer_seconds[4096] = 0.01
    assert not fit.wants_layer_time(4096, GPU)  # timed once
    assert not _policy("memory", device_room=64 * GIB, paged=36)[0].wants_layer_time(4096, GPU)
    assert not _policy("fit", device_room=64 * GIB, paged=0)[0].wants_layer_time(4096, GPU)  # nothing paged


def test_an_untimed_row_count_defers_until_its_time_is_in_then_is_decided_again() -> None:
    policy, seen = _policy("fit", device_room=64 * GIB, host_room=64 * GIB, paged=36, link=50e9, layer_s=None)
    assert policy.defers(8192, GATE, UP, GPU) and seen[-1].untimed and "until" in seen[-1].reason
    assert policy.defers(8192, GATE, UP, GPU) and len(seen) == 1  # kept until the time is in
    policy.record_layer_time(8192, 2 * PAGED / 50e9)
    assert not policy.defers(8192, GATE, UP, GPU)
    assert [d.deferred for d in seen] == [True, False] and not seen[-1].untimed
    slow, seen = _policy("fit", device_room=64 * GIB, host_room=64 * GIB, paged=36, link=50e9, layer_s=None)
    slow.defers(8192, GATE, UP, GPU)
    slow.record_layer_time(8192, 0.5 * PAGED / 50e9)
    assert slow.defers(8192, GATE, UP, GPU)
    assert len(seen) == 2 and "longer than" in seen[-1].reason  # the timed answer is reported too, though equal


def test_offloading_times_the_first_layers_first_pass_and_decides_at_the_next_forward(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `fit` with E paged: Recompute marks the forward's first layer's first pass at a row count's second
    # forward (the first compiles) and hands the time over at a later forward's start; the row count is
    # then decided again (here: whole rows, a fast link), and training matches deferred rows throughout.
    from kestrel.config import LoraSettings
    from kestrel.kernels.lora import mlp as mlp_module
    from kestrel.model.loader import load
    from kestrel.model.lora import attach_lora
    from kestrel.recompute import checkpoint

    class Timed(MLPDeferral):  # asks on the CPU as it would on CUDA
        def wants_layer_time(self, rows: int, device: torch.device) -> bool:
            return super().wants_layer_time(rows, GPU)

    monkeypatch.setattr(mlp_module, "DEFERRED_ROWS", 8)
    folder = tiny_model_dir("llama")  # built before the seeds below: building draws random numbers
    runs = {}
    for name in ("fit", "memory"):
        seen: list[DeferDecision] = []
        policy = Timed(name, headroom=lambda d: 64 * GIB, host_room=lambda: 64 * GIB, link_rate=lambda d: 1e15,
                       on_decision=seen.append)  # type: ignore[arg-type]
        torch.manual_seed(0)
        model, _ = load(str(folder), 64, dtype="fp32", device="cpu")
        model = attach_lora(model, LoraSettings(r=8, alpha=16))
        checkpoint.set_gradient_checkpointing(model, "offload", "off", deferral=policy)
        model.train()
        losses, grads = [], []
        for rows in (40, 40, 24, 40):
            ids = torch.randint(5, 200, (2, rows), generator=torch.Generator().manual_seed(rows))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            model.zero_grad(set_to_none=True)
        runs[name] = (losses, grads, policy, seen)
    losses, grads, policy, seen = runs["fit"]
    assert set(policy.link.layer_seconds) == {80}  # 40 x 2 rows, timed at its second forward; 48 seen once
    assert [(d.rows, d.deferred, d.untimed) for d in seen] == [(80, True, True), (48, True, True), (80, False, False)]
    assert not any(d.untimed for d in policy.decided.values() if d.rows == 80)
    for a, b in zip(losses, runs["memory"][0]):
        assert abs(a - b) <= 1e-5 * abs(b)
    for step_a, step_b in zip(grads, runs["memory"][1]):
        for a, b in zip(step_a, step_b):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_row_count_that_ran_graphed_keeps_its_untimed_answers(tiny_model_dir) -> None:
    # Graphs captured before a row count's time came in hold its untimed answers: they stay, for the
    # MLPs and for keep_attention auto, so no first pass pages what its recompute will not read.
    from kestrel.config import LoraSettings
    from kestrel.model.loader import load
    from kestrel.model.lora import attach_lora
    from kestrel.recompute import checkpoint

    policy, seen = _policy("fit", device_room=64 * GIB, host_room=64 * GIB, paged=36, link=1e15, layer_s=None)
    model, _ = load(str(tiny_model_dir("llama")), 64, dtype="fp32", device="cpu")
    model = attach_lora(model, LoraSettings(r=8, alpha=16))
    run = checkpoint.set_gradient_checkpointing(model, "offload", "off", deferral=policy, keep_attention="auto")
    policy.paged_layers = 36  # as the policy above was made
    assert policy.defers(8192, GATE, UP, GPU) and seen[-1].untimed
    run._ran_graphed.add(8192)
    run._hand_over(8192, 1.0)
    assert policy.link.timed(8192) and policy.defers(8192, GATE, UP, GPU) and len(seen) == 1
    assert run.attention_keeps_up(8192, 128, GPU) is False
    run._hand_over(4096, 1.0)  # never ran graphed: decided from its time
    assert not policy.defers(4096, GATE, UP, GPU) and not seen[-1].untimed


def test_available_host_bytes_reads_meminfo(tmp_path) -> None:
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       16000000 kB\nMemFree:         1000 kB\nMemAvailable:    8000000 kB\n")
    assert available_host_bytes(str(info)) == 8000000 * 1024
    assert available_host_bytes(str(tmp_path / "missing")) is None


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="defer_mlp"):
        MLPDeferral("maybe")  # type: ignore[arg-type]


def test_decisions_are_json_metrics() -> None:
    policy, seen = _policy("off", device_room=None)
    policy.defers(8192, GATE, UP, GPU)
    assert json.loads(json.dumps(seen[0].as_metrics())) == {
        "rows": 8192, "intermediate": 7040, "deferred": False, "reason": seen[0].reason}


@pytest.mark.parametrize("mode", ["memory", "off"])
def test_a_run_follows_its_mode_and_says_so(mode: str, tiny_model_dir, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel.config import config_from_dict
    from kestrel.kernels.lora import mlp as mlp_module
    from kestrel.training.run import run
    from tests.support.logs import Logs

    monkeypatch.delenv("KESTREL_DEFER_MLP", raising=False)
    monkeypatch.setattr(mlp_module, "DEFERRED_ROWS", 8)  # the tiny model's rows pass the point where deferring saves
    log = Logs()
    cfg = config_from_dict(dict(model=str(tiny_model_dir("llama")), dataset="arithmetic_chat", output_dir=str(tmp_path / "r"),
                                max_steps=2, max_seq_length=64, save_steps=0, dtype="fp32", method="lora",
                                performance={"defer_mlp": mode}))
    assert run(cfg, [log]).status == "completed"
    lines = [line for line in log.lines if line.startswith("recomputed MLP at ")]
    made = json.loads((tmp_path / "r" / "performance.json").read_text())["defer_mlp"]
    assert lines and len(lines) == len(made)  # one line a decided row count
    deferring = [m for m in made if "lower the peak" not in m["reason"]]
    assert deferring and all(m["deferred"] is (mode == "memory") for m in deferring)
    assert all(f"defer_mlp: {mode}" in m["reason"] for m in deferring)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphed"])
def test_whole_rows_train_as_deferred_rows_on_cuda(tiny_model_dir, monkeypatch: pytest.MonkeyPatch, graphs: bool) -> None:
    # Offloaded QLoRA whose 96-row MLPs pass the (lowered) point where deferring saves memory: `memory`
    # defers them, `fit` (a roomy GPU, a link that keeps up) keeps whole rows and pages the gate product
    # out: eager, from the third step (its first pass timed by CUDA events in the second); graphed, from
    # the first (timed beforehand). Same losses and adapters; only `fit` keeps gate products (in static
    # buffers when graphed).
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kestrel.kernels.lora import mlp as mlp_module
    from tests.recompute.test_layer_graphs import _train

    # 96 rows, I = 256, H = 128: deferring in 8-row chunks saves 2 (3 x 88 x 256 - 2 x 256 x 128) bytes
    # (extra_bytes > 0); in 16-row chunks it would not, and `memory` would keep whole rows too.
    monkeypatch.setattr(mlp_module, "DEFERRED_ROWS", 8)
    folder = tiny_model_dir("llama")
    runs = {}
    for mode in ("memory", "fit"):
        policy = MLPDeferral(mode)  # type: ignore[arg-type]
        if graphs and mode == "fit":  # forced-on graphs capture from the first forward: the time must be in before
            policy.record_layer_time(96, 1.0)  # a slow first pass: the tiny pages keep up with any link
        runs[mode] = (*_train(folder, graphs, monkeypatch, qlora=True, mode="offload", deferral=policy), policy)
    (deferred, deferred_w, deferred_stats, memory), (whole, whole_w, whole_stats, fit) = runs["memory"], runs["fit"]
    assert [d.deferred for d in memory.decided.values()] == [True]
    assert [d.deferred for d in fit.decided.values()] == [False]
    if graphs:
        assert deferred_stats["gates"] == 0 and whole_stats["gates"] == 2, (deferred_stats, whole_stats)
    for step, (a, b) in enumerate(zip(whole, deferred)):
        assert abs(a - b) <= 1e-2 * abs(b), f"loss {step}: whole rows {a} vs deferred {b}"
    # The deferred chunks multiply by dequantized weights, the whole rows by the NF4 kernels: bf16 rounding
    # differs, and AdamW (lr 1e-2) turns a near-zero gradient's sign into a whole step. So: the adapters
    # agree as tensors, and no element is more than two steps apart.
    for a, b in zip(whole_w, deferred_w):
        assert (a - b).norm() <= 2e-2 * b.norm(), f"adapters differ by {(a - b).norm() / b.norm():.3f} of their norm"
        assert (a - b).abs().max() <= 2e-2


def test_only_changes_of_answer_are_reported() -> None:
    # Batches of many sizes: a line for the first answer and for each change, not one per row count.
    policy, seen = _policy("memory", device_room=None)
    for rows in (1024, 1536, 2048, 8192, 9216, 10240, 1024):
        policy.defers(rows, GATE, UP, GPU)
    assert len(policy.decided) == 6
    assert [(d.rows, d.deferred) for d in seen] == [(1024, False), (8192, True)]
