"""Scheduler supervision (afore.serve.supervisor) over a stand-in launcher whose 'scheduler' is a
real child process, and the admin /health it answers."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from afore.serve.admin import AdminServer
from afore.serve.launcher import Child
from afore.serve.supervisor import SchedulerSupervisor


class FakeLauncher:
    def __init__(self, fail_start: bool = False):
        self.policy, self.fail_start = "afore", fail_start
        self.scheduler: Child | None = None
        self.ffn = [Child("ffn-0", _sleeper())]
        self.supervisor = SchedulerSupervisor(max_restarts=2, window_s=60.0)
        self.starts: list[str] = []
        self.start_scheduler(self.policy)

    def start_scheduler(self, policy: str) -> None:
        if self.fail_start and self.starts:
            raise RuntimeError("scheduler exited with 1 before it was ready")
        self.scheduler = Child("scheduler", _sleeper())
        self.starts.append(policy)

    def stop_scheduler(self) -> None:
        if self.scheduler is not None:
            self.scheduler.proc.kill()
            self.scheduler.proc.wait()
            self.scheduler = None

    def children(self) -> list[Child]:
        return self.ffn + ([self.scheduler] if self.scheduler else [])

    def status(self) -> dict:
        return {"role": "all", "policy": self.policy, "model": "/m", "attn_workers": 1, "ffn_workers": 1,
                "processes": {c.name: {"pid": c.proc.pid, "alive": c.proc.poll() is None} for c in self.children()}}

    def health(self) -> tuple[int, dict]:
        return self.supervisor.health(self.status()["processes"], "all")

    def switch_policy(self, policy: str) -> None:
        self.policy = policy

    def metrics_exposition(self):
        return None

    def close(self) -> None:
        for c in self.children():
            c.proc.kill()
            c.proc.wait()


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def _kill(child: Child) -> None:
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait()


@pytest.fixture
def launcher():
    made: list[FakeLauncher] = []

    def make(**kw) -> FakeLauncher:
        made.append(FakeLauncher(**kw))
        return made[-1]

    yield make
    for fake in made:
        fake.close()


def test_a_killed_scheduler_is_restarted_with_its_policy_and_health_says_degraded_meanwhile(launcher):
    fake = launcher()
    sup = fake.supervisor
    assert fake.health() == (200, {"status": "ok", "scheduler": {"state": "running", "restarts": 0}, "dead": []})
    old = fake.scheduler
    _kill(old)
    code, body = fake.health()  # exited, not yet seen by the supervising loop
    assert code == 503 and body["status"] == "degraded" and body["dead"] == ["scheduler"]
    assert "primary-only" in body["reason"]
    sup.poll(fake)
    assert fake.scheduler is not old and fake.scheduler.proc.poll() is None and fake.starts == ["afore", "afore"]
    code, body = fake.health()
    assert code == 200 and body["scheduler"]["restarts"] == 1 and body["scheduler"]["last_exit"] == -signal.SIGKILL
    assert body["scheduler"]["last_down_s"] >= 0


def test_a_scheduler_that_keeps_dying_is_left_down_and_reported_failed(launcher):
    fake = launcher()
    for _ in range(2):
        _kill(fake.scheduler)
        fake.supervisor.poll(fake)
    _kill(fake.scheduler)
    fake.supervisor.poll(fake)  # third death within the window: over the budget of 2
    assert fake.scheduler is None and len(fake.starts) == 3
    code, body = fake.health()
    assert code == 503 and body["status"] == "degraded" and body["scheduler"]["state"] == "failed"
    assert "3 times" in body["scheduler"]["error"]
    fake.supervisor.poll(fake)  # stays down: no further starts
    assert len(fake.starts) == 3
    fake.start_scheduler("static")  # a policy switch starts one again: running, with a fresh budget
    fake.supervisor.poll(fake)
    assert fake.health()[0] == 200 and fake.supervisor.scheduler.state == "running"


def test_a_restart_that_fails_is_reported_not_raised(launcher):
    fake = launcher(fail_start=True)
    _kill(fake.scheduler)
    fake.supervisor.poll(fake)
    code, body = fake.health()
    assert code == 503 and body["scheduler"]["state"] == "failed" and "RuntimeError" in body["scheduler"]["error"]


def test_a_dead_ffn_worker_is_failing_not_degraded(launcher):
    fake = launcher()
    _kill(fake.ffn[0])
    code, body = fake.health()
    assert code == 503 and body["status"] == "failing" and body["dead"] == ["ffn-0"]


def test_budget_arguments_are_validated():
    with pytest.raises(ValueError, match="max_restarts"):
        SchedulerSupervisor(max_restarts=-1)
    with pytest.raises(ValueError, match="window_s"):
        SchedulerSupervisor(window_s=0)


def test_admin_health_route_answers_the_supervisors_truth(launcher):
    fake = launcher()
    server = AdminServer(fake, "127.0.0.1", 0).start()
    try:
        def get() -> tuple[int, dict]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=10) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read())

        assert get()[0] == 200
        _kill(fake.scheduler)
        code, body = get()
        assert code == 503 and body["status"] == "degraded"
        fake.supervisor.poll(fake)
        assert get()[0] == 200
    finally:
        server.stop()
