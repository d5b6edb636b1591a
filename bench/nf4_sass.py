"""What the NF4 decode GEMV's hot loop costs per weight on an H100/H200, read from its machine code
(no GPU needed: Triton's NVIDIA backend compiles for sm_90 here and its bundled cuobjdump
disassembles the cubin).

    python bench/nf4_sass.py                                   # the measured plans' tiles, 8B shapes
    python bench/nf4_sass.py --shape gate_up --rows 1 --variants --out /tmp/sass.json

The products decode every weight in registers, so their instructions cap their speed: an H100 or
H200 SM issues at most one warp instruction per scheduler per cycle (4 x 32 thread instructions),
so a loop whose threads issue I instructions a weight runs at most at 128 x clock x SMs / I weights
a second. This reports I for the innermost loop (one tile step: BLOCK_N x BLOCK_K weights over
32 x warps threads) with its mix, and the registers, shared memory and spills that set how many
programs an SM holds. The cap is an upper bound: stalls on memory and on dependencies are not in
the count, so this ranks candidates before the device times them (`bench/nf4_gemv_sweep.py`) and
says what a change removes; it does not replace timing.

The kernel is compiled as a launch specializes it: pointers, N and the strides divisible by 16 (the
8B shapes' are), which decides whether loads are vectorized.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.nf4_gemv_sweep import SHAPES, variants  # noqa: E402
from kestrel.kernels.decode.nf4_tiles import PRMT, Tiles, measured_plan  # noqa: E402

PLAN_DEVICE = "NVIDIA H200"  # whose measured plans are read by default (the same sm_90 code as an H100's)
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);")


def compile_sm90(sizes: tuple[int, ...], k: int, t: Tiles, dtype: str = "bf16", bias: bool = False) -> Any:
    """`_nf4_gemv_kernel` for a weight of members `sizes` x K with tiles `t`, compiled for sm_90 and
    specialized as a launch is: pointers 16-byte aligned, the integers that are multiples of 16 marked so."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kestrel.kernels.decode import nf4_gemv

    kernel = nf4_gemv._nf4_gemv_kernel
    ptrs = {"X": dtype, "Y": dtype, "PART": "fp32", "TICKETS": "i32", **dict.fromkeys(("W0", "W1", "W2"), "u8"),
            **dict.fromkeys(("S0", "S1", "S2"), "fp32"), **dict.fromkeys(("B0", "B1", "B2"), dtype),
            "CODE": "fp32", "PAIRS": "i64"}
    n = sum(sizes)
    ints = {"N": n, "end0": sizes[0], "end1": sum(sizes[:2]), "stride_x": k, "stride_y": n}  # M: never specialized
    consts = dict(K=k, BS=64, MEMBERS=len(sizes), HAS_BIAS=bias, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                  BLOCK_K=t.block_k, SPLIT=t.split, LOOKUP=t.lookup, PREFETCH=t.prefetch, INTERPRETED=False,
                  PARTS=t.parts, STAGES=t.stages, GROUPS=t.groups)
    signature = ({k_: f"*{v}" for k_, v in ptrs.items()} | dict.fromkeys(("M", *ints), "i32")
                 | dict.fromkeys(consts, "constexpr"))
    names = kernel.arg_names
    aligned = [*ptrs, *(name for name, value in ints.items() if value % 16 == 0)]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    src = ASTSource(kernel, signature, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": t.warps, "num_stages": t.stages})


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def disassemble(cubin: bytes, workdir: Path) -> tuple[str, dict[str, int]]:
    """(SASS text, {REG, SHARED, LOCAL, STACK}) of a cubin, by Triton's bundled cuobjdump."""
    path = workdir / "kernel.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run([_tool("cuobjdump"), "--dump-sass", str(path)], capture_output=True, text=True, check=True)
    usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                           check=True).stdout
    res = {key: int(v) for key, v in re.findall(r"\b(REG|SHARED|LOCAL|STACK):(\d+)", usage)}
    return sass.stdout, res


def hot_loop(sass: str) -> collections.Counter:
    """The opcode mix (base names: FFMA, PRMT, ...) of the largest loop: the span from a backward
    branch's target to the branch. Empty when the code has no loop (a fully unrolled kernel)."""
    ins = [(int(a, 16), op, rest) for a, op, rest in _INSTR.findall(sass)]
    spans = []
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            spans.append((addr - int(target.group(1), 16), int(target.group(1), 16), addr))
    if not spans:
        return collections.Counter()
    _, lo, hi = max(spans)
    return collections.Counter(op.split(".")[0] for addr, op, _ in ins if lo <= addr <= hi)


def analyse(sizes: tuple[int, ...], k: int, t: Tiles, workdir: Path) -> dict[str, Any]:
    """Per weight: the hot loop's instructions issued by all threads of a program for one step,
    over the step's BLOCK_N x BLOCK_K weights; with the loop's mix and the kernel's resources."""
    compiled = compile_sm90(sizes, k, t)
    sass, res = disassemble(compiled.asm["cubin"], workdir)
    mix = hot_loop(sass)
    threads = 32 * t.warps
    # One step per loop iteration unless the compiler unrolled it: the one-row path's FFMAs say how many.
    per_step = t.block_n * t.block_k // threads  # values a thread decodes a step
    unroll = max(1, mix["FFMA"] // per_step) if t.block_m == 1 and mix["FFMA"] else 1
    total = sum(mix.values())
    return {"tiles": list(t), "registers": res.get("REG"), "shared_bytes": res.get("SHARED"),
            "spill_bytes": res.get("LOCAL", 0), "loop_instructions": total, "steps_per_loop": unroll,
            "instructions_per_weight": round(total * threads / (unroll * t.block_n * t.block_k), 3) if total else None,
            "mix": dict(mix.most_common(12))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=",".join(SHAPES))
    p.add_argument("--rows", default="1,8", help="row counts whose planned tiles to read (1, 2, 8, 16)")
    p.add_argument("--device", default=PLAN_DEVICE, help="whose measured plans to read")
    p.add_argument("--variants", action="store_true", help="also each tile's variants (the sweep's second phase)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    import tempfile

    report = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shape.split(","):
            sizes, k = SHAPES[name]
            plan = measured_plan(args.device, sum(sizes), k)
            for m in (int(r) for r in args.rows.split(",")):
                base = plan.for_rows(m) if plan else None
                if base is None:
                    print(f"{name} m={m}: no measured plan on {args.device}")
                    continue
                for t in variants(base._replace(lookup=PRMT)) if args.variants else [base]:
                    row = {"shape": name, "m": m, **analyse(sizes, k, t, Path(tmp))}
                    report.append(row)
                    print(f"{name:8s} m={m:2d} {tuple(t)}: {row['instructions_per_weight']} instr/weight, "
                          f"{row['registers']} regs, {row['shared_bytes']} B shared, {row['spill_bytes']} B spilled | "
                          + ", ".join(f"{op} {c}" for op, c in row["mix"].items()), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
