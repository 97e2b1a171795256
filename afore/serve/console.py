"""What ``afore serve`` shows on its terminal: its own progress and the ready banner, last.

The children's start-up output (vLLM's model loading, compilation and request logs, the FFN
workers' and the scheduler's) goes to one log file unless ``--verbose``; a failure or a child's
exit names that file and shows its last lines.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import IO


def default_log_path() -> Path:
    """<afore cache>/logs/serve-<UTC date-time>-<pid>.log (the cache: ``afore.models.tiny.cache_dir``)."""
    from afore.models.tiny import cache_dir

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return cache_dir() / "logs" / f"serve-{stamp}-{os.getpid()}.log"


class ChildOutput:
    """Where the children's stdout and stderr go: the terminal (``verbose``) or one log file,
    opened on first use (append, line-buffered) and shared by every child."""

    def __init__(self, verbose: bool, log_file: str = ""):
        self.verbose = verbose
        self.path: Path | None = None if verbose else Path(log_file).expanduser() if log_file else default_log_path()
        self._file: IO[str] | None = None

    def popen_kwargs(self) -> dict:
        """``stdout``/``stderr`` for ``subprocess.Popen`` of a child ({} when verbose)."""
        if self.path is None:
            return {}
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)  # noqa: SIM115  (open for the whole run)
        return {"stdout": self._file, "stderr": subprocess.STDOUT}

    def tail(self, lines: int = 20) -> str:
        """The log's last ``lines`` lines ("" when verbose or nothing was written)."""
        if self.path is None or not self.path.is_file():
            return ""
        with open(self.path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            text = fh.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def where(self) -> str:
        """' (log: PATH)' to append to a message about a child, or ''."""
        return f" (log: {self.path})" if self.path is not None else ""

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def ready_banner(*, role: str, model: str, host: str, port: int, admin: int, policy: str, attn_workers: int,
                 ffn_workers: int, ffn_host: str = "", store_port: int = 0, demand_port: int = 0,
                 log_path: Path | None = None) -> str:
    """The lines printed once this node is up: what it serves and where (API, admin, metrics, log).

    ``admin`` < 0: the admin endpoint is off. Metrics: vLLM's /metrics on the API port carries
    afore's families; the FFN node (no vLLM) serves them on its admin port.
    """
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    admin_url = f"http://{shown}:{admin}" if admin >= 0 else ""
    if role == "ffn":
        lines = [f"afore serve: FFN node ready (F={ffn_workers}, policy {policy}); waiting for the attention node (A={attn_workers})",
                 f"  model      {model}",
                 f"  transport  store on port {store_port}, demand receiver on port {demand_port}"]
        if admin_url:
            lines += [f"  admin      {admin_url}/afore/status  (POST /afore/policy to switch; API docs {admin_url}/docs)",
                      f"  metrics    {admin_url}/metrics"]
    else:
        where = f"FFN node {ffn_host}" if role == "attention" else f"F={ffn_workers}, policy {policy}"
        api = f"http://{shown}:{port}"
        lines = [f"afore serve: ready (A={attn_workers}, {where})",
                 f"  model      {model}  (the \"model\" of API requests)",
                 f"  API        {api}/v1  (OpenAI-compatible: {api}/v1/completions, {api}/v1/chat/completions)"]
        if admin_url:
            lines.append(f"  admin      {admin_url}/afore/status  (POST /afore/policy to switch; API docs {admin_url}/docs)")
        lines.append(f"  metrics    {api}/metrics")
    if log_path is not None:
        lines.append(f"  log        {log_path}  (vLLM and worker output; --verbose shows it here)")
    lines.append("  stop       Ctrl-C")
    return "\n".join(lines)
