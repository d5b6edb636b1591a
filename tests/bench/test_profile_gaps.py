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


def test_elementwise_and_copy_kernels_are_told_by_the_op_and_frames_that_launched_them() -> None:
    """Two strided copies launched from one line of ours and an elementwise multiply from another:
    each kernel's time goes to its own launching op and frame, whatever the kernel's cut name."""
    def kernel(ts: float, dur: float, corr: int, name: str) -> dict:
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    def launch(ts: float, corr: int) -> dict:
        return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "tid": 7,
                "args": {"correlation": corr}}

    copy = "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy"
    events = [
        kernel(1000, 300, 1, copy), kernel(1300, 200, 2, copy), kernel(1500, 50, 3, "void at::native::vectorized_mul"),
        kernel(1550, 400, 4, "nvjet_gemm"),
        launch(10, 1), launch(20, 2), launch(110, 3), launch(120, 4),
        {"cat": "python_function", "name": "/x/kestrel/model/linear_attention.py(350): linear_attention_forward",
         "ts": 0, "dur": 100, "tid": 7},
        {"cat": "cpu_op", "name": "aten::contiguous", "ts": 5, "dur": 30, "tid": 7},
        {"cat": "python_function", "name": "/x/kestrel/model/linear_attention.py(360): linear_attention_forward",
         "ts": 100, "dur": 50, "tid": 7},
        {"cat": "cpu_op", "name": "aten::mul", "ts": 105, "dur": 10, "tid": 7},
    ]
    report = analyse({"traceEvents": events}, steps=1).splitlines()
    head = next(i for i, line in enumerate(report) if line.startswith("other and copy kernels by"))
    table = report[head + 1:head + 3]
    assert "0.50" in table[0] and "aten::contiguous in model/linear_attention.py(350)" in table[0]
    assert "2.0" in table[0]  # launches per step
    assert "0.05" in table[1] and "aten::mul in model/linear_attention.py(360)" in table[1]
    assert not any("nvjet" in line or "aten::mm" in line for line in report[head:head + 4])


def test_a_kernel_launched_through_the_driver_is_tritons_whatever_its_name() -> None:
    """flash-linear-attention's `chunk_fwd_kernel_o` matches no name pattern; Triton launches it with
    cuLaunchKernel (a "cuda_driver" event), so it counts as Triton, not among PyTorch's elementwise
    kernels, while an unnamed kernel launched through the runtime stays "other"."""
    events = [
        {"cat": "kernel", "name": "chunk_fwd_kernel_o", "ts": 100, "dur": 300, "args": {"correlation": 1}},
        {"cat": "kernel", "name": "void at::native::vectorized_mul", "ts": 400, "dur": 100, "args": {"correlation": 2}},
        {"cat": "cuda_driver", "name": "cuLaunchKernel", "ts": 10, "dur": 2, "tid": 7, "args": {"correlation": 1}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 20, "dur": 2, "tid": 7, "args": {"correlation": 2}},
        {"cat": "cpu_op", "name": "aten::mul", "ts": 15, "dur": 10, "tid": 7},
    ]
    report = analyse({"traceEvents": events}, steps=1).splitlines()
    kinds = {line.split()[0]: line.split()[1] for line in report if line.startswith("  ") and " ms " in line}
    assert kinds == {"triton": "0.30", "other": "0.10"}
    head = next(i for i, line in enumerate(report) if line.startswith("other and copy kernels by"))
    table = [line for line in report[head + 1:] if line.startswith("  ")][:2]
    assert len(table) == 1 and "0.10" in table[0] and "aten::mul" in table[0]  # the Triton kernel is not here


def test_the_longest_gaps_say_where_in_the_step_they_fell_beside_the_loss() -> None:
    """Two steps of 1,000 us each: a 300 us gap right after each step's loss kernel (a backward waiting for the
    top layer's pages) and a 50 us gap early on; the longest comes first, at its offset into its step."""
    def kernel(ts: float, dur: float, corr: int, name: str = "nvjet_gemm") -> dict:
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    events = []
    for step in range(2):
        t0 = step * 1000
        events += [kernel(t0, 100, 10 * step + 1), kernel(t0 + 150, 250, 10 * step + 2),  # a 50 us gap at 100
                   kernel(t0 + 400, 100, 10 * step + 3, "_ce_chunk_kernel"),  # the loss at 400
                   kernel(t0 + 800, 200, 10 * step + 4)]  # a 300 us gap at 500
        events.append({"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t0 + 790, "dur": 2, "tid": 7,
                       "args": {"correlation": 10 * step + 4}})
        events.append({"cat": "cpu_op", "name": "aten::copy_", "ts": t0 + 785, "dur": 10, "tid": 7})
    report = analyse({"traceEvents": events}, steps=2).splitlines()
    head = next(i for i, line in enumerate(report) if line.startswith("longest idle gaps"))
    assert "0.4 ms, 0.4 ms into each step" in report[head]
    rows = [line.split() for line in report[head + 1:head + 5]]
    assert rows[0][:2] == ["300", "0.5"] and "aten::copy_" in rows[0][2] and rows[1][:2] == ["300", "0.5"]
    assert rows[2][:2] == ["50", "0.1"]


def test_the_hosts_waits_are_told_by_the_call_and_the_frames_that_made_them() -> None:
    """A stream synchronize under `.cpu()` in a line of ours is reported with its time; an asynchronous copy is not."""
    events = [
        {"cat": "kernel", "name": "nvjet_gemm", "ts": 0, "dur": 100, "args": {"correlation": 1}},
        {"cat": "python_function", "name": "/x/kestrel/model/attention.py(140): segment_starts", "ts": 10, "dur": 400,
         "tid": 7},
        {"cat": "cpu_op", "name": "aten::_to_copy", "ts": 20, "dur": 300, "tid": 7},
        {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 30, "dur": 5, "tid": 7, "args": {"correlation": 9}},
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 40, "dur": 250, "tid": 7, "args": {}},
    ]
    report = analyse({"traceEvents": events}, steps=1)
    waits = report[report.index("host waits for the GPU"):].split("\n\n")[0].splitlines()
    assert len(waits) == 2  # the heading and the one wait
    assert "0.25" in waits[1] and "cudaStreamSynchronize: aten::_to_copy in model/attention.py(140): segment_starts" in waits[1]
    quiet = analyse({"traceEvents": events[:1]}, steps=1)
    assert "host waits for the GPU by call, op and our frames (ms/step, count/step); none" in quiet


def test_time_with_only_host_copies_running_is_told_apart_from_busy_time() -> None:
    """A copy back the compute stream waits for (100-250 us, nothing else running) counts as busy in the
    union but as compute idle here, told by what launched the kernel after it; a copy out that compute
    overlaps (500-600 us) counts nowhere."""
    def kernel(ts: float, dur: float, corr: int, name: str = "nvjet_gemm", cat: str = "kernel") -> dict:
        return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    events = [
        kernel(0, 100, 1), kernel(100, 200, 2, "Memcpy HtoD (Pinned -> Device)", "gpu_memcpy"), kernel(250, 150, 3),
        kernel(450, 200, 4), kernel(500, 100, 5, "Memcpy DtoH (Device -> Pinned)", "gpu_memcpy"),
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 90, "dur": 5, "tid": 7, "args": {"correlation": 3}},
        {"cat": "python_function", "name": "/x/kestrel/recompute/checkpoint.py(316): backward", "ts": 80,
         "dur": 40, "tid": 7},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 88, "dur": 10, "tid": 7},
    ]
    report = analyse({"traceEvents": events}, steps=1).splitlines()
    head = next(i for i, line in enumerate(report) if line.startswith("compute idle while only host copies run"))
    assert "0.15 ms a step" in report[head]
    assert report[head + 1].split()[:2] == ["150", "0.1"]  # 150 us, starting 0.1 ms into the step
    assert "aten::mm in recompute/checkpoint.py(316): backward" in report[head + 1]
    assert report[head + 2] == ""  # one interval: the overlapped copy out is not one
