"""The admin endpoint (afore.serve.admin) over a stand-in launcher: routes, typed bodies, JSON
errors naming the field, the OpenAPI page; served by uvicorn on a real socket."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest

from afore.scheduler.policies import POLICY_NAMES
from afore.serve.admin import AdminServer


class FakeLauncher:
    def __init__(self, role: str = "all", fail_start: bool = False):
        self.role, self.policy, self.fail_start = role, "afore", fail_start
        self.switches: list[str] = []

    def status(self) -> dict:
        out = {"role": self.role, "policy": self.policy if self.role != "attention" else None, "model": "/m",
               "attn_workers": 1, "ffn_workers": 2,
               "data_plane": {"transport": "shm", "exact": True, "exchange": "stream", "microbatches": 1},
               "processes": {"scheduler": {"pid": 11, "alive": True}, "ffn-0": {"pid": 12, "alive": False}}}
        if self.role == "ffn":
            out["ffn_ready"] = 2
        return out

    def switch_policy(self, policy: str) -> None:
        if self.role == "attention":
            raise ValueError("policy: the scheduler runs on the FFN node (h); switch the policy at that node's admin endpoint")
        if self.fail_start:
            raise RuntimeError("scheduler exited with 1")
        self.switches.append(policy)
        self.policy = policy


def call(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def admin():
    servers = []

    def start(launcher: FakeLauncher) -> int:
        server = AdminServer(launcher, "127.0.0.1", 0).start()
        servers.append(server)
        return server.port

    yield start
    for s in servers:
        s.stop()


def test_status_is_typed_and_leaves_out_what_the_node_lacks(admin):
    port = admin(FakeLauncher())
    code, out = call(port, "GET", "/afore/status")
    assert code == 200
    assert out["policy"] == "afore" and out["processes"]["ffn-0"] == {"pid": 12, "alive": False}
    assert "ffn_ready" not in out and "ffn_node" not in out
    assert out["data_plane"] == {"transport": "shm", "exact": True, "exchange": "stream", "microbatches": 1}
    code, out = call(admin(FakeLauncher("ffn")), "GET", "/afore/status")
    assert code == 200 and out["ffn_ready"] == 2


def test_policy_switch_answers_the_new_status(admin):
    launcher = FakeLauncher()
    port = admin(launcher)
    code, out = call(port, "POST", "/afore/policy", json.dumps({"policy": "eplb"}).encode())
    assert code == 200 and out["policy"] == "eplb" and launcher.switches == ["eplb"]


@pytest.mark.parametrize(("body", "field", "says"), [
    (b'{"policy": "no-such-policy"}', "policy", "no-such-policy"),
    (b'{"policy": 3}', "policy", "expected one of"),
    (b"{}", "policy", "required"),
    (b'{"policy": "eplb", "extra": 1}', "extra", "not permitted"),
    (b"[1, 2]", "body", "object"),
    (b"{not json", "body", "malformed JSON"),
])
def test_bad_request_is_400_naming_the_field_and_changes_nothing(admin, body, field, says):
    launcher = FakeLauncher()
    port = admin(launcher)
    code, out = call(port, "POST", "/afore/policy", body)
    assert code == 400, out
    assert out["field"] == field and out["error"].startswith(f"{field}: ") and says in out["error"], out
    assert launcher.switches == [] and call(port, "GET", "/afore/status")[1]["policy"] == "afore"


def test_a_json_body_without_a_json_content_type_is_read(admin):
    launcher = FakeLauncher()
    port = admin(launcher)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/afore/policy", data=b'{"policy": "lina"}', method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:  # urllib's default: application/x-www-form-urlencoded, as curl -d
        assert r.status == 200 and json.loads(r.read())["policy"] == "lina"


def test_unknown_policy_error_lists_every_registered_policy(admin):
    code, out = call(admin(FakeLauncher()), "POST", "/afore/policy", b'{"policy": "x"}')
    assert code == 400 and all(name in out["error"] for name in POLICY_NAMES)


def test_switch_on_the_attention_node_is_400_and_a_failed_start_500(admin):
    code, out = call(admin(FakeLauncher("attention")), "POST", "/afore/policy", b'{"policy": "eplb"}')
    assert code == 400 and out["field"] == "policy" and "FFN node" in out["error"]
    code, out = call(admin(FakeLauncher(fail_start=True)), "POST", "/afore/policy", b'{"policy": "eplb"}')
    assert code == 500 and "RuntimeError: scheduler exited" in out["error"]


def test_unknown_path_is_a_json_404(admin):
    code, out = call(admin(FakeLauncher()), "GET", "/afore/nothing")
    assert code == 404 and "error" in out


def test_openapi_page_documents_both_routes(admin):
    port = admin(FakeLauncher())
    code, schema = call(port, "GET", "/openapi.json")
    assert code == 200 and {"/afore/status", "/afore/policy"} <= set(schema["paths"])
    enum = schema["components"]["schemas"]["PolicyRequest"]["properties"]["policy"]["enum"]
    assert enum == list(POLICY_NAMES)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/docs", timeout=10) as r:
        assert r.status == 200 and b"swagger" in r.read().lower()


def test_port_in_use_fails_at_start_naming_admin_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(RuntimeError, match="admin_port"):
            AdminServer(FakeLauncher(), "127.0.0.1", taken.getsockname()[1])
