r"""Training throughput matrix: model shapes x QLoRA/LoRA x batch layouts, Kestrel vs Unsloth vs HF.

Every (cell, system) runs in its own process (`bench.common.run_isolated`) on a random-init model
at a real model's config, built once on the GPU machine and cached under /tmp (weights' values
change neither speed nor memory), and appends one JSON line to --out. Pairs already in --out are
skipped, and no new work starts once --budget-s has passed, so the matrix runs in chunks
(`bench/matrix_runner.py`: the driver; with --gpus, a model's pairs run on several GPUs at once):

    python bench/matrix.py --models qwen3-4b,gemma3-4b --methods qlora --layouts padded,packed \
        --systems kestrel,kestrel-on,kestrel-off,unsloth,hf --out results/matrix.jsonl --budget-s 540
    python bench/matrix.py --models all --methods all --layouts all --systems all --gpus all \
        --settle 120 --out results/matrix.jsonl --budget-s 400 --hard-s 530   # every GPU of the host
    python bench/matrix.py --table results/matrix.jsonl          # the markdown table
    python bench/matrix.py --models all --methods qlora,lora --out m.jsonl --dry-run   # the plan
    options: --steps 10  --warmup 12 (Kestrel's; its CUDA-graph chooser times both ways first)
             --settle N (Kestrel's: up to N more steps until the chooser has decided every layout; 0: off)
             every system then steps each batch at least once and times from the start of a cycle of them
             --warmup-baselines 3  --batches 16  --seed 0  --cuda-graphs auto|on|off (system kestrel)
             --gpus 1|N|all (a worker per GPU, each pair's process on one: CUDA_VISIBLE_DEVICES)
             --anchors DIR (Unsloth's packages, first on its PYTHONPATH)  --cell-timeout 420
             --hard-s (default budget + 45: a case still running then is stopped, left for later)
             --mirror DIR (copy --out there after each line, e.g. $OUT)  --keep-models  --retry-errors
On the GPU machine: PYTHONPATH=$PWD/.gpu-site with .gpu-site and .gpu-anchors carried, --mirror $OUT
(the file comes back even when the command hits its limit), and the file carried into the next chunk
(`bash bench/gpu_session.sh matrix` does all of it).

Each record holds `gpu` (the CUDA_VISIBLE_DEVICES entry it ran on) and `concurrent` (the most
processes the host ran at once meanwhile, itself included): pairs on other GPUs share the host's
cores and memory bandwidth, which a host-bound step feels. Kestrel's records hold `settle_steps`,
`settled` (whether the chooser had decided every layout of the batches when timing began: if not,
the timed steps hold its probes, and the table says so) and every record `warmup_s` and
`held_growth_mib_per_step` (the memory held between steps, its growth over the timed steps: a leak
shows there, and the table names it).

Systems: `kestrel` (CUDA graphs per --cuda-graphs, default auto: the run's chooser decides),
`kestrel-on` / `kestrel-off` (forced), each with the product's checkpointing (`auto`: offloaded on one
GPU where the RAM allows; the record's `checkpointing` says which), `kestrel-std` (standard
checkpointing, graphs auto: the check of auto's choice), and the product's batches
(`BatchPlan(flat=runs_varlen(model))`); `unsloth` (use_gradient_checkpointing="unsloth") and `hf`
(HF + PEFT (+ bitsandbytes), non-reentrant checkpointing) on padded rows with an attention mask
(`padded`), rows packed with position_ids restarting per sample and no mask (`packed`), a plain
row (`long`). LoRA r=16, alpha=16 on all 7 linears; `qlora` on NF4 weights, `lora` on bf16 ones.
Layouts: `padded` batch 8 of samples 64..512 tokens; `packed` 2 rows of 2,048 tokens packed from
samples of 64..1,024; `long` one row of 8,192. The sample lengths come from a seeded RNG, the same
for every system; each step takes the next of --batches batches built once. Tokens/s counts real
(non-padding) tokens only; useful TFLOP/s is bench/train.py's `useful_flops_per_token` summed per
sample (sliding-window layers counted as full attention). RoPE scaling (llama3, linear) is left
out of the configs: it changes the rotary tables' values, not the work.
Mixture of experts (`qwen3-30b-a3b`, `gpt-oss-20b`, `qwen3.5-35b-a3b`, bench/model_shapes.py MOE_MODELS): LoRA on the
attention linears and on every expert (the MLP targets become PEFT parameter targets for `hf` too).
Their folders leave the routed experts' weights out of the checkpoint (`bench.matrix_models`: 3-5 GB
on disk, not 42-69), and every system's loader creates them on the GPU, randomly initialised; the
build checks the free disk first. Qwen3-30B-A3B needs `qlora` to fit one 80 GB GPU (16-bit: 61 GB
of weights before LoRA's): Kestrel then stores the experts in NF4 (`kestrel.model.expert_quant`),
while bitsandbytes quantizes `nn.Linear` only, so HF+PEFT keeps transformers' fused 3-D experts in
16-bit, as its users get it. Each record's `expert_storage` says how a system held the experts
("nf4", or their dtype; uint8: bitsandbytes 4-bit) and the table's notes list it; read the peak
memory beside it. Useful FLOPs count the k routed experts. gpt-oss runs eager attention with sinks
in Kestrel and `hf` (HF has no SDPA path for sinks: `kestrel.model.registry.hf_attention`); Unsloth
picks its own attention for a class without SDPA.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.matrix_models import build_model_dir, model_dir  # noqa: E402
from bench.matrix_runner import load_records, pending, run_matrix  # noqa: E402
from bench.matrix_table import FORCED_CHECKPOINTING, FORCED_GRAPHS, METHODS, cells_behind, render_table  # noqa: E402
from bench.model_shapes import MODELS  # noqa: E402

PAD_ID = 0  # padding id; sample tokens are drawn from 1..vocab-1 so padding is recognisable
SYSTEMS = ("kestrel", "kestrel-on", "kestrel-off", "kestrel-std", "unsloth", "hf")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a layout's samples are drawn and batched (`BatchPlan`'s batch_size, packing, max_len)."""

    batch: int
    max_len: int  # padded: the longest sample; packed: a row's length; long: the row
    sample_min: int
    sample_max: int
    packing: bool


LAYOUTS = {
    "padded": Layout(batch=8, max_len=512, sample_min=64, sample_max=512, packing=False),
    "packed": Layout(batch=2, max_len=2048, sample_min=64, sample_max=1024, packing=True),
    "long": Layout(batch=1, max_len=8192, sample_min=8192, sample_max=8192, packing=False),
}


# --- Batches: the same samples for every system, each collated its natural way -----------------

def sample_lengths(layout: str, n_batches: int, seed: int) -> list[int]:
    """Seeded sample lengths: enough samples for `n_batches` batches (packed: enough tokens)."""
    lay = LAYOUTS[layout]
    rng = random.Random(f"lengths:{layout}:{seed}")
    want = n_batches * lay.batch * (lay.max_len if lay.packing else 1)
    lengths: list[int] = []
    while (sum(lengths) if lay.packing else len(lengths)) < want:
        lengths.append(rng.randint(lay.sample_min, lay.sample_max))
    return lengths


def make_samples(layout: str, vocab: int, n_batches: int, seed: int) -> list[Any]:
    """The layout's samples with random token ids (labels = input ids)."""
    from kestrel.data.tokenize import Sample

    rng = random.Random(f"ids:{layout}:{seed}")
    samples = []
    for n in sample_lengths(layout, n_batches, seed):
        ids = [rng.randrange(1, vocab) for _ in range(n)]
        samples.append(Sample(ids, list(ids)))
    return samples


def plan_batches(layout: str, vocab: int, flat: bool, n_batches: int, seed: int) -> list[Any]:
    """`n_batches` batches (on the CPU) of the layout through `BatchPlan` (`flat`: Kestrel's varlen
    rows). Without `flat`: padded rows with a mask, packed rows with restarting position_ids, a plain row."""
    from kestrel.data.collate import BatchPlan

    lay = LAYOUTS[layout]
    samples = make_samples(layout, vocab, n_batches, seed)
    plan = BatchPlan(samples, lay.batch, lay.packing, lay.max_len, PAD_ID, seed, flat=flat)
    batches = []
    for i in range(n_batches):
        b = plan.batch(i // len(plan), i % len(plan))
        if layout == "long" and not flat:
            b = dataclasses.replace(b, attention_mask=None)  # one full row: nothing to mask
        batches.append(b)
    return batches


def batch_sample_lengths(b: Any) -> list[int]:
    """The lengths of the samples in a (CPU) batch: per padded row, or per restart of position_ids
    within a row's real (non-PAD_ID) tokens."""
    if b.position_ids is None:
        if b.attention_mask is None:
            return [b.input_ids.shape[1]] * b.input_ids.shape[0]
        return [int(n) for n in b.attention_mask.sum(1)]
    lengths = []
    for ids, pos in zip(b.input_ids.tolist(), b.position_ids.tolist()):
        real = sum(1 for t in ids if t != PAD_ID)
        starts = [i for i, p in enumerate(pos[:real]) if p == 0] + [real]
        lengths += [e - s for s, e in zip(starts, starts[1:])]
    return lengths


def useful_flops(b: Any, cfg: dict[str, Any]) -> float:
    """bench/train.py's useful FLOPs (base products + causal attention) over a batch's samples."""
    from bench.train import useful_flops_per_token

    return sum(n * useful_flops_per_token(n, cfg) for n in batch_sample_lengths(b))


# --- One (cell, system), in its own process ---------------------------------------------------

def kestrel_model(folder: Path, method: str, layout: Layout, cuda_graphs: str,
                  checkpointing: str = "auto") -> tuple[Any, bool, Any]:
    """Kestrel as the product sets it up (`kestrel.training.sft`): loaded and patched, `runs_varlen` read
    for the batch plan, LoRA attached, checkpointing as a run of these settings gets it (`auto`: the
    product's choice, `kestrel.training.recipe.checkpointing_for`) with the run's CUDA-graph chooser."""
    from bench.train import TARGETS
    from kestrel.recompute.checkpoint import set_gradient_checkpointing
    from kestrel.config import LoraSettings, PerformanceSettings, TrainConfig
    from kestrel.model.loader import load
    from kestrel.training.distributed import World
    from kestrel.training.recipe import checkpointing_for
    from kestrel.model.lora import attach_lora
    from kestrel.model.patching import runs_varlen

    import torch

    # Under the GPU's device context HF loads the folder straight onto the GPU (as a QLoRA load's
    # device map does) and creates there the weights a MoE folder leaves out (bench.matrix_models):
    # initialising 20-30B expert weights on the CPU takes minutes. Patching only rebinds forwards.
    with torch.device("cuda"):
        model, _ = load(str(folder), layout.max_len, load_in_4bit=method == "qlora", dtype="bf16")
    flat = runs_varlen(model)
    run = TrainConfig(method=method, batch_size=layout.batch, max_seq_length=layout.max_len,
                      gradient_checkpointing=checkpointing, performance=PerformanceSettings(cuda_graphs=cuda_graphs))
    mode, _ = checkpointing_for(run, model, World())
    for p in model.parameters():
        p.requires_grad_(False)
    model = attach_lora(model, LoraSettings(r=16, alpha=16, dropout=0.0, targets=list(TARGETS)))
    recompute = set_gradient_checkpointing(model, mode, cuda_graphs)
    return model, flat, recompute


def batch_loss(model: Any, b: Any) -> Any:
    """The training loss of one planned batch (`plan_batches`), as every system's step computes it."""
    return model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids,
                 labels=b.labels, use_cache=False, **b.model_kwargs()).loss


def system_model(system: str, folder: Path, method: str, layout: Layout, cuda_graphs: str) -> tuple[Any, bool, Any]:
    """(model, flat, recompute) for `system`; baselines through bench/train.py's `build`."""
    if system.startswith("kestrel"):
        return kestrel_model(folder, method, layout, FORCED_GRAPHS.get(system, cuda_graphs),
                             FORCED_CHECKPOINTING.get(system, "auto"))
    from bench.train import build

    checkpointing = "offload" if system == "unsloth" else "standard"  # unsloth: "unsloth"; hf: non-reentrant
    args = argparse.Namespace(method=method, seq=layout.max_len, checkpointing=checkpointing)
    return build(system, folder, args), False, None


def chooser_settled(chooser: Any, stepped: int, n_batches: int) -> bool:
    """Whether a system is warm for its timed steps after `stepped` steps cycling `n_batches`: every
    batch stepped at least once (its first step compiles, autotunes or captures for its shapes, in
    any system, forced graphs included) and, for Kestrel's CUDA-graph chooser (`GraphChooser`) in
    auto, every layout it has seen decided. `chooser` None: a system without one."""
    if stepped < n_batches:
        return False
    if chooser is None or chooser.mode != "auto":
        return True
    return len(chooser.decisions()) == len(chooser.layouts)


def settle(step: Callable[[int], None], chooser: Any, start: int, most: int, n_batches: int,
           probe: Callable[[], Any] | None = None) -> int:
    """After `start` warm-up steps, step on (`step(i)`, cycling the batches) until `chooser_settled`
    or `most` more steps, then on to the start of a cycle so that every system times the same
    batches; with `probe` (what a system has built for its shapes: Kestrel's layer graphs), then
    whole cycles until one leaves it unchanged, within `most`. How many steps ran. The chooser
    decides a layout only after timing it both ways (`GraphChooser`), and graphs capture a
    signature at its second or third sighting, so layouts that recur rarely need more than the warm-up."""
    n = 0
    while n < most and not chooser_settled(chooser, start + n, n_batches):
        step(start + n)
        n += 1
    while (start + n) % n_batches:
        step(start + n)
        n += 1
    while probe is not None and n < most:
        before = probe()
        for _ in range(n_batches):
            step(start + n)
            n += 1
        if probe() == before:
            break
    return n


def timed_steps(model: Any, batches: list[Any], warmup: int, steps: int, chooser: Any = None,
                settle_most: int = 0, probe: Callable[[], Any] | None = None) -> dict[str, Any]:
    """`warmup` steps, up to `settle_most` more while Kestrel's `chooser` settles (`settle`), then
    `steps` timed AdamW steps; step i on batches[i % len]; timings, memory, losses."""
    import torch

    from bench.common import gib

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    losses: list[torch.Tensor] = []

    def step(i: int) -> None:
        loss = batch_loss(model, batches[i % len(batches)])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    model.train()
    began = time.perf_counter()
    for i in range(warmup):
        step(i)
    settled = settle(step, chooser, warmup, settle_most, len(batches), probe)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - began
    first = warmup + settled
    chooser_state = {"settled": chooser_settled(chooser, first, len(batches))} if chooser is not None else {}
    warm = gib(torch.cuda.max_memory_allocated()), gib(torch.cuda.max_memory_reserved())
    held = torch.cuda.memory_allocated()  # between steps: a step that keeps its tensors makes it grow
    torch.cuda.reset_peak_memory_stats()  # the timed steps' own peaks, next to the whole run's
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    start = time.perf_counter()
    for j in range(steps):
        marks[j].record()
        step(first + j)
    marks[-1].record()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    steady = gib(torch.cuda.max_memory_allocated()), gib(torch.cuda.max_memory_reserved())
    growth = (torch.cuda.memory_allocated() - held) / 2**20 / max(steps, 1)
    return {"held_growth_mib_per_step": growth, "elapsed_s": elapsed,
            "step_s": [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])],
            "peak_alloc_gib": max(warm[0], steady[0]), "peak_reserved_gib": max(warm[1], steady[1]),
            "steady_alloc_gib": steady[0], "steady_reserved_gib": steady[1], "losses": [float(x) for x in losses],
            "warmup_s": warm_s, "settle_steps": settled, **chooser_state}


def graph_report(recompute: Any, system: str, cuda_graphs: str) -> dict[str, Any]:
    """Kestrel's CUDA-graph mode, the chooser's decisions and the layer graphs' counts."""
    if not system.startswith("kestrel"):
        return {}
    chooser = recompute.chooser if recompute is not None else None
    return {"cuda_graphs": FORCED_GRAPHS.get(system, cuda_graphs),
            "graph_decisions": [dataclasses.asdict(d) for d in chooser.decisions()] if chooser else [],
            "graph_layouts_seen": len(chooser.layouts) if chooser else 0, "layer_graphs": recompute.graphs.stats() if recompute else None,
            "graph_warnings": sorted(recompute.graphs.warned) if recompute else []}


def adapted(model: Any) -> dict[str, Any]:
    """The module names that carry LoRA adapters (`lora_A`'s parents, by their last name): every
    system should list the same (`bench.train.same_targets`)."""
    names = {name.rsplit(".lora_A", 1)[0].rsplit(".", 1)[-1] for name, _ in model.named_modules() if name.endswith(".lora_A")}
    return {"lora_targets": sorted(names)}


def expert_storage(model: Any) -> dict[str, Any]:
    """How a mixture of experts holds its routed experts' weights: "nf4" where Kestrel packed them
    (`kestrel.model.expert_quant`), else the weights' dtypes (uint8: bitsandbytes 4-bit); {} for a dense model."""
    from kestrel.model.expert_quant import PACKED_ATTR

    kinds = {"nf4" for m in model.modules() if getattr(m, PACKED_ATTR, None)}
    for name, p in model.named_parameters():
        # Kestrel's NF4 placeholders are zero-stride views; LoRA's own weights are not the base's.
        if ".experts." in name and "lora_" not in name and p.ndim >= 2 and any(p.stride()):
            kinds.add(str(p.dtype).removeprefix("torch."))
    return {"expert_storage": sorted(kinds)} if kinds else {}


def measure_cell(args: argparse.Namespace) -> dict[str, Any]:
    """Throughput and memory of one (model, method, layout, system) in this process."""
    name, method, layout, system = args.cell.split(",")
    from bench.train import SPEC_PEAK_TFLOPS, _import_first

    allocator = _import_first("kestrel" if system.startswith("kestrel") else system)
    import torch

    torch.cuda.reset_peak_memory_stats()
    model, flat, recompute = system_model(system, model_dir(name), method, LAYOUTS[layout], args.cuda_graphs)
    batches = plan_batches(layout, MODELS[name]["vocab_size"], flat, args.batches, args.seed)
    flops = [useful_flops(b, MODELS[name]) for b in batches]
    gpu = [b.to(torch.device("cuda")) for b in batches]
    kestrel = system.startswith("kestrel")
    chooser = getattr(recompute, "chooser", None) if kestrel else None
    # Every system steps each batch once before timing; Kestrel's chooser and graphs may take up to --settle.
    graphs = getattr(recompute, "graphs", None) if kestrel else None
    probe = (lambda: {k: v for k, v in graphs.stats().items() if k != "copies"}) if graphs is not None else None
    from contextlib import nullcontext

    from kestrel.recompute.capture_stream import steps_on, steps_stream
    from kestrel.training.heap import steps_heap

    # the steps' own stream under `performance.capture_stream: steps`, and the heap frozen after the first steps (no
    # full collection walks the model and its graphs mid-step), as the product's loop runs them
    stream = steps_stream(torch.device("cuda"), recompute.capture_stream) if kestrel and recompute is not None else None
    with steps_heap() if kestrel else nullcontext(), steps_on(stream):
        res = timed_steps(model, gpu, args.warmup, args.steps, chooser, max(args.settle if kestrel else 0, len(batches)),
                          probe)
    timed = [(args.warmup + res["settle_steps"] + j) % len(batches) for j in range(args.steps)]
    tokens = sum(batches[i].tokens for i in timed)
    slots = sum(batches[i].input_ids.numel() for i in timed)
    tflops = sum(flops[i] for i in timed) / res["elapsed_s"] / 1e12
    return {"tokens_per_s": tokens / res["elapsed_s"], "s_per_step": res["elapsed_s"] / args.steps,
            "real_tokens": tokens, "padding_share": 1 - tokens / slots, "flat": flat,
            "useful_tflops": tflops, "mfu_vs_spec": tflops / SPEC_PEAK_TFLOPS, **res,
            "device": torch.cuda.get_device_name(), "warmup": args.warmup, "steps": args.steps,
            **({"settle": args.settle, "checkpointing": "offload" if recompute.offload else "standard",
                "offload_gate": recompute.gate_share, "defer_mlp": recompute.deferral.mode,
                "keep_attention": recompute.keep_attention,
                "keep_projection": recompute.keep_projection,
                "mlp_deferral": [d.as_metrics() for d in recompute.deferral.decided.values()],
                "attention_kept": {str(rows): kept.attention for rows, kept in recompute.kept.items()},
                "projection_kept": {str(rows): kept.projection for rows, kept in recompute.kept.items()},
                "keep_qkv": recompute.keep_qkv, "qkv_kept": {str(rows): kept.qkv for rows, kept in recompute.kept.items()},
                "backward_graph_capture": recompute.backward_capture, "capture_stream": recompute.capture_stream,
                "host_starts": all(b.starts is not None for b in batches),  # the forward read no starts back
                "steps_heap": True,  # its timed steps ran as the product's loop runs them: the heap frozen
                "host_link": {"bytes_per_s": {str(d): r for d, r in recompute.deferral.link.rates.items()},
                              "layer_seconds": {str(rows): s for rows, s in recompute.deferral.link.layer_seconds.items()}},
                } if kestrel else {}),
            "batches": args.batches, "seed": args.seed, "versions": _versions(),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "cuda_allocator": allocator, **expert_storage(model), **adapted(model),
            **graph_report(recompute, system, args.cuda_graphs)}


def _versions() -> dict[str, str]:
    """Versions of the packages this process imported."""
    names = ("torch", "transformers", "peft", "bitsandbytes", "unsloth", "triton")
    return {n: str(getattr(sys.modules[n], "__version__", "?")) for n in names if n in sys.modules}


# --- Command line ------------------------------------------------------------------------------

def _names(raw: str, known: Any, what: str, ap: argparse.ArgumentParser) -> list[str]:
    names = list(known) if raw == "all" else [n.strip() for n in raw.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"unknown {what}: {', '.join(unknown)} (known: {', '.join(known)}, or all)")
    return names


def _cells(raw: str, ap: argparse.ArgumentParser) -> list[tuple[str, str, str]]:
    """--cells "model:method:layout,...": each part checked against the known names."""
    cells = []
    for part in (p.strip() for p in raw.split(",") if p.strip()):
        names = part.split(":")
        if len(names) != 3:
            ap.error(f"--cells takes model:method:layout, comma-separated; got {part!r}")
        for name, known, what in zip(names, (MODELS, METHODS, LAYOUTS), ("model", "method", "layout")):
            if name not in known:
                ap.error(f"--cells {part!r}: unknown {what} {name!r} (known: {', '.join(known)})")
        cells.append((names[0], names[1], names[2]))
    return cells


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-4b", help=f"comma-separated or all: {', '.join(MODELS)}")
    ap.add_argument("--methods", default="qlora", help="comma-separated or all: qlora, lora")
    ap.add_argument("--layouts", default="padded,packed,long", help="comma-separated or all: padded, packed, long")
    ap.add_argument("--systems", default="kestrel,unsloth,hf", help=f"comma-separated or all: {', '.join(SYSTEMS)}")
    ap.add_argument("--cells", help="model:method:layout, comma-separated: these cells alone, in this order "
                                    "(instead of --models x --methods x --layouts)")
    ap.add_argument("--out", help="results (JSON lines); with --cell/--prepare: the one result's file")
    ap.add_argument("--table", metavar="FILE", help="print the markdown table of a results file and exit")
    ap.add_argument("--behind", metavar="FILE", help="print, as a --cells value, the cells of a results file short "
                    "of a target whose Kestrel record ran under other settings than today's defaults, and exit")
    ap.add_argument("--budget-s", type=float, default=0.0, help="start no new work after this many seconds (0: none)")
    ap.add_argument("--hard-s", type=float, default=None, help="stop a running case then (default: budget + 45)")
    ap.add_argument("--cell-timeout", type=float, default=420.0, help="seconds one case may take")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=12, help="Kestrel's warm-up steps")
    ap.add_argument("--warmup-baselines", type=int, default=3)
    ap.add_argument("--settle", type=int, default=0, help="Kestrel only: up to this many more steps after "
                    "--warmup until its CUDA-graph chooser has decided every layout (0: off)")
    ap.add_argument("--gpus", default="1", help="GPUs of this host to run pairs on at once: a count or all")
    ap.add_argument("--batches", type=int, default=16, help="distinct batches, cycled through")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cuda-graphs", default="auto", choices=("auto", "on", "off"), help="for system kestrel")
    ap.add_argument("--anchors", default=str(ROOT / ".gpu-anchors"), help="Unsloth's packages (PYTHONPATH)")
    ap.add_argument("--mirror", metavar="DIR", help="copy --out into DIR after each record (e.g. $OUT)")
    ap.add_argument("--keep-models", action="store_true", help="keep other models' folders under /tmp")
    ap.add_argument("--retry-errors", action="store_true", help="run again the pairs recorded with an error")
    ap.add_argument("--dry-run", action="store_true", help="list the pending pairs and exit")
    ap.add_argument("--cell", help=argparse.SUPPRESS)  # model,method,layout,system: one case, this process
    ap.add_argument("--prepare", help=argparse.SUPPRESS)  # build one model's folder, this process
    args = ap.parse_args(argv)
    args.models = _names(args.models, MODELS, "models", ap)
    args.methods = _names(args.methods, METHODS, "methods", ap)
    args.layouts = _names(args.layouts, LAYOUTS, "layouts", ap)
    args.systems = _names(args.systems, SYSTEMS, "systems", ap)
    args.cells = _cells(args.cells, ap) if args.cells else None
    if not args.table and not args.behind and not args.out:
        ap.error("--out is required (or --table FILE, --behind FILE)")
    if args.gpus != "all" and not (args.gpus.isdigit() and int(args.gpus) >= 1):
        ap.error(f"--gpus takes a count of at least 1 or all, got {args.gpus!r}")
    if args.settle < 0:
        ap.error(f"--settle takes a number of steps (0: off), got {args.settle}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.table:
        print(render_table(load_records(Path(args.table)), list(LAYOUTS)))
    elif args.behind:
        print(",".join(cells_behind(load_records(Path(args.behind)), list(LAYOUTS))))
    elif args.prepare:
        folder = build_model_dir(args.prepare)
        Path(args.out).write_text(json.dumps({"folder": str(folder)}))
    elif args.cell:
        Path(args.out).write_text(json.dumps(measure_cell(args)))
    elif args.dry_run:
        for key in pending(args):
            print(",".join(key))
    else:
        run_matrix(args)
        print(render_table(load_records(Path(args.out)), list(LAYOUTS)))


if __name__ == "__main__":
    main()
