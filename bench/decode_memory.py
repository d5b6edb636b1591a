"""What the end-of-run generation check costs a QLoRA run: its time (first run, with the decode
path's compilation and capture, then a second run) and the GPU memory it allocates beyond what
the run already holds, with the whole Python stack of each large block (issue 27).

    python bench/decode_memory.py --layers 4 --prompts 6 --prompt-len 64 --new 256 --out $OUT/decode-mem.txt
    python bench/decode_memory.py --layers 0 --prompts 8 --prompt-len 512 --profile $OUT/prof.txt --out $OUT/m.txt
    python bench/decode_memory.py --layers 0 --prompts 8 --prompt-len 512 --compile --out $OUT/m-compiled.txt

`--compile` gives the check a compiled generator (what it made before it decoded uncompiled), to
compare in a process of its own; `--profile` runs the check once more under the profiler and writes
the decode's kernel time by kind per step (`bench/profile_train.py`'s report).

The model is the Llama-3.1-8B shape (`--layers` decoder layers: the vocabulary and the head are
full size, which is what a per-model cost would show), loaded in NF4 with a LoRA adapter on all
seven projections, as a QLoRA run holds it; the prompts are random token ids.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import TARGETS, llama8b_dir  # noqa: E402
from bench.memory_peak import peak_report, peak_stacks  # noqa: E402


def _model(layers: int):
    from peft import LoraConfig, get_peft_model

    from kestrel.model.loader import load

    model, tok = load(str(llama8b_dir(layers=layers or None)), 2048, load_in_4bit=True, dtype="bf16")
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules=TARGETS)), tok


def _check(args: argparse.Namespace, vocab: int):
    from kestrel.training.generation_check import GenerationCase, GenerationCheck

    g = torch.Generator().manual_seed(0)
    cases = [GenerationCase(torch.randint(100, vocab - 100, (args.prompt_len,), generator=g).tolist(), "", "", i)
             for i in range(args.prompts)]
    return GenerationCheck(cases, args.new)


def _profile(check, model, tok, out_dir: Path, steps: int, path: Path) -> None:
    """One more check under the profiler: kernel time by kind over its `steps` decode steps."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from bench.profile_train import analyse

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        check.run(model, tok, out_dir, 0)
        torch.cuda.synchronize()
    trace = Path(tempfile.mktemp(suffix=".json"))
    prof.export_chrome_trace(str(trace))
    path.write_text(f"generation check, {steps} decode steps (prefill and capture included in the totals)\n"
                    + analyse(json.loads(trace.read_text()), steps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers; 0: all 32")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=256, help="tokens each answer may run to (the check's max_new_tokens)")
    ap.add_argument("--compile", action="store_true", help="give the check a compiled generator (to compare)")
    ap.add_argument("--profile", default="", help="also profile one more check; write its kernel report here")
    ap.add_argument("--min-mib", type=float, default=32.0, help="blocks at least this large get their stacks")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model, tok = _model(args.layers)
    check = _check(args, model.config.vocab_size)
    out_dir = Path(args.out).parent
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    times = []
    for _ in range(2):  # the first compiles and captures, the second finds them (a later run's case)
        t0 = time.perf_counter()
        if args.compile and check.generator is None:  # inside the first timing, as the check makes its own
            from kestrel.decode.generate import Generator

            # A generator handed to the check is used as is (and only released): compiled, as before
            check.generator = Generator(model, tok, max_seq_len=args.prompt_len + args.new, compile=True)
        check.run(model, tok, out_dir, 0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    summary = {"held_before_gib": held / 2**30, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
               "added_gib": (torch.cuda.max_memory_allocated() - held) / 2**30, "run_s": times,
               "prompts": args.prompts, "prompt_len": args.prompt_len, "new": args.new, "layers": args.layers,
               "compile": args.compile,
               "device": torch.cuda.get_device_name()}
    text = [json.dumps(summary), peak_report(trace, top=20), "large blocks at the peak, with their stacks:",
            peak_stacks(trace, int(args.min_mib * 2**20))]
    Path(args.out).write_text("\n".join(text) + "\n")
    print(json.dumps(summary), flush=True)
    if args.profile:
        _profile(check, model, tok, out_dir, args.new, Path(args.profile))


if __name__ == "__main__":
    main()
