"""The jobs command line (a fixed interface: scripts and the docs rely on it).

    python -m kestrel jobs submit CONFIG.yaml [--device cpu] [--max_steps 30 ...]   # prints the new id
    python -m kestrel jobs submit EXPORT.yaml [--quant q8_0]   # kind: export (see kestrel/jobs/export_job.py)
    python -m kestrel jobs export RUN_OR_JOB_ID --format gguf --quant q4_k_m   # prints the export's id
    python -m kestrel jobs export RUN_OR_JOB_ID --checkpoint 40                # a saved checkpoint instead
    python -m kestrel jobs list [--json] [--status running]
    python -m kestrel jobs show ID [--json]        # status, pid, progress, last metrics, error
    python -m kestrel jobs cancel ID [--wait]      # or: pause ID (ends `interrupted`)
    python -m kestrel jobs resume ID
    python -m kestrel jobs logs ID [--follow] [-n 200]
    python -m kestrel jobs delete ID [--files]     # refuses a running job

Errors print one line on stderr: exit code 2 for a bad config, 1 for anything else.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kestrel.config import config_from_dict, parse_overrides
from kestrel.constants import merge
from kestrel.errors import ConfigError, KestrelError, one_line
from kestrel.export import FORMATS
from kestrel.jobs import export_job, queries, runner
from kestrel.jobs.models import Job
from kestrel.safe_yaml import read_config_file


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kestrel jobs", description="Kestrel's background training and export jobs.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("submit", help="queue a training or export config; prints the job id")
    s.add_argument("config", help="a YAML config (python -m kestrel train takes the same file), "
                                  "or an export config (kind: export)")
    _queue_options(s)
    e = sub.add_parser("export", help="queue an export of a finished run; prints the job id")
    e.add_argument("source", help="a finished run's job id or folder, an adapter or model folder, or demo")
    e.add_argument("--format", default="gguf", choices=FORMATS, help="what to write (default gguf)")
    e.add_argument("--quant", help="gguf: quantization type (default f16); merged: auto, bf16, f16 or f32")
    e.add_argument("--checkpoint", type=int, metavar="STEP",
                   help="export the run's checkpoint of this step instead of its final weights")
    e.add_argument("--out", dest="output_dir", help="the folder to write into (default under KESTREL_HOME/exports)")
    e.add_argument("--no-check", action="store_true", help="skip the comparison with the Hugging Face model")
    _queue_options(e)
    ls = sub.add_parser("list", help="all jobs, newest first")
    ls.add_argument("--json", action="store_true")
    ls.add_argument("--status", help="only jobs in this status")
    sh = sub.add_parser("show", help="one job in detail")
    sh.add_argument("id", type=int)
    sh.add_argument("--json", action="store_true")
    c = sub.add_parser("cancel", help="stop a job at its next step boundary (after a checkpoint)")
    c.add_argument("id", type=int)
    c.add_argument("--wait", action="store_true", help="return once the job has stopped")
    pa = sub.add_parser("pause", help="like cancel, but the job ends interrupted, ready to resume")
    pa.add_argument("id", type=int)
    pa.add_argument("--wait", action="store_true")
    r = sub.add_parser("resume", help="continue an interrupted, cancelled or failed job from its checkpoint")
    r.add_argument("id", type=int)
    lg = sub.add_parser("logs", help="print a job's log")
    lg.add_argument("id", type=int)
    lg.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    lg.add_argument("-n", type=int, default=200, help="lines from the end (without --follow)")
    d = sub.add_parser("delete", help="forget a job that is not running")
    d.add_argument("id", type=int)
    d.add_argument("--files", action="store_true", help="also delete its folder (under KESTREL_HOME only)")
    return p


def _queue_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help="pin the job to a device (cpu, cuda:1); default: the first free one")
    p.add_argument("--no-start", action="store_true", help="queue only; the next scheduler pass starts it")


def main(argv: list[str] | None = None) -> int:
    args, extra = _parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    if extra and args.command != "submit":
        print(f"error: unrecognized arguments: {' '.join(extra)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[args.command](args, extra)
    except ConfigError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    except (KestrelError, TimeoutError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `python -m kestrel jobs logs 3 | head`
        return 0


def _submit(args: argparse.Namespace, overrides: list[str]) -> int:
    """Read the file once (size, depth and alias limits: `kestrel.safe_yaml`), tell an export
    config from a training one, validate, queue; nothing is stored when any check fails."""
    raw = read_config_file(args.config)
    if export_job.is_export_config(raw):
        config: Any = {**raw, **parse_overrides(overrides)}
    else:
        config = config_from_dict(merge(raw, parse_overrides(overrides)))
    print(runner.submit(config, device=args.device, start=not args.no_start))
    return 0


def _export(args: argparse.Namespace, _: list[str]) -> int:
    config = {"kind": "export", "source": args.source, "checkpoint": args.checkpoint, "format": args.format,
              "quant": args.quant, "output_dir": args.output_dir, "check": not args.no_check}
    print(runner.submit(config, device=args.device, start=not args.no_start))
    return 0


def _list(args: argparse.Namespace, _: list[str]) -> int:
    jobs = runner.list_jobs(status=args.status)
    if args.json:
        print(json.dumps([queries.job_summary(j) for j in jobs], indent=1))
        return 0
    rows = [("ID", "STATUS", "STEP", "DEVICE", "NAME", "CREATED", "ERROR")]
    for j in jobs:
        rows.append((str(j.id), j.status, _progress(j), j.device or "-", j.name or "-",
                     _when(j.created_at), (j.error or "").splitlines()[0][:60] if j.error else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    return 0


def _show(args: argparse.Namespace, _: list[str]) -> int:
    summary = queries.job_summary(runner.get_job(args.id), with_metrics=True)
    if args.json:
        print(json.dumps(summary, indent=1, default=str))
        return 0
    s = summary
    lines = [
        f"job {s['id']}  {s['name']}  ({s['kind']})",
        f"status     {s['status']}" + (f"  (stop requested: {s['stop_request']})" if s["stop_request"] else ""),
        f"pid        {s['pid'] or '-'}   device {s['device'] or '-'}",
        f"progress   {s['step']}/{s['total_steps'] or '?'}"
        + (f"  ({100 * s['progress']:.0f}%)" if s["progress"] is not None else "")
        + (f"  {s['stage']}" if s["stage"] else ""),
        f"created    {_when(s['created_at'])}   started {_when(s['started_at'])}   "
        f"finished {_when(s['finished_at'])}",
        f"output     {s['output_dir']}",
        f"log        {s['log_path']}",
    ]
    if s["last_metrics"]:
        lines.append("metrics    " + "  ".join(f"{k}={v:.4g}" for k, v in sorted(s["last_metrics"].items())))
    for a in s["artifacts"]:
        lines.append(f"artifact   {a['kind']:<10} {a['path']}  ({_size(a['size_bytes'])})")
    if s["error"]:
        lines.append(f"error      {s['error']}")
    print("\n".join(lines))
    return 0


def _stop(args: argparse.Namespace, _: list[str]) -> int:
    outcome = (runner.cancel if args.command == "cancel" else runner.pause)(args.id)
    if outcome != "stopping":
        print(outcome)
        return 0
    if not args.wait:
        print("stopping (the job ends at its next step boundary, after a checkpoint)")
        return 0
    print(runner.wait(args.id).status)
    return 0


def _resume(args: argparse.Namespace, _: list[str]) -> int:
    runner.resume(args.id)
    print(f"{args.id} {runner.get_job(args.id).status}")
    return 0


def _logs(args: argparse.Namespace, _: list[str]) -> int:
    if not args.follow:
        sys.stdout.write(runner.log_tail(args.id, args.n))
        return 0
    for chunk in runner.follow_log(args.id):
        sys.stdout.write(chunk)
        sys.stdout.flush()
    return 0


def _delete(args: argparse.Namespace, _: list[str]) -> int:
    runner.delete(args.id, remove_files=args.files)
    print(f"deleted {args.id}")
    return 0


COMMANDS: dict[str, Any] = {"submit": _submit, "export": _export, "list": _list, "show": _show, "cancel": _stop,
                            "pause": _stop, "resume": _resume, "logs": _logs, "delete": _delete}


def _progress(job: Job) -> str:
    return f"{job.step}/{job.total_steps}" if job.total_steps else str(job.step or "-")


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
