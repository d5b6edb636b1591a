"""One run on several devices, on the CPU: `devices: 2` runs two processes over gloo through the
same code path as GPUs (NCCL). Two ranks with grad_accum k must train exactly as one process
with grad_accum 2k (same micro-batches, same loss normalisation): LoRA data parallel and a full
fine-tune sharded with FSDP2. A cancel stops both ranks at one step and the run resumes from its
checkpoint; a rank that dies fails the run with a message naming it, and leaves no process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from kestrel.config import config_from_dict
from kestrel.errors import ConfigError
from kestrel.jobs.preflight import check_devices
from kestrel.training.distributed import plan_devices
from kestrel.training.metrics import Callback
from kestrel.training.run import run

ROOT = Path(__file__).resolve().parents[2]


def _cfg(model: Path, out: Path, **kw) -> dict:
    base = dict(model=str(model), dataset="arithmetic_chat", output_dir=str(out), max_seq_length=64, batch_size=2,
                max_steps=4, learning_rate=1e-3, save_steps=0, seed=0, dtype="fp32", lr_scheduler="constant",
                gradient_checkpointing="standard")
    return {**base, **kw}


def _steps(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "loss" in m]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    folder = out / "adapter" if (out / "adapter").is_dir() else out / "model"
    files = sorted(folder.glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def _rank_processes(config_path: Path) -> list[int]:
    """pids of `kestrel.training.rank` processes started for `config_path`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kestrel.training.rank" in cmd and str(config_path).encode() in cmd:
            found.append(int(proc.name))
    return found


def assert_ranks_ended_as_one(one: Path, two: Path, atol: float = 1e-6) -> None:
    """The 2-rank run's weights (in folder `two`) equal the one-process run's (in `one`), rank 1
    logged no traceback, and no rank process of the 2-rank run is left."""
    wa, wb = _weights(one), _weights(two)
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=atol)
    run_dir = two.parent if two.name == "best" else two
    assert (run_dir / "rank-1.log").is_file()
    assert not (run_dir / "rank-1.log").read_text().count("Traceback")
    assert not _rank_processes(run_dir / "config.yaml")


@pytest.mark.parametrize("method", ["lora", "full"])
def test_two_ranks_train_as_one_process_with_twice_the_accumulation(method, tiny_model_dir, tmp_path) -> None:
    model = tiny_model_dir("llama")
    one = run(config_from_dict(_cfg(model, tmp_path / "one", method=method, grad_accum=2)))
    two = run(config_from_dict(_cfg(model, tmp_path / "two", method=method, grad_accum=1, devices=2)))
    assert one.status == two.status == "completed", (one.error, two.error)
    a, b = _steps(tmp_path / "one"), _steps(tmp_path / "two")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
    assert_ranks_ended_as_one(tmp_path / "one", tmp_path / "two")


class CancelAt(Callback):
    def __init__(self, step: int) -> None:
        self.step, self.seen = step, 0

    def on_step(self, metrics: dict[str, float]) -> None:
        self.seen = int(metrics["step"])

    def should_stop(self):
        return "cancel" if self.seen >= self.step else None


def test_cancel_stops_every_rank_and_the_run_resumes(tiny_model_dir, tmp_path) -> None:
    model = tiny_model_dir("llama")
    straight = run(config_from_dict(_cfg(model, tmp_path / "straight", devices=2)))
    stopped = run(config_from_dict(_cfg(model, tmp_path / "resumed", devices=2)), [CancelAt(2)])
    assert straight.status == "completed" and stopped.status == "cancelled", (straight.error, stopped.error)
    assert stopped.step == 2 and (tmp_path / "resumed" / "checkpoints" / "step-000002").is_dir()
    assert not _rank_processes(tmp_path / "resumed" / "config.yaml")
    resumed = run(config_from_dict(_cfg(model, tmp_path / "resumed", devices=2)))
    assert resumed.status == "completed", resumed.error
    after = {m["step"]: m["loss"] for m in _steps(tmp_path / "resumed")}
    for m in _steps(tmp_path / "straight"):
        assert after[m["step"]] == pytest.approx(m["loss"], rel=1e-5)


def test_a_rank_that_dies_fails_the_run_with_its_name(tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "run"
    config = _cfg(tiny_model_dir("llama"), out, devices=2, max_steps=100_000, save_steps=0)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cli = subprocess.Popen([sys.executable, "-m", "kestrel", "train", str(tmp_path / "run.yaml")], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (out / "metrics.jsonl").is_file():
            time.sleep(0.5)
        ranks = _rank_processes(out / "config.yaml")
        assert ranks, "rank 1 never started"
        os.kill(ranks[0], signal.SIGKILL)
        output = cli.communicate(timeout=120)[0].decode(errors="replace")
    finally:
        cli.kill()
    assert cli.returncode != 0
    assert "rank 1 (on cpu) was killed by SIGKILL" in output, output[-2000:]
    assert not _rank_processes(out / "config.yaml")


def test_devices_plan() -> None:
    assert plan_devices(1, 0) == ["cpu"] and plan_devices("auto", 0) == ["cpu"]
    assert plan_devices(3, 0) == ["cpu"] * 3
    assert plan_devices("auto", 4) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert plan_devices(2, 4) == ["cuda:0", "cuda:1"] and plan_devices([3, 1], 4) == ["cuda:3", "cuda:1"]
    with pytest.raises(ConfigError, match="more GPUs than the 2 visible"):
        plan_devices(3, 2)
    with pytest.raises(ConfigError, match="only GPUs 0..1"):
        plan_devices([0, 2], 2)
    with pytest.raises(ConfigError, match="no GPU"):
        plan_devices([0], 0)


@pytest.mark.parametrize("value, message", [
    (0, "devices must be 1..64"), ("two", "devices must be auto"), ([0, 0], "lists a GPU twice"),
    ([-1], "GPU id must be"), ([], "devices must list"), (True, "devices must be 1..64"),
])
def test_devices_config_is_checked(value, message) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"devices": value})


def test_every_method_and_evaluation_run_on_several_devices() -> None:
    for method in ("dpo", "orpo", "kto", "simpo"):
        assert config_from_dict({"devices": 2, "method": method, "preference": {"finetune": "full"}}).devices == 2
    assert config_from_dict({"devices": [0, 3], "method": "grpo"}).devices == [0, 3]
    assert config_from_dict({"devices": [0, 1], "eval_split": 0.1}).devices == [0, 1]


def test_submit_checks_devices_against_the_queue() -> None:
    gpus = ["cuda:0", "cuda:1"]
    check_devices(2, None, gpus)
    check_devices(4, None, ["cpu"])  # four CPU processes
    with pytest.raises(ConfigError, match="more GPUs than the 2"):
        check_devices(3, None, gpus)
    with pytest.raises(ConfigError, match="GPU 5"):
        check_devices([0, 5], None, gpus)
    with pytest.raises(ConfigError, match="leave the device out"):
        check_devices(2, "cuda:0", gpus)


def test_rank_zero_gets_its_cpu_threads_back(tiny_model_dir, tmp_path) -> None:
    """Rank 0 runs in the caller's process (the CLI, a test): after the run it has its threads back."""
    before = torch.get_num_threads()
    result = run(config_from_dict(_cfg(tiny_model_dir("llama"), tmp_path / "run", devices=2, max_steps=1)))
    assert result.status == "completed", result.error
    assert torch.get_num_threads() == before
