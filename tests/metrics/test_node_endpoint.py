"""The FFN node's endpoint: the launcher aggregates the run's metrics directory and the admin
app serves it as /metrics on role ffn (404 pointing to the API port elsewhere)."""

import os
import subprocess
import sys

import fastapi.testclient
import pytest
from prometheus_client.parser import text_string_to_metric_families

from afore.metrics import multiprocess
from afore.serve.admin import build_app
from afore.serve.launcher import Launcher, ServeOptions


def launcher(role: str) -> Launcher:
    extra = {"ffn": dict(host="0.0.0.0", store_port=29600), "attention": dict(ffn_host="127.0.0.1", store_port=29600)}.get(role, {})
    return Launcher(ServeOptions(role=role, **extra))


def test_role_ffn_serves_every_child_on_the_admin_port():
    node = launcher("ffn")
    env = node.child_env()  # what the scheduler, FFN workers and vLLM are started with
    try:
        assert env[multiprocess.ENV] == node.metrics_dir and os.path.isdir(node.metrics_dir)
        code = "from afore.ffn.metrics import FFNMetrics; FFNMetrics(1).targets.inc(3)"
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
        client = fastapi.testclient.TestClient(build_app(node))
        resp = client.get("/metrics")
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
        fams = {f.name: f for f in text_string_to_metric_families(resp.text)}
        assert [s.value for s in fams["afore_ffn_targets"].samples] == [3.0]
    finally:
        node.shutdown()
    assert not os.path.exists(env[multiprocess.ENV]), "the run's metrics directory outlived the launcher"


@pytest.mark.parametrize("role", ["all", "attention"])
def test_other_roles_point_to_the_api_port(role):
    node = launcher(role)
    node.child_env()
    try:
        resp = fastapi.testclient.TestClient(build_app(node)).get("/metrics")
        assert resp.status_code == 404 and "API port" in resp.json()["error"]
    finally:
        node.shutdown()
