"""Every Triton kernel must survive `torch.compile`, which rebuilds a user kernel from its source
(the rules: tests/support/kernel_closure.py). The NF4 decode step fell back to eager on the GPU
because a helper was called through its module; these tests fail on that and its relatives."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import triton

import kestrel.kernels.nf4 as nf4_module
from tests.support.kernel_closure import closure_problems, kernels, name


def test_every_kernel_rebuilds_under_this_torch():
    """Compiled (not interpreted) kernels, walked and written by this torch's inductor, in a process
    of its own: Triton reads TRITON_INTERPRET once, at import."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.support.kernel_closure"], capture_output=True, text=True,
                         env=env, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert {"kestrel.kernels.decode.nf4_gemv._nf4_gemv_kernel", "kestrel.kernels.decode.expert_gemv._expert_gemv_kernel",
            "kestrel.kernels.rms_norm._rms_norm_fwd_kernel"} <= set(report), sorted(report)
    assert len(report) >= 20
    assert {k: v for k, v in report.items() if v} == {}


def test_kernels_here_pass_the_walk_too():
    """The same walk in this (interpreted) process, so a failure names its kernel without a subprocess."""
    found = kernels()
    assert len(found) >= 20
    assert {name(k): p for k in found if (p := closure_problems(k))} == {}


@triton.jit
def _through_module(x):
    return nf4_module.decode_bytes(x, x)


def test_the_walk_catches_a_helper_called_through_its_module():
    """The pattern that broke the NF4 decode step's compile (a module attribute) is named."""
    problems = closure_problems(_through_module)
    assert len(problems) == 1 and "through module `nf4_module`" in problems[0]
