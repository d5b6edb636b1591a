"""A rank other than 0 of a run on several devices, started by `kestrel.training.launch`:

    python -m kestrel.training.rank <output_dir>/config.yaml <pid of rank 0>

It trains its share through the same `run` as rank 0 (which reports, saves and decides when to
stop), ignores SIGTERM (a cancel reaches it through rank 0) and exits when rank 0's process is gone.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from kestrel.config import load_config


def _exit_with_parent(parent: int) -> None:
    """Exit when rank 0's process is gone (killed with SIGKILL, say): no orphan keeps a GPU."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            print(f"rank {os.environ.get('RANK')}: rank 0 (pid {parent}) is gone; exiting", flush=True)
            os._exit(1)


def main(argv: list[str]) -> int:
    config_path, parent = argv[0], int(argv[1])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    from kestrel.training.run import run

    result = run(load_config(config_path))
    if result.error:
        print(f"rank {os.environ.get('RANK')}: {result.status}: {result.error}", flush=True)
    return 0 if result.status != "failed" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
