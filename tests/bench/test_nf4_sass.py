"""bench/nf4_sass.py: the hot-loop reader on a hand-written listing, and on the real kernel compiled for
sm_90 (no GPU): loading each block in two parts builds each PRMT block table once a thread, not twice."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import nf4_sass

ROOT = Path(__file__).resolve().parents[2]

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   FFMA R2, R3, R4, R2 ;
        /*0020*/              @P0 BRA 0x10 ;
        /*0030*/                   PRMT R5, R6, 0x7351, R7 ;
        /*0040*/              @!P1 LDG.E.128 R8, desc[UR6][R2.64] ;
        /*0050*/                   PRMT R9, R6, R7, R8 ;
        /*0060*/                   IMAD.U32 R9, R9, 0x10000, RZ ;
        /*0070*/              @P1 BRA 0x30 ;
        /*0080*/                   EXIT ;
"""


def test_hot_loop_is_the_largest_backward_branch_with_predicated_instructions_counted() -> None:
    mix = nf4_sass.hot_loop(LISTING)
    assert mix == {"PRMT": 2, "LDG": 1, "IMAD": 1, "BRA": 1}
    assert nf4_sass.hot_loop("        /*0000*/                   EXIT ;\n") == {}


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None, reason="no Triton NVIDIA backend")
def test_two_parts_build_each_block_table_once_per_thread() -> None:
    """The one-row PRMT tiles at K = 1024: a block's table is 16 fp32 multiplies (`nf4_lookup.table_program`);
    in one part a thread holds half of each of its blocks and builds every table, in two parts whole
    blocks and half as many tables. The FMAs (one a weight) are unchanged."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    code = ("import json, sys, tempfile, pathlib; from bench import nf4_sass as s; t = s.Tiles(1, 16, 256, 1, 2, "
            "lookup=s.PRMT, prefetch=True); d = pathlib.Path(tempfile.mkdtemp()); "
            "print(json.dumps([s.analyse((64,), 1024, t._replace(parts=p), d) for p in (1, 2)]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = __import__("json").loads(done.stdout.splitlines()[-1])
    values = 16 * 256 // 64  # a thread's weights a step
    assert one["mix"]["FFMA"] == two["mix"]["FFMA"] == values
    assert one["mix"]["FMUL"] == 2 * two["mix"]["FMUL"] == 16 * values // 32  # 16 a table: of 32 weights, then of 64
    assert two["instructions_per_weight"] < one["instructions_per_weight"]
    assert two["spill_bytes"] == 0
