"""bench/matrix_runner.py's scheduling on the CPU, its processes faked: a worker per GPU, every
pending pair once, records saying where they ran, the chunk's budget and hard stop, models one at
a time; and bench/matrix.py's settle loop with a fake CUDA-graph chooser."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from bench.matrix import chooser_settled, parse_args, settle
from bench import matrix_runner
from bench.matrix_runner import Clock, HostDrivers, Runner, load_records, pending, visible_gpus
from bench.matrix_table import render_table

MODELS = "qwen3-0.6b,qwen3-1.7b"


class FakeHost:
    """The processes a chunk starts: `--prepare` writes a folder's config.json under `root`, a pair
    takes `pair_s` seconds of a fake clock. Checks, as they run, that no two pairs share a GPU, that
    pairs of two models never run at once, and that a pair's folder exists from its start to its end."""

    def __init__(self, root: Path, pair_s: float = 100.0, together: int = 0, cut: tuple[str, ...] = ()) -> None:
        self.root, self.pair_s, self.cut = root, pair_s, cut
        self.lock = threading.Lock()
        self.t = 0.0
        self.running: dict[str, tuple[str, ...]] = {}  # GPU -> the pair on it
        self.pairs: list[tuple[tuple[str, ...], str, float, list[str]]] = []  # key, GPU, start, child args
        self.builds: list[tuple[str, str, bool, list[str]]] = []  # model, GPU, whether a pair ran meanwhile, folders there
        self.problems: list[str] = []
        self.together = threading.Barrier(together, timeout=20) if together else None  # the first pairs wait for each other

    def now(self) -> float:
        with self.lock:
            return self.t

    def launch(self, args: list[str], timeout: float, extra_path: str | None = None,
               env: dict[str, str] | None = None) -> dict[str, Any]:
        gpu = (env or {}).get("CUDA_VISIBLE_DEVICES", "?")
        if args[0] == "--prepare":
            with self.lock:
                there = sorted(p.name for p in self.root.iterdir()) if self.root.exists() else []
                self.builds.append((args[1], gpu, bool(self.running), there))
            (self.root / args[1]).mkdir(parents=True, exist_ok=True)
            (self.root / args[1] / "config.json").write_text("{}")
            return {"folder": str(self.root / args[1])}
        key = tuple(args[1].split(","))
        with self.lock:
            if gpu in self.running:
                self.problems.append(f"{key} started on GPU {gpu}, which runs {self.running[gpu]}")
            if any(k[0] != key[0] for k in self.running.values()):
                self.problems.append(f"{key} started beside another model's pair: {self.running}")
            self.running[gpu] = key
            self.pairs.append((key, gpu, self.t, args))
            wait = self.together is not None and len(self.pairs) <= self.together.parties
        self._check_folder(key, "start")
        if wait:
            self.together.wait()
        self._check_folder(key, "end")
        with self.lock:
            del self.running[gpu]
            self.t += self.pair_s
        if key[3] in self.cut:
            return {"timeout": timeout, "wall_s": timeout}
        return {"tokens_per_s": 1000.0, "peak_alloc_gib": 1.0, "peak_reserved_gib": 1.0}

    def _check_folder(self, key: tuple[str, ...], when: str) -> None:
        if not (self.root / key[0] / "config.json").exists():
            with self.lock:
                self.problems.append(f"{key}: its model's folder is missing at its {when}")


@pytest.fixture(autouse=True)
def _own_drivers_folder(tmp_path, monkeypatch) -> None:
    """Each test's drivers apart: tests running in parallel are not drivers of one host's matrix."""
    monkeypatch.setattr(matrix_runner, "DRIVERS_FOLDER", tmp_path / "drivers")


def test_drivers_of_one_host_count_each_other_and_not_the_gone(tmp_path) -> None:
    import os
    import subprocess
    import sys

    folder = tmp_path / "drivers"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with HostDrivers(folder) as mine:
        assert mine.count() == 1
        (folder / str(os.getppid())).touch()  # another driver, alive
        (folder / gone.stdout.strip()).touch()  # a driver killed without leaving: not counted
        assert mine.count() == 2
    assert not (folder / str(os.getpid())).exists() and HostDrivers(folder).count() == 1


def _args(tmp_path: Path, *extra: str) -> Any:
    return parse_args(["--models", MODELS, "--methods", "qlora", "--layouts", "padded,packed", "--systems", "kestrel,hf",
                       "--out", str(tmp_path / "m.jsonl"), "--anchors", "", *extra])


def test_workers_take_distinct_gpus_run_every_pair_once_and_models_one_at_a_time(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    args = _args(tmp_path, "--gpus", "all", "--settle", "7")
    root = tmp_path / "models"
    (root / "stale-model").mkdir(parents=True)  # an earlier chunk's folder: removed before the first model's build
    host = FakeHost(root, together=3)
    todo = pending(args)
    Runner(args, visible_gpus(args.gpus), host.launch, Clock(0, None, host.now), root).run()

    assert not host.problems
    assert sorted(k for k, *_ in host.pairs) == sorted(todo) and len(todo) == 8  # each pending pair once
    assert {g for _, g, *_ in host.pairs} == {"0", "1", "2"}
    first, second = MODELS.split(",")
    assert host.builds[0] == (first, "0", False, [])  # before any of its pairs, the stale folder gone first
    assert [b[0] for b in host.builds] == [first, second]  # the second built once, ahead or in its turn
    assert sorted(p.name for p in root.iterdir()) == [second]  # the first folder went once its pairs had ended
    records = load_records(Path(args.out))
    assert sorted((r["model"], r["method"], r["layout"], r["system"]) for r in records) == sorted(todo)
    assert {r["gpu"] for r in records} <= {0, 1, 2} and all(r["concurrent"] >= 1 for r in records)
    assert max(r["concurrent"] for r in records) == 3  # the first three ran together
    assert len({r["chunk"] for r in records}) == 1  # one chunk: the table pairs its systems
    assert {r["drivers"] for r in records} == {1}  # this driver alone on the host
    assert not pending(args)
    for key, _, _, child in host.pairs:  # only Kestrel is asked to settle its chooser
        assert ("--settle" in child) == key[3].startswith("kestrel")
    assert "ran beside other processes on the same host (up to 3 at once" in render_table(records, ["padded", "packed"])


@pytest.mark.parametrize("gpus", ["0", "0,1"])
def test_no_pair_starts_after_the_budget_and_the_next_chunk_runs_the_rest(tmp_path, monkeypatch, gpus) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpus)
    args = _args(tmp_path, "--gpus", "all", "--budget-s", "250")
    host = FakeHost(tmp_path / "models")
    todo = pending(args)
    Runner(args, visible_gpus(args.gpus), host.launch, Clock(250, None, host.now), host.root).run()

    # A pair starts only while under two of them have ended (100 s each): three in a row on one GPU;
    # on two, each worker may have started one more while the other's was ending.
    n_gpus = len(gpus.split(","))
    assert 3 <= len(host.pairs) <= 2 + n_gpus
    first = load_records(Path(args.out))
    assert len(first) == len(host.pairs) < len(todo) and len(pending(args)) == len(todo) - len(first)
    if n_gpus == 1:
        assert [start for _, _, start, _ in host.pairs] == [0, 100, 200]
        assert {(r["gpu"], r["concurrent"]) for r in first} == {(0, 1)}
        assert len(host.builds) == 1  # one GPU: no folder built ahead
    later = FakeHost(host.root)
    Runner(args, visible_gpus(args.gpus), later.launch, Clock(0, None, later.now), host.root).run()
    assert sorted(k for k, *_ in host.pairs + later.pairs) == sorted(todo)  # every pair once over the two chunks
    assert not pending(args) and not host.problems + later.problems
    if n_gpus == 1:  # as before --gpus: the next folder is built once the one before it is gone
        assert [b[0] for b in later.builds] == [MODELS.split(",")[1]] and later.builds[0][3] == []


def test_a_pair_cut_at_the_chunks_end_is_not_recorded_and_nothing_starts_after_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    args = _args(tmp_path, "--budget-s", "250", "--hard-s", "300")
    host = FakeHost(tmp_path / "models", cut=("hf",))  # the second pair runs past the hard stop
    Runner(args, visible_gpus(args.gpus), host.launch, Clock(250, 300, host.now), host.root).run()

    assert [k[3] for k, *_ in host.pairs] == ["kestrel", "hf"]  # nothing after the cut pair
    records = load_records(Path(args.out))
    assert [r["system"] for r in records] == ["kestrel"] and "error" not in records[0]
    assert pending(args)[0][3] == "hf"  # left for the next chunk


def test_a_pair_over_its_own_timeout_is_recorded_as_an_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    args = _args(tmp_path, "--models", "qwen3-0.6b", "--systems", "hf", "--layouts", "long")
    host = FakeHost(tmp_path / "models", cut=("hf",))
    Runner(args, visible_gpus(args.gpus), host.launch, Clock(0, None, host.now), host.root).run()
    [record] = load_records(Path(args.out))
    assert record["error"].startswith("timeout after 420")


def test_gpus_are_read_from_cuda_visible_devices_or_counted(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert visible_gpus("all") == ["3", "5"] and visible_gpus("1") == ["3"]
    with pytest.raises(ValueError, match="--gpus 4: 2 GPU"):
        visible_gpus("4")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr("bench.matrix_runner.gpu_count", lambda: 8)
    assert visible_gpus("all") == [str(i) for i in range(8)] and visible_gpus("2") == ["0", "1"]
    with pytest.raises(ValueError, match="at least 1 or all"):
        visible_gpus("0")


class FakeChooser:
    """GraphChooser's surface the settle loop reads: a layout is decided at its `k`-th sighting."""

    def __init__(self, k: int, mode: str = "auto") -> None:
        self.k, self.mode = k, mode
        self.layouts: dict[str, int] = {}

    def begin(self, key: str) -> None:
        if self.mode == "auto":
            self.layouts[key] = self.layouts.get(key, 0) + 1

    def decisions(self) -> list[str]:
        return [key for key, seen in self.layouts.items() if seen >= self.k]


def _stepper(chooser: FakeChooser, batches: list[str]) -> tuple[Any, list[int]]:
    ran: list[int] = []

    def step(i: int) -> None:
        ran.append(i)
        chooser.begin(batches[i % len(batches)])

    return step, ran


def test_settle_steps_until_every_layout_seen_is_decided_or_its_limit() -> None:
    batches = ["a", "b", "a", "c"]  # a decided at its 3rd sighting (step 4), b at step 9, c at step 11
    chooser = FakeChooser(k=3)
    step, ran = _stepper(chooser, batches)
    for i in range(2):  # the warm-up
        step(i)
    assert settle(step, chooser, 2, 100, len(batches)) == 10 and ran[-1] == 11  # stops as soon as c is decided
    assert chooser_settled(chooser, 12, len(batches))

    capped = FakeChooser(k=3)
    step, ran = _stepper(capped, batches)
    # capped at 5, then on to the next cycle's start: the timed steps begin at batch 0
    assert settle(step, capped, 0, 5, len(batches)) == 8 and ran == list(range(8))
    assert not chooser_settled(capped, 8, len(batches))


def test_every_system_steps_each_batch_once_and_times_from_a_cycle_start() -> None:
    batches = ["a", "b", "c", "d"]
    chooser = FakeChooser(k=1)  # decided on sight: settled once every batch has run
    step, ran = _stepper(chooser, batches)
    step(0)
    assert settle(step, chooser, 1, 100, len(batches)) == 3 and ran == [0, 1, 2, 3]
    # forced graphs and systems without a chooser still step every batch once before timing:
    # a batch's first step captures, compiles or autotunes for its shapes
    for other in (FakeChooser(k=99, mode="on"), None):
        ran.clear()
        step, ran = _stepper(other or FakeChooser(k=99, mode="off"), batches)
        assert settle(step, other, 2, 100, len(batches)) == 2 and ran == [2, 3]
        ran.clear()
        assert settle(step, other, 5, 100, len(batches)) == 3 and ran == [5, 6, 7]  # to the next cycle's start
    assert not chooser_settled(None, 3, 4) and chooser_settled(None, 4, 4)


def test_a_probe_keeps_settling_whole_cycles_until_one_changes_nothing() -> None:
    batches = ["a", "b", "a", "c"]
    captured: set[str] = set()
    sightings: dict[str, int] = {}

    def step(i: int) -> None:  # graphs capture a batch's shape at its third sighting
        key = batches[i % len(batches)]
        sightings[key] = sightings.get(key, 0) + 1
        if sightings[key] >= 3:
            captured.add(key)

    def probe() -> int:
        return len(captured)

    # forced graphs: one cycle (every batch seen), then whole cycles until one captures nothing:
    # cycle 2 captures a, cycle 3 b and c, cycle 4 changes nothing
    assert settle(step, FakeChooser(k=1, mode="on"), 0, 100, len(batches), probe) == 16
    assert captured == {"a", "b", "c"}
    captured.clear(), sightings.clear()
    assert settle(step, None, 0, 6, len(batches), probe) == 8  # bounded by `most`, whole cycles


def test_table_notes_a_kestrel_cell_timed_before_its_chooser_settled() -> None:
    base = dict(model="gemma4-e2b", method="qlora", layout="padded", tokens_per_s=1.0, peak_alloc_gib=1.0,
                peak_reserved_gib=1.0, cuda_graphs="auto", graph_layouts_seen=11)
    table = render_table([dict(base, system="kestrel", settled=False, settle_steps=40, graph_decisions=[{"graphed": True}] * 4),
                          dict(base, system="hf")], ["padded"])
    assert "- gemma4-e2b qlora padded kestrel: timed before the CUDA-graph chooser had settled (4 of 11 layouts" in table
    assert "settled" not in render_table([dict(base, system="kestrel", settled=True)], ["padded"])


def test_table_notes_a_run_whose_held_memory_grew() -> None:
    """A leak (memory held between steps growing over the timed steps) is named under the table;
    a steady run is not (the Gemma 4 leak of session 22 grew ~170 MiB a step)."""
    base = dict(model="gemma4-e2b", method="qlora", layout="packed", tokens_per_s=1.0, peak_alloc_gib=1.0,
                peak_reserved_gib=1.0, cuda_graphs="auto", settled=True)
    leaking = render_table([dict(base, system="kestrel", held_growth_mib_per_step=170.4)], ["packed"])
    assert "- gemma4-e2b qlora packed kestrel: the memory held between steps grew 170 MiB a step" in leaking
    for growth in (0.0, 0.5):
        assert "grew" not in render_table([dict(base, system="kestrel", held_growth_mib_per_step=growth)], ["packed"])
    assert "grew" not in render_table([dict(base, system="unsloth")], ["packed"])



@pytest.mark.parametrize("refused", [True, False])
def test_baselines_leave_flash_linear_attention_out_only_where_its_backward_is_refused(
        refused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.matrix_runner as runner

    monkeypatch.setattr(runner, "fla_refused_here", lambda: refused)
    monkeypatch.setenv("PYTHONPATH", "/c/.gpu-fla:/c/.gpu-site:/c")
    for system in ("unsloth", "hf"):
        assert runner.baseline_env(system) == ({"PYTHONPATH": "/c/.gpu-site:/c"} if refused else {})
    assert runner.baseline_env("kestrel") == {}  # Kestrel keeps the kernels either way
    monkeypatch.setenv("PYTHONPATH", "/c/.gpu-site")
    assert runner.baseline_env("unsloth") == {}  # nothing to leave out


def test_a_baseline_run_without_flash_linear_attention_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.matrix_runner as runner

    monkeypatch.setattr(runner, "fla_refused_here", lambda: True)
    monkeypatch.setenv("PYTHONPATH", "/c/.gpu-fla:/c")
    seen: list[dict[str, str]] = []

    def launch(args, timeout, extra_path=None, env=None):  # type: ignore[no-untyped-def]
        seen.append(env or {})
        return {"tokens_per_s": 1.0}

    args = _args(tmp_path)
    clock = Clock(1000.0, None)
    base = runner.run_one(("qwen3-0.6b", "qlora", "packed", "hf"), args, clock, launch)
    ours = runner.run_one(("qwen3-0.6b", "qlora", "packed", "kestrel"), args, clock, launch)
    assert seen[0]["PYTHONPATH"] == "/c" and "PYTHONPATH" not in seen[1]
    assert base is not None and base["flash_linear_attention"].startswith("left out")
    assert ours is not None and "flash_linear_attention" not in ours


def test_cells_pick_cells_across_models_in_their_order_and_bad_ones_are_refused(tmp_path) -> None:
    """--cells runs just the cells named (not the product of --models, --methods and --layouts), each for
    every system, in the order given, less those already recorded; a malformed or unknown cell is an error."""
    args = _args(tmp_path, "--cells", "qwen3-14b:qlora:packed, llama-3.2-1b:lora:long")
    assert pending(args) == [("qwen3-14b", "qlora", "packed", "kestrel"), ("qwen3-14b", "qlora", "packed", "hf"),
                             ("llama-3.2-1b", "lora", "long", "kestrel"), ("llama-3.2-1b", "lora", "long", "hf")]
    (tmp_path / "m.jsonl").write_text(json.dumps({"model": "qwen3-14b", "method": "qlora", "layout": "packed",
                                                  "system": "hf", "tokens_per_s": 1.0}) + "\n")
    assert ("qwen3-14b", "qlora", "packed", "hf") not in pending(args) and len(pending(args)) == 3
    for bad in ("qwen3-14b:qlora", "qwen3-14b:qlora:sideways", "nope:lora:long"):
        with pytest.raises(SystemExit):
            _args(tmp_path, "--cells", bad)


def test_table_names_short_cells_measured_under_other_settings_than_todays_defaults() -> None:
    """A cell short of a target whose Kestrel record misses a setting (recorded only from the session that made
    it) or ran it otherwise than today's default is named with those settings; one under today's defaults, or not
    short, is not."""
    from bench.matrix_table import settings_behind
    from kestrel.config import PerformanceSettings

    today = PerformanceSettings()
    current = dict(backward_graph_capture=today.backward_graph_capture, keep_attention=today.keep_attention,
                   keep_projection=today.keep_projection == "on", keep_qkv=today.keep_qkv == "on",
                   defer_mlp=today.defer_mlp, offload_gate=today.offload_gate,
                   cuda_allocator=f"{today.cuda_allocator} segments (through PYTORCH_CUDA_ALLOC_CONF)",
                   capture_stream=today.capture_stream)
    assert settings_behind(current) == []
    other = next(m for m in ("side", "steps") if m != today.capture_stream)
    assert settings_behind(dict(current, capture_stream=other)) == ["capture_stream"]
    # records made before `capture_stream` existed ran side, behind since the default moved to steps
    assert settings_behind({k: v for k, v in current.items() if k != "capture_stream"}) == (
        [] if today.capture_stream == "side" else ["capture_stream"])
    old = {k: v for k, v in current.items() if k not in ("backward_graph_capture", "cuda_allocator")}
    assert settings_behind(old) == ["backward_graph_capture", "cuda_allocator"]
    # flat batches (Kestrel's varlen rows) measured before their starts were read on the host
    assert settings_behind(dict(current, flat=True)) == ["host_starts"]
    assert settings_behind(dict(current, flat=True, host_starts=True)) == settings_behind(dict(current, flat=False)) == []
    base = dict(model="qwen3-4b", method="qlora", layout="long", peak_alloc_gib=1.0, cuda_graphs="auto", settled=True)
    unsloth = dict(base, system="unsloth", tokens_per_s=100.0, peak_reserved_gib=1.0)
    note = "Kestrel measured under other settings than today's defaults"
    over = render_table([dict(base, **old, system="kestrel", tokens_per_s=150.0, peak_reserved_gib=1.2), unsloth], ["long"])
    assert f"{note}: qwen3-4b qlora long (backward_graph_capture, cuda_allocator)" in over
    now = render_table([dict(base, **current, system="kestrel", tokens_per_s=150.0, peak_reserved_gib=1.2), unsloth],
                       ["long"])
    met = render_table([dict(base, **old, system="kestrel", tokens_per_s=150.0, peak_reserved_gib=0.9), unsloth], ["long"])
    assert "Reserved peak over" in now and note not in now and note not in met


def test_behind_lists_the_short_cells_under_other_settings_as_a_cells_value(tmp_path, capsys) -> None:
    """`bench/matrix.py --behind FILE`: the cells `cells_behind` names, in the table's order, as `--cells` takes them;
    a cell met, or short under today's defaults, is not among them."""
    import json

    from bench.matrix import main
    from bench.matrix_table import settings_behind

    base = dict(method="qlora", layout="long", peak_alloc_gib=1.0, cuda_graphs="auto", settled=True)
    old = dict(base, system="kestrel", tokens_per_s=150.0, peak_reserved_gib=1.2)  # no settings recorded
    assert settings_behind(old)
    records = [dict(old, model="qwen3-4b"), dict(old, model="llama-3.2-1b"),
               dict(old, model="qwen3-0.6b", peak_reserved_gib=0.9)]  # met: 1.5x at less memory
    records += [dict(base, model=m, system="unsloth", tokens_per_s=100.0, peak_reserved_gib=1.0)
                for m in ("qwen3-4b", "llama-3.2-1b", "qwen3-0.6b")]
    results = tmp_path / "m.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in records))
    main(["--behind", str(results)])
    assert capsys.readouterr().out.strip() == "llama-3.2-1b:qlora:long,qwen3-4b:qlora:long"
