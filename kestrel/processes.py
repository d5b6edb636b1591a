"""Whether an operating-system process exists: one leaf module (no database, no torch), so the job runner and
the bench drivers that run without the job store's packages ask the same question the same way."""

from __future__ import annotations

import os


def pid_exists(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user's counts: it cannot be signalled, but it is there)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
