"""Helpers shared by the GPU benchmarks: random-init models at real shapes, timing, memory.

Models are random-init from a config at the real shape (weights' values change neither speed nor
memory) and saved once as bf16 safetensors under /tmp on the GPU machine, then reused.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kestrel.config import ALL_LINEAR  # noqa: E402

LLAMA_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, hidden_act="silu",
    bos_token_id=128000, eos_token_id=128001,
)
LLAMA_1B = dict(  # Llama-3.2-1B: where a step's GPU work is small and the host matters most
    LLAMA_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
    tie_word_embeddings=True,
)
SHAPES = {"llama-8b": LLAMA_8B, "llama-1b": LLAMA_1B}
ROOT = Path(__file__).resolve().parent.parent
TARGETS = list(ALL_LINEAR)  # LoRA on all 7 linears (widened per family: bench.train.same_targets)


def llama8b_dir(path: str = "/tmp/kestrel-bench/llama8b", layers: int | None = None) -> Path:
    """A random-init Llama-3.1-8B-shape model folder (bf16), built on the GPU once and reused."""
    return shape_dir("llama-8b", path, layers)


def shape_dir(shape: str, path: str | None = None, layers: int | None = None) -> Path:
    """A random-init model folder of one of `SHAPES` (bf16), built on the GPU once and reused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = path or ("/tmp/kestrel-bench/llama8b" if shape == "llama-8b" else f"/tmp/kestrel-bench/{shape}")
    folder = Path(base if layers is None else f"{base}-{layers}l")
    if (folder / "config.json").exists():
        return folder
    cfg = AutoConfig.for_model("llama", **{**SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})})
    cfg.architectures = ["LlamaForCausalLM"]
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    _save_tokenizer(tmp)
    del model
    torch.cuda.empty_cache()
    os.replace(tmp, folder)
    return folder


def _save_tokenizer(folder: Path) -> None:
    """A stand-in tokenizer (the demo one): benchmarks feed random token ids, never text."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(ROOT / "assets" / "demo").save_pretrained(folder)


def bench_model_dir(smoke: bool, layers: int | None, smoke_name: str) -> Path:
    """The model a training benchmark runs: with `smoke`, a tiny random Llama with the demo
    tokenizer (under the temp folder, `smoke_name`; runs on a CPU), else the random-init
    Llama-3.1-8B shape (`llama8b_dir`, `layers` decoder layers when given)."""
    if smoke:
        from transformers import AutoTokenizer

        from tests.support.tiny import tiny_model

        folder = Path(tempfile.gettempdir()) / "kestrel-bench" / smoke_name
        if not (folder / "config.json").exists():
            tok = AutoTokenizer.from_pretrained(ROOT / "assets" / "demo")
            tiny_model("llama", len(tok)).save_pretrained(folder)
            tok.save_pretrained(folder)
        return folder
    return llama8b_dir(layers=layers)


def hf_qlora_model(folder: Path, smoke: bool, checkpointing: bool = False) -> Any:
    """The Hugging Face + PEFT baseline: the base in NF4 (double quantization, bf16 compute) on
    GPU 0, frozen, with LoRA r=16, alpha 16 on `TARGETS`; with `smoke`, fp32 and no quantization.
    `checkpointing`: Hugging Face's non-reentrant gradient checkpointing on the base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kw: dict[str, Any] = dict(dtype=torch.bfloat16 if not smoke else torch.float32, attn_implementation="sdpa")
    if not smoke:
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
        kw["device_map"] = {"": 0}
    model = AutoModelForCausalLM.from_pretrained(folder, **kw)
    for p in model.parameters():
        p.requires_grad_(False)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS,
                                            bias="none", task_type="CAUSAL_LM"))


def step_recorder(steps: list[dict[str, float]], graph_steps: list[int] | None = None,
                  timeline: list[dict[str, Any]] | None = None) -> Any:
    """A Kestrel training callback that appends each step's metrics to `steps`, and to
    `graph_steps` the index of each step during which the CUDA-graph chooser decided a layout
    (its probes, eager then graphed, make those steps and the ones before them slower). Each
    step's record also holds `gc_full_ms`: the milliseconds of CPython's full (generation 2)
    garbage collections since the step before, a host stall that can make a step slow, and on
    CUDA `max_alloc_gib`, the process's allocated peak up to that step's end. `timeline` gets
    every event (start, each step or evaluation, log line and best weights, end) with its time
    since the recorder was made and the peak so far: where a run's time and memory go."""
    from kestrel.training.metrics import Callback

    class Record(Callback):
        def __init__(self) -> None:
            self.full_ms, self.began = 0.0, 0.0
            gc.callbacks.append(self.clock)

        def clock(self, phase: str, info: dict[str, int]) -> None:
            if info.get("generation") != 2:
                return
            if phase == "start":
                self.began = time.perf_counter()
            else:
                self.full_ms += (time.perf_counter() - self.began) * 1e3

        def on_step(self, metrics: dict[str, float]) -> None:
            steps.append({**metrics, "gc_full_ms": round(self.full_ms, 2), **_peak()})
            self.full_ms = 0.0
            self.note("eval" if "eval_runtime" in metrics else "step", str(metrics.get("step", len(steps))))

        def note(self, kind: str, text: str) -> None:
            if timeline is not None:
                timeline.append({"t": round(time.perf_counter() - made, 3), "kind": kind, "text": text[:300], **_peak()})

        def on_start(self, info: Any) -> None:
            self.note("start", "")

        def on_best(self, step: int, path: str) -> None:
            self.note("best", str(step))

        def on_log(self, message: str) -> None:
            if graph_steps is not None and message.startswith("CUDA graphs "):
                graph_steps.append(len(steps))
            self.note("log", message)

        def on_end(self, status: str, error: str | None = None) -> None:
            self.note("end", status)
            if self.clock in gc.callbacks:
                gc.callbacks.remove(self.clock)

    def _peak() -> dict[str, float]:  # the process's allocated peak so far: where it grows, it was set
        return {"max_alloc_gib": round(gib(torch.cuda.max_memory_allocated()), 3)} if torch.cuda.is_available() else {}

    made = time.perf_counter()

    return Record()


def trainer_clock(stamps: list[float]) -> Any:
    """A transformers TrainerCallback that appends `time.perf_counter()` at the end of each step,
    once the GPU has finished it."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())

    return Clock()


def random_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).cuda()
    return ids, ids.clone()


def gib(n: float) -> float:
    return n / float(1 << 30)


def cuda_time(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds per call of `fn` on the GPU (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy, read + write counted."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * src.element_size() * 20 / (start.elapsed_time(end) / 1e3)


def run_isolated(script: str, args: list[str], extra_path: str | None = None, timeout: int = 900,
                 env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one benchmark case in its own process (a baseline's patches never leak into ours),
    with `env` added to this process's environment."""
    env = {**os.environ, **(env or {})}
    if extra_path:
        env["PYTHONPATH"] = f"{extra_path}:{env.get('PYTHONPATH', '')}"
    out = Path(f"/tmp/kestrel-bench/result-{uuid.uuid4().hex}.json")  # unique across threads running cases at once
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    proc = subprocess.run([sys.executable, script, *args, "--out", str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        return {"error": (proc.stderr or proc.stdout)[-2000:], "wall_s": time.time() - started}
    return json.loads(out.read_text())


def runs_in_order(script: str, args: list[str], order: str, key: str, timeout: int = 900) -> list[dict[str, Any]]:
    """`script --one <mode>` for each mode of `order` (comma-separated: "a,b,b,a" runs ABBA, so a drift over
    the call cancels), each in its own process (`run_isolated`): the results in order, each tagged
    {key: mode}; a failed run's holds its error, which is printed."""
    runs = []
    for mode in order.split(","):
        got = run_isolated(script, [*args, "--one", mode], timeout=timeout)
        if "error" in got:
            print(f"{mode}: failed: {got['error'][-600:]}", flush=True)
        runs.append({key: mode, **got})
    return runs


def mean_by(runs: list[dict[str, Any]], key: str, value: str) -> dict[str, float]:
    """The mean `value` of the runs of each `key` (`runs_in_order`'s tags), over the runs that have it."""
    modes = dict.fromkeys(r[key] for r in runs if value in r)
    return {m: statistics.mean(r[value] for r in runs if r[key] == m and value in r) for m in modes}
