"""The profile's idle-gap report names the op and the frames of ours that launched the kernel
after each gap (`bench.profile_train.analyse`), from a synthetic Chrome trace."""

from __future__ import annotations

from bench.profile_train import analyse


def test_a_gap_is_told_by_the_launching_op_and_our_frames() -> None:
    def kernel(ts: float, dur: float, corr: int) -> dict:
        return {"cat": "kernel", "name": "nvjet_gemm", "ts": ts, "dur": dur, "args": {"correlation": corr}}

    events = [
        kernel(0, 100, 1), kernel(600, 100, 2),  # a 500 us gap before the second kernel
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 590, "dur": 5, "tid": 7, "args": {"correlation": 2}},
        {"cat": "python_function", "name": "/x/kestrel/training/preference/score.py(80): micro_loss", "ts": 100,
         "dur": 600, "tid": 7},
        {"cat": "python_function", "name": "/x/kestrel/model/attention.py(170): samples_from_starts", "ts": 120,
         "dur": 480, "tid": 7},
        {"cat": "python_function", "name": "/x/torch/nn/modules/module.py(1): _call_impl", "ts": 580, "dur": 20, "tid": 7},
        {"cat": "cpu_op", "name": "aten::copy_", "ts": 585, "dur": 10, "tid": 7},
    ]
    report = analyse({"traceEvents": events}, steps=1)
    gap_line = next(line for line in report.splitlines() if "aten::copy_" in line)
    assert "0.50" in gap_line  # ms per step
    assert "model/attention.py(170): samples_from_starts < training/preference/score.py(80): micro_loss" in gap_line
