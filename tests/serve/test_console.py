"""``afore serve``'s terminal: the children's output in a log file unless --verbose, a ready
banner with everything a first request needs."""

from __future__ import annotations

import subprocess
import sys

from afore.cli import build_parser
from afore.serve.cli import options_from_args
from afore.serve.console import ChildOutput, ready_banner


def test_children_write_to_the_log_file_and_its_tail_is_readable(tmp_path):
    out = ChildOutput(verbose=False, log_file=str(tmp_path / "logs" / "serve.log"))
    for i in range(2):  # two children share the file
        subprocess.run([sys.executable, "-c", f"import sys; print('child {i} out'); print('child {i} err', file=sys.stderr)"],
                       check=True, **out.popen_kwargs())
    out.close()
    text = (tmp_path / "logs" / "serve.log").read_text()
    assert all(f"child {i} {s}" in text for i in range(2) for s in ("out", "err"))
    assert set(out.tail(2).splitlines()) == {"child 1 out", "child 1 err"}  # stdout is block-buffered: either order
    assert str(tmp_path / "logs" / "serve.log") in out.where()


def test_verbose_leaves_the_output_on_the_terminal():
    out = ChildOutput(verbose=True)
    assert out.popen_kwargs() == {} and out.path is None and out.where() == "" and out.tail() == ""


def test_default_log_is_under_the_afore_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("AFORE_CACHE_DIR", str(tmp_path))
    out = ChildOutput(verbose=False)
    assert out.path.parent == tmp_path / "logs" and out.path.suffix == ".log"
    assert not out.path.exists()  # opened on first use only


def test_cli_options_reach_serve_options():
    opts = options_from_args(build_parser().parse_args(["serve", "--verbose", "--log-file", "/tmp/x.log"]))
    assert opts.verbose and opts.log_file == "/tmp/x.log"
    assert not options_from_args(build_parser().parse_args(["serve"])).verbose


def test_banner_names_model_api_admin_metrics_and_log(tmp_path):
    text = ready_banner(role="all", model="/m/tiny", host="127.0.0.1", port=8000, admin=8001, policy="afore",
                        attn_workers=1, ffn_workers=2, log_path=tmp_path / "s.log")
    assert text.splitlines()[0].startswith("afore serve: ready")
    for want in ("/m/tiny", "http://127.0.0.1:8000/v1", "http://127.0.0.1:8001/afore/status", "http://127.0.0.1:8001/docs",
                 "http://127.0.0.1:8000/metrics", str(tmp_path / "s.log"), "policy afore"):
        assert want in text, want
    off = ready_banner(role="all", model="/m", host="0.0.0.0", port=9000, admin=-1, policy="static", attn_workers=1,
                       ffn_workers=2)
    assert "admin" not in off and "http://127.0.0.1:9000/v1" in off and "log " not in off


def test_ffn_node_banner_has_its_ports_and_metrics_on_admin():
    text = ready_banner(role="ffn", model="/m", host="0.0.0.0", port=8000, admin=8001, policy="afore", attn_workers=1,
                        ffn_workers=2, store_port=29600, demand_port=29601)
    assert "FFN node ready" in text and "29600" in text and "29601" in text and "http://127.0.0.1:8001/metrics" in text
