"""A checkpoint or final-weights write that fails (a full disk, any writer's error) ends the run
`failed` with a message naming what failed, the checkpoint that is intact, the free space and the
space needed; the partial folder is gone; `.tmp` folders left by a kill are removed at the next
start. Faults are injected by replacing the writers (no root needed); one test fills a real tiny
tmpfs when unprivileged mounts are available."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors import SafetensorError

from kestrel.config import config_from_dict
from kestrel.training.checkpoints import CheckpointWriteError, save_checkpoint, save_weights
from kestrel.training.run import run
from tests.support.tiny import tiny_model
from tests.support.logs import Logs

ROOT = Path(__file__).resolve().parents[2]
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
TORCH_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"  # torch.save on a full disk
SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def _parts() -> tuple[Any, torch.optim.Optimizer, Any]:
    """A tiny LoRA model with an optimizer that has state, and its schedule."""
    model = get_peft_model(tiny_model("llama", 64), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


def _partial_then(exc: BaseException) -> Any:
    """A writer that writes part of its file (the disk fills up) and then raises `exc`."""

    def write(obj: Any, target: Any, *args: Any, **kwargs: Any) -> None:
        Path(str(target)).parent.mkdir(parents=True, exist_ok=True)
        Path(str(target)).write_bytes(b"\0" * 4096)
        raise exc

    return write


def _inject(where: str, monkeypatch: pytest.MonkeyPatch, model: Any) -> dict[str, Any]:
    """Make the writer of `where` fail as it would on a full disk; returns the checkpoint state
    to save (a state that cannot be serialised, for state.json)."""
    import peft.peft_model

    if where == "adapter":  # safetensors through PEFT's save_pretrained
        monkeypatch.setattr(peft.peft_model, "safe_save_file", _partial_then(SafetensorError(SAFETENSORS_FULL)))
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if Path(str(f)).name == f"{where}.pt":
            _partial_then(ENOSPC if where == "optimizer" else RuntimeError(TORCH_FULL))(obj, f)
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    return {"total_steps": 10, "note": object()} if where == "state" else {"total_steps": 10}


@pytest.mark.parametrize("where, named, full", [
    ("adapter", "adapter/ (the weights)", True),  # SafetensorError
    ("optimizer", "optimizer.pt", True),  # OSError(ENOSPC)
    ("scheduler", "scheduler.pt", False),  # RuntimeError from torch.save (says nothing of space)
    ("state", "state.json", False),  # TypeError: any Exception
])
def test_every_writer_failure_is_a_checkpoint_error_and_leaves_no_partial_folder(
        where: str, named: str, full: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer, scheduler = _parts()
    save_checkpoint(tmp_path, 2, model, optimizer, scheduler, {"total_steps": 10})
    state = _inject(where, monkeypatch, model)
    with pytest.raises(CheckpointWriteError) as caught:
        save_checkpoint(tmp_path, 4, model, optimizer, scheduler, state)
    message = str(caught.value)
    assert f"could not write the checkpoint of step 4: writing {named} failed" in message
    assert "the previous checkpoint step-000002 is intact" in message
    assert "free on the disk holding" in message and "a checkpoint needs about" in message
    assert ("The disk is full" in message) == full and ("No space left on device" in message) == full
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000002"]
    assert json.loads((tmp_path / "checkpoints" / "step-000002" / "state.json").read_text())["step"] == 2


def test_a_failed_final_weights_save_names_the_last_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import peft.peft_model

    model, optimizer, scheduler = _parts()
    save_checkpoint(tmp_path, 6, model, optimizer, scheduler, {"total_steps": 10})
    monkeypatch.setattr(peft.peft_model, "safe_save_file", _partial_then(SafetensorError(SAFETENSORS_FULL)))
    with pytest.raises(CheckpointWriteError, match=r"final weights \(adapter/\).*step-000006 is intact.*The disk is full"):
        save_weights(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]  # no adapter, no adapter.tmp
    monkeypatch.undo()
    assert (save_weights(model, tmp_path) / "adapter_model.safetensors").is_file()


def test_an_interrupt_mid_save_still_removes_the_partial_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer, scheduler = _parts()
    monkeypatch.setattr(torch, "save", _partial_then(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, model, optimizer, scheduler, {})
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_run_fails_cleanly_on_a_full_disk_then_cleans_stale_folders_and_resumes(
        tiny_model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    cfg = dict(model=str(tiny_model_dir("llama")), dataset="arithmetic_chat", output_dir=str(out), max_seq_length=64,
               batch_size=2, max_steps=6, save_steps=2, learning_rate=1e-3, seed=0, gradient_checkpointing="off")
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if Path(str(f)).parent.name == "step-000004.tmp":
            _partial_then(RuntimeError(TORCH_FULL))(obj, f)
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    failed = run(config_from_dict(cfg))
    assert failed.status == "failed" and failed.step == 0
    assert "could not write the checkpoint of step 4: writing optimizer.pt failed (RuntimeError" in failed.error
    assert "step-000002 is intact" in failed.error
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]
    monkeypatch.undo()
    # What a kill in the middle of a save leaves behind: removed (and said) at the next start.
    for stale in (out / "checkpoints" / "step-000004.tmp", out / "adapter.tmp"):
        stale.mkdir()
        (stale / "part").write_bytes(b"\0" * 100)
    logs = Logs()
    resumed = run(config_from_dict(cfg), [logs])
    assert resumed.status == "completed", resumed.error
    assert any("step-000004.tmp" in line and "unfinished save" in line for line in logs.lines), logs.lines
    assert any(line.startswith(f"removed {out / 'adapter.tmp'}") for line in logs.lines)
    assert any("resuming from step-000002" in line for line in logs.lines)
    assert not list(out.rglob("*.tmp"))
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7)) and (out / "adapter" / "adapter_model.safetensors").is_file()


TMPFS_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    from safetensors.torch import save_file
    from kestrel.training.checkpoints import CheckpointWriteError, save_checkpoint

    class Tiny(torch.nn.Module):  # save_pretrained as Hugging Face models write it: safetensors
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(256, 256)

        def save_pretrained(self, target):
            target.mkdir(parents=True, exist_ok=True)
            save_file(self.state_dict(), str(target / "model.safetensors"))

    torch.manual_seed(0)
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters())
    model.w(torch.ones(1, 256)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    out = Path(sys.argv[1])
    one = save_checkpoint(out, 1, model, optimizer, scheduler, {})
    if sys.argv[2] == "probe":
        print(sum(f.stat().st_size + 4096 for f in one.rglob("*") if f.is_file()))
        sys.exit(0)
    try:
        save_checkpoint(out, 2, model, optimizer, scheduler, {})
    except CheckpointWriteError as exc:
        print("ERROR", exc)
    print("LEFT", sorted(p.name for p in (out / "checkpoints").iterdir()))
""")


def test_a_real_full_tmpfs(tmp_path: Path) -> None:
    """A tmpfs with room for one checkpoint and a half, mounted in an unprivileged user and mount
    namespace: the second checkpoint fills it; skipped where such namespaces are not allowed."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no unprivileged user namespaces (unshare -rm) here")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    probe = subprocess.run([sys.executable, "-c", TMPFS_SCRIPT, str(tmp_path), "probe"], capture_output=True,
                           text=True, timeout=120, env=env, check=True)
    size = int(probe.stdout)  # one checkpoint, each file rounded up by a page
    mount = tmp_path / "disk"
    mount.mkdir()
    shell = f'mount -t tmpfs -o size={size * 3 // 2 // 4096 * 4096} tmpfs {mount} && {sys.executable} -c "$0" {mount} full'
    done = subprocess.run([unshare, "-rm", "sh", "-c", shell, TMPFS_SCRIPT], capture_output=True, text=True,
                          timeout=120, env=env)
    if done.returncode != 0 and "mount" in done.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr
    assert "could not write the checkpoint of step 2" in done.stdout and "step-000001 is intact" in done.stdout
    assert "The disk is full" in done.stdout and "free at least" in done.stdout
    assert "LEFT ['step-000001']" in done.stdout
