"""Process liveness that does not depend on who reaps the process."""

from __future__ import annotations

import os
import subprocess


def pid_alive(pid: int) -> bool:
    """The process exists and has not exited: an exited child that its parent has not reaped
    yet (a zombie, e.g. while ``afore serve`` is still stopping vLLM) still answers kill(0)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: trust kill(0)
    return state not in (b"Z", b"X")


def child_running(proc: subprocess.Popen) -> bool:
    """Whether a child started with Popen still runs, safe to ask from any thread: ``poll()``
    answers None (as if running) while another thread is inside its waitpid, so a dead child
    is also recognised by its /proc state."""
    return proc.poll() is None and pid_alive(proc.pid)
