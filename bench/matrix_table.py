"""`bench/matrix.py --table`: the markdown table of a matrix results file, one row per cell."""

from __future__ import annotations

from typing import Any

from bench.model_shapes import MODELS, MOE_MODELS

METHODS = ("qlora", "lora")
FORCED_GRAPHS = {"kestrel-on": "on", "kestrel-off": "off"}  # Kestrel with its CUDA graphs forced
FORCED_CHECKPOINTING = {"kestrel-std": "standard"}  # Kestrel with standard checkpointing, against auto's choice
TARGET_RATIO = 1.2  # issue 24: Kestrel at least 1.2x Unsloth's tokens/s on every cell, at no more peak memory
# Growth of the memory held between steps that the table calls a leak: far above what a new layout's
# cached tables add, far below a step's activations (Gemma 4's leak, session 22: ~170 MiB a step)
LEAK_MIB_PER_STEP = 1.0


def record_key(r: dict[str, Any]) -> tuple[str, str, str, str]:
    """(model, method, layout, system): what one result line is of."""
    return r.get("model", ""), r.get("method", ""), r.get("layout", ""), r.get("system", "")


def _failure(r: dict[str, Any]) -> str:
    text = str(r.get("error", ""))
    if "out of memory" in text.lower() or "OutOfMemory" in text:
        return "OOM"
    if text.startswith("timeout"):
        return "timeout"
    if "NotImplementedError" in text or "not supported" in text.lower() or "unsupported" in text.lower():
        return "unsupported"
    return "error"


def _tps(r: dict[str, Any] | None) -> str:
    if r is None:
        return ""
    return _failure(r) if "error" in r else f"{r['tokens_per_s']:,.0f}"


def _ok(r: dict[str, Any] | None) -> bool:
    return r is not None and "error" not in r and bool(r.get("tokens_per_s"))


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
    return f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x" if _ok(a) and _ok(b) else ""


def _mem(r: dict[str, Any] | None) -> str:
    return f"{r['peak_alloc_gib']:.2f} / {r['peak_reserved_gib']:.2f}" if _ok(r) else ""


def _auto_vs_forced(by: dict[str, dict[str, Any]]) -> str:
    """Kestrel auto's tokens/s over the faster forced mode's, and which mode that was."""
    auto = by.get("kestrel")
    forced = [(by[s]["tokens_per_s"], s) for s in FORCED_GRAPHS if _ok(by.get(s))]
    if not _ok(auto) or auto.get("cuda_graphs", "auto") != "auto" or not forced:
        return ""
    best, name = max(forced)
    return f"{auto['tokens_per_s'] / best:.2f}x (vs {FORCED_GRAPHS[name]})"


def _auto_vs_standard(by: dict[str, dict[str, Any]]) -> str:
    """Kestrel (auto checkpointing) over Kestrel with standard checkpointing, and what auto chose."""
    auto, std = by.get("kestrel"), by.get("kestrel-std")
    return f"{_ratio(auto, std)} ({auto.get('checkpointing', 'offload')})" if _ratio(auto, std) else ""


def _graphs(r: dict[str, Any] | None) -> str:
    """What Kestrel auto's chooser decided: layouts graphed of those decided (of those seen)."""
    if not _ok(r) or r.get("cuda_graphs") != "auto":
        return ""
    decided = r.get("graph_decisions", [])
    return f"{sum(d['graphed'] for d in decided)}/{len(decided)} graphed ({r.get('graph_layouts_seen', 0)} seen)"


def _order(cell: tuple[str, str, str], layouts: list[str]) -> tuple[int, ...]:
    lists = (list(MODELS), list(METHODS), layouts)
    return tuple(lst.index(v) if v in lst else len(lst) for lst, v in zip(lists, cell))


def _expert_notes(cells: dict[tuple[str, str, str], dict[str, dict[str, Any]]], order: list[tuple[str, str, str]]) -> list[str]:
    """Notes under the table: how each system held a mixture of experts' routed experts."""
    lines = [f"- {' '.join(cell)}: experts held as "
             + "; ".join(f"{s} {'/'.join(r['expert_storage'])}" for s, r in cells[cell].items() if r.get("expert_storage"))
             for cell in order if any(r.get("expert_storage") for r in cells[cell].values())]
    if any(c[0] in MOE_MODELS and c[1] == "qlora" for c in order):
        lines.insert(0, "- qlora on a mixture of experts: Kestrel stores the routed experts in NF4. bitsandbytes quantizes "
                        "`nn.Linear` only and transformers 5 holds the experts as fused 3-D parameters, so HF+PEFT's QLoRA "
                        "keeps them 16-bit (the baseline as its users get it); Unsloth's as recorded below.")
    return lines


def _run_notes(cells: dict[tuple[str, str, str], dict[str, dict[str, Any]]], order: list[tuple[str, str, str]]) -> list[str]:
    """Notes under the table: Kestrel runs timed before their CUDA-graph chooser had settled, runs
    whose memory held between steps grew (a leak), and records measured beside others on the same
    host (`bench.matrix_runner`)."""
    lines = []
    for cell in order:
        for system, r in cells[cell].items():
            if _ok(r) and r.get("settled") is False:
                decided, seen = len(r.get("graph_decisions", [])), r.get("graph_layouts_seen", 0)
                lines.append(f"- {' '.join(cell)} {system}: timed before the CUDA-graph chooser had settled "
                             f"({decided} of {seen} layouts decided after {r.get('settle_steps', 0)} settle steps): "
                             "its timed steps hold the chooser's probes, some layouts eager")
            growth = r.get("held_growth_mib_per_step", 0.0) if _ok(r) else 0.0
            if growth > LEAK_MIB_PER_STEP:
                lines.append(f"- {' '.join(cell)} {system}: the memory held between steps grew {growth:.0f} MiB a "
                             "step over the timed steps: a leak (steps keep tensors), so a long run needs more")
    shared = [r for by in cells.values() for r in by.values() if max(r.get("concurrent", 1), r.get("drivers", 1)) > 1]
    if shared:
        lines.append(f"- {len(shared)} records ran beside other processes on the same host (up to "
                     f"{max(max(r.get('concurrent', 1), r.get('drivers', 1)) for r in shared)} at once, one GPU each): "
                     "they shared its cores and memory bandwidth (`gpu`, `concurrent`, `drivers` in each record)")
    return lines


def settings_behind(r: dict[str, Any]) -> list[str]:
    """The performance settings whose default today (`PerformanceSettings`) Kestrel record `r` was not measured
    under: set otherwise, or missing (a record names a setting only from the session that made it)."""
    from kestrel.config import PerformanceSettings

    today = PerformanceSettings()
    as_recorded = {  # how a record writes each default (`bench/matrix.py`'s record of the run's `Recompute`)
        "backward_graph_capture": today.backward_graph_capture, "keep_attention": today.keep_attention,
        "keep_projection": today.keep_projection == "on", "keep_qkv": today.keep_qkv == "on",
        "defer_mlp": today.defer_mlp, "offload_gate": today.offload_gate, "capture_stream": today.capture_stream,
    }
    before = {"capture_stream": "side"}  # what records made before a setting existed ran under
    behind = [name for name, value in as_recorded.items() if r.get(name, before.get(name)) != value]
    if not str(r.get("cuda_allocator", "")).startswith(f"{today.cuda_allocator} segments"):
        behind.append("cuda_allocator")
    if r.get("flat") and not r.get("host_starts"):  # before session 48 the forward read its batch's starts back
        behind.append("host_starts")
    return behind


def _short(k: dict[str, Any], u: dict[str, Any]) -> bool:
    """Whether Kestrel's record `k` misses a target against Unsloth's `u` (both measured): speed or reserved peak."""
    return k["tokens_per_s"] < TARGET_RATIO * u["tokens_per_s"] or k["peak_reserved_gib"] > u["peak_reserved_gib"]


def _dense_cells(layouts: list[str]) -> list[tuple[str, str, str]]:
    """Every (model, method, layout) of the dense matrix (MODELS but the mixtures of experts, x METHODS x `layouts`)."""
    return [(m, me, lay) for m in MODELS if m not in MOE_MODELS for me in METHODS for lay in layouts]


def _stale_short(cells: dict[tuple[str, str, str], dict[str, dict[str, Any]]],
                 layouts: list[str]) -> list[tuple[tuple[str, str, str], list[str]]]:
    """(cell, the settings it is behind on) for each dense cell short of a target (`_short`) whose Kestrel record ran
    under other settings than today's defaults (`settings_behind`), in the table's order."""
    stale = []
    for cell in _dense_cells(layouts):
        k, u = cells.get(cell, {}).get("kestrel"), cells.get(cell, {}).get("unsloth")
        if _ok(k) and _ok(u) and _short(k, u) and (behind := settings_behind(k)):
            stale.append((cell, behind))
    return stale


def cells_behind(records: list[dict[str, Any]], layouts: list[str]) -> list[str]:
    """model:method:layout of each cell `_stale_short` names: `bench/matrix.py --cells`' value to measure them again
    (`--behind`)."""
    return [":".join(cell) for cell, _ in _stale_short(_cells_of(records), layouts)]


def _target_notes(cells: dict[tuple[str, str, str], dict[str, dict[str, Any]]], layouts: list[str]) -> list[str]:
    """Where the dense matrix (every model of MODELS but the mixtures of experts, x METHODS x `layouts`) stands
    against issue 24's targets, read from the records alone: cells under TARGET_RATIO Unsloth's tokens/s, cells
    whose reserved peak is over Unsloth's, Kestrel cells with no Unsloth run beside them, cells not measured, and
    of the cells listed, those whose Kestrel record ran under other settings than today's defaults
    (`settings_behind`: to be measured again before anything is read into them)."""
    under, over, alone, missing = [], [], [], {}
    for cell in _dense_cells(layouts):
        by = cells.get(cell, {})
        k, u = by.get("kestrel"), by.get("unsloth")
        if not _ok(k):
            missing.setdefault(cell[0], []).append(f"{cell[1]} {cell[2]}")
        elif not _ok(u):
            alone.append(" ".join(cell) + (f" (Unsloth: {_failure(u)})" if u is not None else ""))
        else:
            ratio = k["tokens_per_s"] / u["tokens_per_s"]
            if ratio < TARGET_RATIO:
                under.append(f"{' '.join(cell)} ({ratio:.2f}x)")
            if k["peak_reserved_gib"] > u["peak_reserved_gib"]:
                over.append(f"{' '.join(cell)} (+{k['peak_reserved_gib'] - u['peak_reserved_gib']:.2f} GiB)")
    behind = [f"{' '.join(cell)} ({', '.join(stale)})" for cell, stale in _stale_short(cells, layouts)]
    lines = [f"- {title}: {'; '.join(items)}" for title, items in (
        (f"Under {TARGET_RATIO}x Unsloth", under), ("Reserved peak over Unsloth's", over),
        ("No Unsloth run beside Kestrel's", alone),
        ("Of those short of a target, Kestrel measured under other settings than today's defaults", behind))
        if items]
    if missing:
        lines.append("- Not measured: " + "; ".join(f"{m} ({', '.join(v)})" for m, v in missing.items()))
    return lines


def side_by_side(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One cell's records (in file order) -> the latest record of each system from one chunk (`chunk`: one run of
    bench/matrix.py, whose pairs run side by side): the latest chunk holding Kestrel and a baseline, else the latest
    chunk. Records from before chunks were recorded form one chunk of their own."""
    chunks: dict[str | None, dict[str, dict[str, Any]]] = {}
    for r in records:
        by = chunks.pop(r.get("chunk"), {})  # re-inserted: the dict's order is the chunks' latest records' order
        by[r.get("system", "")] = r
        chunks[r.get("chunk")] = by
    ordered = list(chunks.values())
    paired = [by for by in ordered if "kestrel" in by and ("unsloth" in by or "hf" in by)]
    return (paired or ordered)[-1]


def _cells_of(records: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, dict[str, Any]]]:
    """(model, method, layout) -> each system's record from one chunk (`side_by_side`)."""
    grouped: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in records:
        grouped.setdefault(record_key(r)[:3], []).append(r)
    return {cell: side_by_side(rs) for cell, rs in grouped.items()}


def render_table(records: list[dict[str, Any]], layouts: list[str]) -> str:
    """One markdown row per (model, method, layout): each system's record from one chunk (`side_by_side`)."""
    cells = _cells_of(records)
    lines = ["| model | method | layout | kestrel tok/s | unsloth tok/s | hf tok/s | kestrel / unsloth "
             "| auto / best forced | auto / standard ckpt | kestrel GiB alloc / reserved | unsloth GiB | hf GiB "
             "| auto's CUDA graphs | device |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    order = sorted(cells, key=lambda c: _order(c, layouts))
    for cell in order:
        by = cells[cell]
        k, u, h = by.get("kestrel"), by.get("unsloth"), by.get("hf")
        device = next((r["device"] for r in by.values() if r.get("device")), "")
        lines.append(f"| {' | '.join(cell)} | {_tps(k)} | {_tps(u)} | {_tps(h)} | {_ratio(k, u)} "
                     f"| {_auto_vs_forced(by)} | {_auto_vs_standard(by)} | {_mem(k)} | {_mem(u)} | {_mem(h)} | {_graphs(k)} | {device} |")
    notes = _expert_notes(cells, order) + _run_notes(cells, order) + _target_notes(cells, layouts)
    return "\n".join(lines + (["", *notes] if notes else []))
