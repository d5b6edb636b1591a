"""Decode benchmark: Kestrel's decode path against Hugging Face and Unsloth, Llama-3.1-8B shape, bf16.

    python bench/decode.py --out $OUT/decode.json                        # HF + Kestrel, ~2.5 min (H200)
    python bench/decode.py --baseline unsloth --out $OUT/decode.json     # + Unsloth in its own process, ~3.5 min
    python bench/decode.py --smoke --out /tmp/decode_smoke.json          # tiny model, any device

Random-init weights at the real shape (speed does not depend on the values), no downloads.
One run measures, in this order (HF first: attaching LoRA later rewires the model's modules):
  0. with `--baseline unsloth`: Unsloth's inference mode (`FastLanguageModel.for_inference`) in a
     child process (`import unsloth` must precede transformers, and its patches must not leak
     into ours), `--anchors` (default `.gpu-anchors`) prepended to its PYTHONPATH; its rows are
     merged into this report, its failure recorded as an error row;
  1. device copy bandwidth (read + write) and the batch-1 bound = bandwidth / bytes read per token
     (every weight but the untied embedding table, plus the KV cache);
  2. HF `generate` with its dynamic cache, batch 1 and `--batch`;
  3. HF `generate` with a static cache + torch.compile (its auto-compile), batch 1;
  4. Kestrel bf16 (fused q/k/v and gate/up products; batch 1 through the Triton matrix-vector
     kernel, kernels/gemv.py), batch 1 and `--batch`, then the same with separate products
     (`fuse=False`) at batch 1; with `--no-triton` first also batch 1 with cuBLAS products
     (`kestrel_cublas`, the session-2 path);
  5. the same two with an unmerged LoRA adapter (r=16, all seven linears, random non-zero B);
  6. Kestrel with the base quantized to NF4 (bitsandbytes; never fused).

Workload: a 512-token prompt, 256 new tokens, greedy, no stop tokens. Reported per variant:
first-token latency (prefill + first token), tokens/s over the whole call, decode-only tokens/s,
for batch 1 the fraction of the bandwidth bound, and for Kestrel the GPU memory building its
generator added (`generator_added_GB`: RoPE tables and the LoRA bank; fusing re-points the
weights into one buffer per group and copies none, so this stays near zero).
Every variant is guarded: a failure becomes an error row and the run goes on; the JSON is
rewritten after every row, so a run cut short keeps what it measured. `--profile DIR` adds, for
each Kestrel variant at batch 1, kernel time per token by kernel name (`profile_<name>.txt`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import copy_bandwidth  # noqa: E402
from bench.decode_report import summarize  # noqa: E402

LLAMA_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
    rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=8192),
)  # fmt: skip
ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_model(smoke: bool, device: torch.device) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    if smoke:
        from tests.support.tiny import tiny_model

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        return tiny_model("llama", 512, seed=0, dtype=dtype).to(device)
    config = AutoConfig.for_model("llama", **LLAMA_8B)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def bytes_per_step(model: torch.nn.Module, batch: int, context: int) -> int:
    """What one decode step must read: every weight but an untied embedding table, plus KV."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    embed = inner.model.embed_tokens.weight
    tied = inner.lm_head.weight.data_ptr() == embed.data_ptr()
    weights = sum(p.numel() * p.element_size() for p in inner.parameters())
    weights -= 0 if tied else embed.numel() * embed.element_size()
    cfg = inner.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * batch * context
    return weights + kv


def measure(name: str, batch: int, new: int, run: Callable[[], tuple[float, float, list[int]]], repeats: int,
            warm: Callable[[], Any] | None = None) -> dict:
    """run() -> (total seconds, first-token seconds, row-0 tokens); the best of `repeats` timed runs.

    `warm` (default: `run`) runs first: compiles, captures graphs, fills the allocator's caches.
    """
    (warm or run)()
    best = None
    for _ in range(repeats):
        sync()
        total, first, tokens = run()
        if best is None or total < best[0]:
            best = (total, first, tokens)
    total, first, tokens = best
    return {
        "name": name, "batch": batch, "new_tokens": new, "total_s": total, "first_token_ms": first * 1e3,
        "tokens_per_s": batch * new / total, "decode_tokens_per_s": batch * (new - 1) / (total - first),
        "tokens_row0": tokens[:32],
    }


class Report:
    """The JSON report, rewritten to `out` after every row (a run cut short keeps its rows)."""

    def __init__(self, out: Path, header: dict[str, Any]) -> None:
        self.out, self.data = out, {**header, "results": []}
        self.write()

    @property
    def results(self) -> list[dict]:
        return self.data["results"]

    def add(self, row: dict) -> None:
        self.results.append(row)
        shown = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items() if k != "tokens_row0"}
        print(json.dumps(shown), flush=True)
        self.write()

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.data, indent=1))


def guarded(report: Report, name: str, batch: int, fn: Callable[[], dict]) -> None:
    """Run one variant; a failure becomes an error row and the run goes on."""
    start = time.perf_counter()
    try:
        row = fn()
    except Exception as exc:  # noqa: BLE001 - a benchmark harness records the failure and measures the rest
        row = {"name": name, "batch": batch, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    row["wall_s"] = round(time.perf_counter() - start, 1)
    report.add(row)


def prompts(batch: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(100, vocab - 100, (batch, length), generator=torch.Generator().manual_seed(batch))


# --- Hugging Face -------------------------------------------------------------------------------


class _FirstTokenClock:
    """A `generate` streamer that notes when the first new token reaches the host."""

    def __init__(self) -> None:
        self.calls, self.first = 0, None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def hf_runner(model, ids: torch.Tensor, new: int, **kw: Any) -> Callable[[], tuple[float, float, list[int]]]:
    """One `generate` call per run; its streamer times the first token (no second call, so a
    static cache keeps one shape and compiles once)."""
    ids = ids.to(model.device)
    mask = torch.ones_like(ids)

    def run() -> tuple[float, float, list[int]]:
        clock = _FirstTokenClock()
        sync()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=0, streamer=clock, **kw)
        sync()
        end = time.perf_counter()
        return end - start, (clock.first or end) - start, out[0, ids.shape[1] :].tolist()

    return run


# --- Kestrel --------------------------------------------------------------------------------------


def kestrel_runner(gen, ids: torch.Tensor, new: int, adapter: str | None = None):
    rows = ids.tolist()

    def run() -> tuple[float, float, list[int]]:
        sync()
        out = gen.generate(rows, max_new_tokens=new, adapter=adapter)
        sync()
        return out.total_s, out.first_token_s, out.tokens[0]

    return run


def allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def measure_kestrel(report: Report, model, name: str, batches: list[tuple[int, torch.Tensor]], new: int,
                    context: int, adapter: str | None = None, fuse: bool | None = None,
                    profile: Path | None = None) -> None:
    """One generator on `model`, measured at each (batch, ids); closed afterwards (weights unfused).

    `profile`: a folder; batch 1 then also gets a per-token kernel table (`profile_kernels`)."""
    from kestrel.decode import Generator

    held: dict[str, Any] = {}

    def one(batch: int, ids: torch.Tensor) -> dict:
        if "gen" not in held:
            before = allocated()
            held["gen"] = Generator(model, stop_ids=[], max_seq_len=2 * context, fuse=fuse)
            held["added"] = (allocated() - before) / 1e9
        gen = held["gen"]
        row = measure(name, batch, new, kestrel_runner(gen, ids, new, adapter), 3)
        fused = getattr(gen.backend, "fused_groups", 0)
        row = {**row, "fused_groups": fused, "generator_added_GB": held["added"], "compiled": gen.compile}
        if profile is not None and batch == 1:
            row["profile_top"] = profile_kernels(gen, ids, adapter, profile / f"profile_{name}.txt")
        return row

    for batch, ids in batches:
        guarded(report, name, batch, lambda batch=batch, ids=ids: one(batch, ids))
    if "gen" in held:
        held["gen"].close()
    held.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def profile_kernels(gen, ids: torch.Tensor, adapter: str | None, out: Path, new: int = 64) -> list[str]:
    """Kernel time per decode token by kernel name (graph replays included), from one request of
    `new` tokens; the whole table goes to `out`, the top 12 lines are returned."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return ["no CUDA: nothing profiled"]
    gen.generate(ids.tolist(), max_new_tokens=new, adapter=adapter)  # same session: no capture inside
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gen.generate(ids.tolist(), max_new_tokens=new, adapter=adapter)
        sync()
    rows = sorted(((e.device_time_total / new, e.count / new, e.key) for e in prof.key_averages()
                   if e.device_time_total > 0), reverse=True)
    total = sum(r[0] for r in rows)
    lines = [f"{us:9.1f} us/token {calls:7.1f} calls/token  {key[:110]}" for us, calls, key in rows]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"kernel time {total:.1f} us/token (prefill included, over {new} tokens)\n" + "\n".join(lines))
    return [f"total {total:.1f} us/token"] + lines[:12]


def attach_lora(model, rank: int = 16):
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL_LINEARS, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 1e-3)  # non-zero: the update is really computed and added
    return peft.eval()


def quantize_nf4(model) -> torch.nn.Module:
    """Replace every linear but lm_head by a bitsandbytes NF4 Linear4bit (double quant, bf16 compute)."""
    import bitsandbytes as bnb

    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or child_name == "lm_head":
                continue
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                                  device="meta")
            q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=True,
                                         quant_type="nf4").to(child.weight.device)
            setattr(parent, child_name, q)
            del child
    gc.collect()
    torch.cuda.empty_cache()
    return model


# --- the run --------------------------------------------------------------------------------------


def run_hf(report: Report, model, ids1: torch.Tensor, ids_b: torch.Tensor, batch: int, new: int) -> None:
    """HF `generate`: dynamic cache at batch 1 and `batch`; static cache + compile at batch 1 (CUDA)."""
    for b, ids in ((1, ids1), (batch, ids_b)):  # nothing to compile: a short warm-up
        guarded(report, "hf_dynamic", b, lambda b=b, ids=ids: measure(
            "hf_dynamic", b, new, hf_runner(model, ids, new), 1, hf_runner(model, ids, 8)))
    if torch.cuda.is_available():
        guarded(report, "hf_static_compile", 1, lambda: measure(
            "hf_static_compile", 1, new, hf_runner(model, ids1, new, cache_implementation="static"), 2))
    torch._dynamo.reset()


def run_main(args: argparse.Namespace) -> Report:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    child = run_unsloth_child(args) if args.baseline == "unsloth" else None  # before we take the GPU
    bandwidth = copy_bandwidth(device)
    model = build_model(args.smoke, device)
    model.generation_config.eos_token_id = None  # every variant generates the full budget
    vocab, new, plen = model.config.vocab_size, args.new_tokens, args.prompt_len
    context = plen + new
    b1 = bytes_per_step(model, 1, context // 2)  # the KV read grows over the run: its mean
    report = Report(args.out, {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "copy_bandwidth_GBps": bandwidth / 1e9, "bytes_per_token_b1_GB": b1 / 1e9,
        "bound_tokens_per_s_b1": bandwidth / b1, "prompt_len": plen, "new_tokens": new,
        "command": " ".join(sys.argv),
    })
    print(json.dumps({k: v for k, v in report.data.items() if k != "results"}), flush=True)
    if child is not None:
        report.data["unsloth"] = child.get("unsloth", "?")
        for row in child.get("results") or [{"name": "unsloth_inference", "batch": 1, "error": "no rows"}]:
            report.add(row)
    ids1, ids_b = prompts(1, plen, vocab), prompts(args.batch, plen, vocab)
    both = [(1, ids1), (args.batch, ids_b)]
    if not args.skip_hf:
        run_hf(report, model, ids1, ids_b, args.batch, new)
    if args.no_triton:  # every product through cuBLAS (the session-2 path), the rest as always
        torch._dynamo.reset()  # compiled code does not guard on the environment
        with mock.patch.dict(os.environ, {"KESTREL_KERNELS": "torch"}):
            measure_kestrel(report, model, "kestrel_cublas", both[:1], new, context, profile=args.profile)
        torch._dynamo.reset()
    measure_kestrel(report, model, "kestrel", both, new, context, profile=args.profile)
    if args.pdl_ablation:  # the same step without programmatic dependent launches, batch 1
        with mock.patch.dict(os.environ, {"KESTREL_PDL": "0"}):
            measure_kestrel(report, model, "kestrel_no_pdl", both[:1], new, context)
    if not args.skip_separate:
        measure_kestrel(report, model, "kestrel_separate", both[:1], new, context, fuse=False)
    if not args.skip_lora:
        model = attach_lora(model)
        measure_kestrel(report, model, "kestrel_lora_r16", both, new, context, adapter="default", profile=args.profile)
        if args.pdl_ablation:
            with mock.patch.dict(os.environ, {"KESTREL_PDL": "0"}):
                measure_kestrel(report, model, "kestrel_lora_r16_no_pdl", both[:1], new, context, adapter="default")
        if not args.skip_separate:
            measure_kestrel(report, model, "kestrel_lora_r16_separate", both[:1], new, context, "default", False)
        model = model.unload()  # drop the LoRA layers, keep the base
    if device.type == "cuda" and not args.skip_nf4:
        torch._dynamo.reset()
        try:
            model = quantize_nf4(model)
        except Exception as exc:  # noqa: BLE001 - bitsandbytes missing or broken: an error row, the report survives
            report.add({"name": "kestrel_nf4", "batch": 1, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        else:
            measure_kestrel(report, model, "kestrel_nf4", both, new, context)
    summarize(report.data)
    return report


def run_unsloth_child(args: argparse.Namespace) -> dict:
    """This script with `--only unsloth` in its own process, the anchors first on PYTHONPATH.

    Returns the child's report; on a crash or a timeout, the rows it had written plus an error.
    """
    out = Path(tempfile.gettempdir()) / f"kestrel-decode-unsloth-{time.time_ns()}.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--only", "unsloth", "--out", str(out),
            "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--batch", str(args.batch)]
    argv += (["--smoke"] if args.smoke else []) + (["--tmp", args.tmp] if args.tmp else [])
    env = {"HF_HUB_OFFLINE": "1", "UNSLOTH_DISABLE_STATISTICS": "1", **os.environ,
           "PYTHONPATH": os.pathsep.join(p for p in (args.anchors, os.environ.get("PYTHONPATH")) if p)}
    print(f"unsloth baseline in its own process (PYTHONPATH starts with {args.anchors}) ...", flush=True)
    error = None
    try:
        proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=args.child_timeout, check=False)
        if proc.returncode != 0:
            error = f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"
    except subprocess.TimeoutExpired:
        error = f"timed out after {args.child_timeout} s"
    child = json.loads(out.read_text()) if out.is_file() else {}
    out.unlink(missing_ok=True)
    if error is not None:
        child.setdefault("results", []).append({"name": "unsloth_inference", "batch": 0, "error": error})
    return child


def run_unsloth(args: argparse.Namespace) -> Report:
    """Unsloth's inference mode on the same random-init model, saved to a temporary folder."""
    import unsloth  # must come before transformers
    from transformers import AutoTokenizer
    from unsloth import FastLanguageModel

    device = torch.device("cuda")
    report = Report(args.out, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "command": " ".join(sys.argv), "unsloth": getattr(unsloth, "__version__", "?")})
    with tempfile.TemporaryDirectory(dir=args.tmp) as folder:
        build_model(args.smoke, device).save_pretrained(folder)
        # Unsloth loads a tokenizer beside the weights; ids are fed directly, so the demo one does.
        AutoTokenizer.from_pretrained(ROOT / "assets" / "demo").save_pretrained(folder)
        gc.collect()
        torch.cuda.empty_cache()
        model, _ = FastLanguageModel.from_pretrained(folder, max_seq_length=2 * (args.prompt_len + args.new_tokens),
                                                     dtype=torch.bfloat16, load_in_4bit=False)
    FastLanguageModel.for_inference(model)
    model.generation_config.eos_token_id = None
    vocab, new = model.config.vocab_size, args.new_tokens
    for batch in (1, args.batch):
        ids = prompts(batch, args.prompt_len, vocab)
        run, warm = hf_runner(model, ids, new), hf_runner(model, ids, 8)
        guarded(report, "unsloth_inference", batch,
                lambda batch=batch, run=run, warm=warm: measure("unsloth_inference", batch, new, run, 1, warm))
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="where the JSON report goes")
    p.add_argument("--baseline", choices=["unsloth"], help="also measure this baseline, in its own process")
    p.add_argument("--only", choices=["unsloth"], help="measure only this baseline, in this process (the child)")
    p.add_argument("--anchors", default=str(ROOT / ".gpu-anchors"), help="baseline packages for the child")
    p.add_argument("--child-timeout", type=int, default=480, help="seconds the baseline process may take")
    p.add_argument("--smoke", action="store_true", help="a tiny Llama instead of the 8B shape (checks the script)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="the rollout batch size (besides batch 1)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-separate", action="store_true", help="skip the fuse=False comparison rows")
    p.add_argument("--skip-lora", action="store_true")
    p.add_argument("--pdl-ablation", action="store_true",
                   help="also measure batch 1 with KESTREL_PDL=0 (no programmatic dependent launch)")
    p.add_argument("--skip-nf4", action="store_true")
    p.add_argument("--tmp", default=None, help="folder for Unsloth's temporary checkpoint (16 GB)")
    p.add_argument("--no-triton", action="store_true",
                   help="also measure batch 1 with cuBLAS products (KESTREL_KERNELS=torch), the previous path")
    p.add_argument("--profile", type=Path, default=None, help="folder for per-token kernel tables (batch 1)")
    args = p.parse_args()
    start = time.perf_counter()
    report = run_unsloth(args) if args.only == "unsloth" else run_main(args)
    report.data["wall_s"] = round(time.perf_counter() - start, 1)
    report.write()
    print(f"wrote {args.out} in {report.data['wall_s']} s")


if __name__ == "__main__":
    main()
