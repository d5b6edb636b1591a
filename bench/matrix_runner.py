"""`bench/matrix.py`'s chunked driver: the pending (cell, system) pairs, each in its own process, on
one GPU or on several GPUs of one host at once, under a chunk's time budget; one JSON line each.

- Models run one at a time (the GPU machine's disk holds one or two folders): a model's folder is
  built first (`--prepare`, its own process; other models' folders are removed then unless
  --keep-models), then its pending pairs go to one worker thread per GPU, each running its pair's
  process with CUDA_VISIBLE_DEVICES set to its GPU. The next model starts once every pair of this
  one has ended, so no folder is removed while a pair of its model runs.
- A worker left without pairs builds the next model's folder ahead, on its GPU. The build refuses
  when the disk has no room for it beside the current folder (`matrix_models.check_free_disk`);
  then it is built once this model is done and the folders before it are removed.
- Each record says on which GPU it ran (`gpu`, a CUDA_VISIBLE_DEVICES entry) and the most processes
  the host ran at once while it ran, itself and a folder being built included (`concurrent`), and
  how many drivers of the matrix ran on the host at its start or end (`drivers`: one a GPU when a
  call runs a script per GPU, which `concurrent`, counting this driver's own processes, does not see).
- Baselines run without flash-linear-attention where its backward refuses the GPU (`baseline_env`),
  the only way they train Qwen3.5 there; their records say so.
- The chunk's clock: nothing starts once --budget-s has passed; a process still running at --hard-s
  is stopped, and its pair left unrecorded for the next chunk, as are the pairs not started.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from bench.matrix_models import MODEL_ROOT, model_dir
from bench.matrix_table import record_key
from kestrel.processes import pid_exists

SCRIPT = Path(__file__).with_name("matrix.py")  # what each pair's and each build's process runs
Key = tuple[str, str, str, str]  # (model, method, layout, system)
Launch = Callable[..., dict[str, Any]]  # `isolated`'s signature: (args, timeout, extra_path, env) -> result
MIN_CASE_S = 30  # a case with less time left than this before the chunk's end is not started


def load_records(path: Path) -> list[dict[str, Any]]:
    """The records in a results file (a line cut short by a kill is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def append_record(path: Path, record: dict[str, Any], mirror: str | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    if mirror and Path(mirror).resolve() != path.parent.resolve():  # the results already written there: nothing to copy
        Path(mirror).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(mirror) / path.name)


def pending(args: argparse.Namespace) -> list[Key]:
    """The (model, method, layout, system) pairs asked for and not yet in --out, in run order."""
    done = {record_key(r) for r in load_records(Path(args.out)) if not (args.retry_errors and "error" in r)}
    cells = args.cells or [(m, me, lay) for m in args.models for me in args.methods for lay in args.layouts]
    return [(*cell, s) for cell in cells for s in args.systems if (*cell, s) not in done]


class Clock:
    """The chunk's time: --budget-s for starting new work, --hard-s for stopping a running case."""

    def __init__(self, budget_s: float, hard_s: float | None, now: Callable[[], float] = time.monotonic) -> None:
        self.now = now
        self.t0, self.budget = now(), budget_s
        self.hard = hard_s if hard_s is not None else (budget_s + 45 if budget_s else None)

    def spent(self) -> bool:
        return bool(self.budget) and self.now() - self.t0 >= self.budget

    def limit(self, cell_timeout: float) -> tuple[float, bool]:
        """Seconds a case may run now, and whether that is the chunk's end rather than its own limit."""
        if self.hard is None:
            return cell_timeout, False
        left = self.hard - (self.now() - self.t0)
        return min(cell_timeout, left), left < cell_timeout


def gpu_count() -> int:
    """The host's GPUs, counted without initialising CUDA here: nvidia-smi's list, else a child's torch."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=True).stdout
        return sum(1 for line in listed.splitlines() if line.startswith("GPU "))  # MIG devices are indented under theirs
    except (OSError, subprocess.SubprocessError):
        child = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                               capture_output=True, text=True, timeout=300)
        return int(child.stdout.strip() or 0)


def visible_gpus(want: str) -> list[str]:
    """The GPUs the workers take, as CUDA_VISIBLE_DEVICES entries: the first `want` ("all": every one) of
    those this process may use (its CUDA_VISIBLE_DEVICES when set, else the host's)."""
    if want != "all" and (not want.isdigit() or int(want) < 1):
        raise ValueError(f"--gpus takes a count of at least 1 or all, got {want!r}")
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        visible = [v.strip() for v in env.split(",") if v.strip()]
    else:  # one GPU needs no count: the first, as a process sees it by default
        visible = ["0"] if want == "1" else [str(i) for i in range(gpu_count())]
    n = len(visible) if want == "all" else int(want)
    if not visible or n > len(visible):
        raise ValueError(f"--gpus {want}: {len(visible)} GPU(s) visible here "
                         f"(CUDA_VISIBLE_DEVICES={env!r}; unset: every GPU nvidia-smi -L lists)")
    return visible[:n]


def isolated(args: list[str], timeout: float, extra_path: str | None = None,
             env: dict[str, str] | None = None) -> dict[str, Any]:
    """bench/matrix.py in its own process (`run_isolated`); a timeout becomes {"timeout": seconds}."""
    from bench.common import run_isolated

    started = time.monotonic()
    try:
        res = run_isolated(str(SCRIPT), args, extra_path=extra_path, timeout=max(1, int(timeout)), env=env)
    except subprocess.TimeoutExpired:
        return {"timeout": timeout, "wall_s": time.monotonic() - started}
    res.setdefault("wall_s", time.monotonic() - started)
    return res


FLA_SITE = ".gpu-fla"  # flash-linear-attention's folder on PYTHONPATH (bench/gpu_session.sh carries it)


@functools.cache
def fla_refused_here() -> bool:
    """Whether flash-linear-attention 0.6 refuses its gated backward on this host: a Hopper GPU
    (compute capability 9.0) under Triton 3.4 to 3.7.0, its own guard (fla issue 640). Read from
    nvidia-smi and the package metadata: this process never touches CUDA."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        caps = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60, check=True).stdout.split()
        triton = tuple(int(p) for p in version("triton").split("+")[0].split(".")[:3])
    except (OSError, subprocess.SubprocessError, PackageNotFoundError, ValueError):
        return False
    return "9.0" in caps and (3, 4, 0) <= triton < (3, 7, 1)


def baseline_env(system: str) -> dict[str, str]:
    """A baseline's PYTHONPATH without flash-linear-attention where its backward refuses the GPU:
    HF binds the package's kernels at import, so with it installed a baseline's Qwen3.5 cannot
    train there at all; without it the baseline runs HF's PyTorch functions, its only way to train
    there. Kestrel keeps the kernels (kestrel.model.linear_attention)."""
    path = os.environ.get("PYTHONPATH", "")
    if system.startswith("kestrel") or FLA_SITE not in path or not fla_refused_here():
        return {}
    return {"PYTHONPATH": ":".join(p for p in path.split(":") if not p.rstrip("/").endswith(FLA_SITE))}


def gpu_env(gpu: str | None) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}


def build(name: str, args: argparse.Namespace, clock: Clock, launch: Launch = isolated,
          gpu: str | None = None) -> dict[str, Any] | None:
    """Build a model's folder in its own process (on `gpu`); None when done, else the failure
    ({"error"}, or {"timeout"} when the chunk's end cut it)."""
    limit, cut = clock.limit(args.cell_timeout)
    print(f"building {name} at {model_dir(name)} on GPU {gpu} ...", flush=True)
    res = launch(["--prepare", name], limit, env=gpu_env(gpu))
    if "timeout" in res and not cut:
        return {"error": f"building the model took over {limit:.0f} s"}
    return res if ("error" in res or "timeout" in res) else None


def prepare(name: str, args: argparse.Namespace, clock: Clock, launch: Launch = isolated, gpu: str | None = None,
            root: Path = MODEL_ROOT) -> dict[str, Any] | None:
    """Make sure the model folder exists (other models' folders go first unless --keep-models: no pair
    may run meanwhile). None when ready, else `build`'s failure."""
    if not args.keep_models and root.exists():
        for other in root.iterdir():
            if other.is_dir() and other.name != name:
                shutil.rmtree(other, ignore_errors=True)  # 64 GiB disk: one model at a time
    if (model_dir(name, root) / "config.json").exists():
        return None
    return build(name, args, clock, launch, gpu)


def run_one(key: Key, args: argparse.Namespace, clock: Clock, launch: Launch = isolated,
            gpu: str | None = None) -> dict[str, Any] | None:
    """One (cell, system) in its own process (on `gpu`); its record, or None when the chunk's end cut it."""
    limit, cut = clock.limit(args.cell_timeout)
    if limit < MIN_CASE_S:
        return None
    system = key[3]
    kestrel = system.startswith("kestrel")
    warmup = args.warmup if kestrel else args.warmup_baselines
    child = ["--cell", ",".join(key), "--steps", str(args.steps), "--warmup", str(warmup),
             "--batches", str(args.batches), "--seed", str(args.seed), "--cuda-graphs", args.cuda_graphs]
    if kestrel and args.settle:
        child += ["--settle", str(args.settle)]
    env = {"KESTREL_CUDA_GRAPHS": ""} if kestrel else baseline_env(system)  # the mode asked for, not an inherited override
    if system == "unsloth":  # a MoE folder leaves its experts out on purpose (bench.matrix_models)
        env["UNSLOTH_WARN_UNINITIALIZED"] = "0"
    res = launch(child, limit, extra_path=args.anchors if system == "unsloth" else None, env={**env, **gpu_env(gpu)})
    if "timeout" in res:
        if cut:
            return None
        res = {"error": f"timeout after {limit:.0f} s", "wall_s": res["wall_s"]}
    if "PYTHONPATH" in env:
        res["flash_linear_attention"] = "left out: its backward refuses this GPU"
    return keyed(key, res)


def keyed(key: Key, res: dict[str, Any]) -> dict[str, Any]:
    """A result as a line of the results file: its (cell, system) first, and when it was made."""
    return {"model": key[0], "method": key[1], "layout": key[2], "system": key[3], **res,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _gpu_field(gpu: str | None) -> int | str | None:
    return int(gpu) if gpu is not None and gpu.isdigit() else gpu


DRIVERS_FOLDER = Path("/tmp/kestrel-matrix-drivers")


class HostDrivers:
    """The matrix drivers running on this host: a file a driver, named by its process id, in `folder`
    (the same for every driver of the host); a file whose process has gone is not counted."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder or DRIVERS_FOLDER
        self.mine = self.folder / str(os.getpid())

    def __enter__(self) -> "HostDrivers":
        self.folder.mkdir(parents=True, exist_ok=True)
        self.mine.touch()
        return self

    def __exit__(self, *exc: object) -> None:
        self.mine.unlink(missing_ok=True)

    def count(self) -> int:
        return sum(1 for f in self.folder.glob("*") if f.name.isdigit() and pid_exists(int(f.name))) if self.folder.exists() else 1


class Runner:
    """One chunk of the matrix over `gpus` (CUDA_VISIBLE_DEVICES entries), a worker thread each.
    `launch` starts a process (`isolated`), `root` holds the model folders."""

    def __init__(self, args: argparse.Namespace, gpus: list[str], launch: Launch = isolated,
                 clock: Clock | None = None, root: Path = MODEL_ROOT, drivers: HostDrivers | None = None) -> None:
        self.args, self.gpus, self.launch, self.root = args, gpus, launch, root
        self.clock = clock or Clock(args.budget_s, args.hard_s)
        self.lock = threading.Lock()  # guards what follows and the results file
        self.running: dict[Any, int] = {}  # what runs now (a pair's key, or ("build", model)) -> most at once so far
        self.stopped = False  # the chunk's end cut a process: start nothing more
        self.ahead: set[str] = set()  # models whose folder a worker took to build ahead
        self.drivers = drivers or HostDrivers()
        self.drivers_at_start: dict[Any, int] = {}  # a running pair's key -> drivers on the host when it started
        # This chunk's records carry its id: the table compares systems only within one chunk (side by side)
        self.chunk = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"

    def run(self) -> None:
        """Every pending pair, model by model, until done, the budget is spent or the chunk's end cuts one."""
        with self.drivers:
            self._run()

    def _run(self) -> None:
        todo = pending(self.args)
        models = list(dict.fromkeys(key[0] for key in todo))
        print(f"{len(todo)} (cell, system) pairs to run on GPU(s) {','.join(self.gpus)}", flush=True)
        for i, name in enumerate(models):
            if self.clock.spent():
                break
            keys = [key for key in todo if key[0] == name]
            failed = prepare(name, self.args, self.clock, self.launch, self.gpus[0], self.root)
            if failed is not None and "timeout" in failed:
                print(f"stopped while building {name}: the chunk's end; left for the next chunk", flush=True)
                return
            if failed is not None:
                for key in keys:
                    self.write(keyed(key, failed), self.gpus[0], 1)
                continue
            self.run_model(keys, models[i + 1] if i + 1 < len(models) else None)
            if self.stopped:
                return
        left = len(pending(self.args))
        if left and self.clock.spent():
            print(f"budget of {self.args.budget_s:.0f} s spent: {left} pairs left for the next chunk", flush=True)

    def run_model(self, keys: list[Key], ahead: str | None) -> None:
        """A model's pairs over the workers; returns once every one has ended."""
        queue = collections.deque(keys)
        workers = [threading.Thread(target=self.work, args=(gpu, queue, ahead), name=f"matrix-gpu-{gpu}", daemon=True)
                   for gpu in self.gpus]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def work(self, gpu: str, queue: collections.deque[Key], ahead: str | None) -> None:
        """One worker: the queue's next pair on `gpu` until none is left (then maybe the next folder)."""
        while True:
            with self.lock:
                if self.stopped or self.clock.spent():
                    return
                job: Any = queue.popleft() if queue else self._claim_ahead(ahead)
                if job is None:
                    return
                self._start(job)
            if job[0] == "build":
                self.build_ahead(job, gpu)
            else:
                self.run_pair(job, gpu)

    def _claim_ahead(self, name: str | None) -> tuple[str, str] | None:
        """The next model's build for a worker with no pair left, once: with one GPU nothing would
        run beside it, so it waits for its turn (and the disk needs no room for two folders)."""
        if len(self.gpus) < 2 or name is None or name in self.ahead or (model_dir(name, self.root) / "config.json").exists():
            return None
        self.ahead.add(name)
        return ("build", name)

    def _start(self, job: Any) -> None:
        """Count `job` in: every process running now has seen this many at once."""
        at_once = len(self.running) + 1
        for other in self.running:
            self.running[other] = max(self.running[other], at_once)
        self.running[job] = at_once
        self.drivers_at_start[job] = self.drivers.count()

    def run_pair(self, key: Key, gpu: str) -> None:
        record = run_one(key, self.args, self.clock, self.launch, gpu)
        with self.lock:
            at_once = self.running.pop(key)
            drivers = max(self.drivers_at_start.pop(key), self.drivers.count())
            if record is None:
                self.stopped = True
                print(f"{','.join(key)}: stopped at the chunk's end; left for the next chunk", flush=True)
                return
            self.write({**record, "drivers": drivers}, gpu, at_once)

    def build_ahead(self, job: tuple[str, str], gpu: str) -> None:
        """The next model's folder while this model's last pairs run; a failure (no room on the disk
        yet, the chunk's end) is only printed: `prepare` builds it when the model's turn comes."""
        failed = build(job[1], self.args, self.clock, self.launch, gpu)
        with self.lock:
            self.running.pop(job)
            self.drivers_at_start.pop(job, None)
            if failed is not None:
                print(f"building {job[1]} ahead did not finish; it is built in its turn: "
                      f"{str(failed.get('error', failed))[-300:]}", flush=True)

    def write(self, record: dict[str, Any], gpu: str | None, at_once: int) -> None:
        """Append a record with where it ran (the caller holds the lock, or no worker runs)."""
        record = {**record, "gpu": _gpu_field(gpu), "concurrent": at_once, "chunk": self.chunk}
        append_record(Path(self.args.out), record, self.args.mirror)
        skip = ("losses", "step_s", "graph_decisions", "versions")
        print(json.dumps({k: v for k, v in record.items() if k not in skip})[:1500], flush=True)


def run_matrix(args: argparse.Namespace, launch: Launch = isolated) -> None:
    """One chunk of the matrix on --gpus GPUs of this host."""
    Runner(args, visible_gpus(str(args.gpus)), launch).run()
