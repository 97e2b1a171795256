"""Scheduler supervision and the truth behind the admin ``/health`` of ``afore serve``.

Serving never depends on the scheduler (DESIGN.md invariant 5): when it dies, the FFN workers
see its pid gone (or its heartbeat stale) in the plan ring and run every target primary-only
at once, and the launcher restarts it. The new scheduler creates fresh segments (the stale
ones of the dead process are replaced), starts from the primary-only slot tables, and re-earns
its replicas through the copies of its own plans (every plan is validated against the
worker's projected slots, so nothing of the old scheduler's placement is relied on); the FFN
workers re-attach to the new ring and the attention workers to the new mailbox on their next
miss. A scheduler that keeps dying (``max_restarts`` within ``window_s``) is left down and
reported ``failed``: the server goes on primary-only, and ``/health`` says so.

``SchedulerSupervisor.poll(launcher)`` is called by the launcher's supervising loop (main
thread, every 0.1 s); ``health(launcher)`` is the body of ``GET /health`` on the admin port:
200 ``{"status": "ok"}`` while every process of the node is up, else 503 with ``degraded``
(the scheduler is restarting or failed: requests are served, primary-only) or ``failing``
(an FFN worker or vLLM is gone: requests fail until afore serve is restarted).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import sys
import time
from typing import Protocol

log = logging.getLogger("afore.serve")


class Supervised(Protocol):
    """What the supervisor needs from the launcher."""

    scheduler: object | None  # Child(name, proc) or None
    policy: str

    def stop_scheduler(self) -> None: ...

    def start_scheduler(self, policy: str) -> None: ...


@dataclasses.dataclass
class SchedulerState:
    """What ``/health`` and ``/afore/status`` report about the scheduler (times: CLOCK_MONOTONIC s)."""

    state: str = "running"  # running | restarting | failed | stopped (role attention: no scheduler here)
    #                         | workers (--planner workers: the FFN workers plan, no scheduler process)
    restarts: int = 0
    last_exit: int | None = None
    down_since: float | None = None
    last_down_s: float | None = None  # how long the last outage lasted (exit seen -> new one ready)
    error: str = ""

    def report(self, now: float) -> dict:
        out = {"state": self.state, "restarts": self.restarts}
        if self.last_exit is not None:
            out["last_exit"] = self.last_exit
        if self.down_since is not None:
            out["down_for_s"] = round(now - self.down_since, 3)
        if self.last_down_s is not None:
            out["last_down_s"] = round(self.last_down_s, 3)
        if self.error:
            out["error"] = self.error
        return out


class SchedulerSupervisor:
    """Restarts a scheduler that exited while the launcher did not stop it.

    Args:
      max_restarts: restarts allowed within ``window_s``; one more death leaves it ``failed``.
      window_s: the window of that budget (s).
    """

    def __init__(self, max_restarts: int = 5, window_s: float = 60.0, clock=time.monotonic):
        if max_restarts < 0:
            raise ValueError(f"max_restarts: expected >= 0, got {max_restarts}")
        if not window_s > 0:
            raise ValueError(f"window_s: expected > 0, got {window_s}")
        self.max_restarts, self.window_s, self.clock = max_restarts, window_s, clock
        self.scheduler = SchedulerState()
        self._recent: collections.deque[float] = collections.deque()

    def poll(self, launcher: Supervised) -> None:
        """One supervision step: restart a dead scheduler if the budget allows (blocks while it
        starts, about a second; the FFN workers run primary-only meanwhile)."""
        child = launcher.scheduler
        if child is None:
            return
        if self.scheduler.state == "failed":  # started again by a policy switch: a fresh budget
            self.scheduler.state, self.scheduler.error = "running", ""
            self._recent.clear()
        code = child.proc.poll()
        if code is None:
            return
        now = self.clock()
        s = self.scheduler
        s.state, s.last_exit, s.down_since = "restarting", code, now
        print(f"afore: scheduler (pid {child.proc.pid}) exited with {code}: FFN workers run primary-only "
              f"plans; restarting it", file=sys.stderr, flush=True)
        while self._recent and now - self._recent[0] > self.window_s:
            self._recent.popleft()
        if len(self._recent) >= self.max_restarts:
            s.state = "failed"
            s.error = f"exited {len(self._recent) + 1} times within {self.window_s:.0f} s; left down"
            print(f"afore: scheduler {s.error}; serving goes on primary-only", file=sys.stderr, flush=True)
            launcher.scheduler = None
            return
        self._recent.append(now)
        try:
            launcher.stop_scheduler()  # reaps it, removes its segments
            launcher.start_scheduler(launcher.policy)
        except Exception as exc:  # noqa: BLE001  (a scheduler that cannot start: serve primary-only, say so)
            s.state, s.error = "failed", f"restart failed: {type(exc).__name__}: {exc}"
            print(f"afore: scheduler {s.error}; serving goes on primary-only", file=sys.stderr, flush=True)
            launcher.scheduler = None
            return
        s.restarts += 1
        s.last_down_s = self.clock() - now
        s.state, s.down_since, s.error = "running", None, ""
        log.info("afore: scheduler restarted in %.2f s (restart %d)", s.last_down_s, s.restarts)

    def health(self, processes: dict[str, dict], role: str, planner: str = "scheduler") -> tuple[int, dict]:
        """(HTTP status, body) of ``GET /health``.

        ``processes``: name -> {"pid", "alive"} of this node's children (``Launcher.status``);
        ``planner``: ``workers`` when the FFN workers plan themselves (no scheduler process).
        """
        now = self.clock()
        dead = sorted(name for name, p in processes.items() if not p["alive"])
        scheduler = self.scheduler.report(now)
        if role == "attention":
            scheduler = {"state": "stopped"}  # it runs on the FFN node
        elif planner in ("workers", "attention"):
            scheduler = {"state": planner}  # the FFN workers, or the attention worker, plan (afore serve --planner)
        elif "scheduler" not in processes and self.scheduler.state == "running":
            scheduler["state"] = "restarting"  # between stop and start of a policy switch
        body: dict = {"status": "ok", "scheduler": scheduler, "dead": dead}
        serving_broken = [name for name in dead if name != "scheduler"]
        if serving_broken:
            body["status"] = "failing"
            body["reason"] = f"{', '.join(serving_broken)} exited: requests fail until afore serve is restarted"
        elif scheduler["state"] in ("restarting", "failed") or "scheduler" in dead:
            body["status"] = "degraded"
            body["reason"] = f"scheduler {scheduler['state']}: requests are served on primary-only plans"
        return (200 if body["status"] == "ok" else 503), body
