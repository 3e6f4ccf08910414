"""Servers to measure, started as child processes: ``speclab serve`` and vLLM's OpenAI server from its own
virtual environment (see docs/vllm.md). Each runs in a process group of its own and is stopped as a group
(SIGTERM, then SIGKILL), so nothing is left behind, also when the caller fails or is interrupted (the CLI turns a
SIGTERM into an exception that unwinds to these stops: :func:`speclab.cli.exit_cleanly_on_sigterm`).

Used by ``speclab bench serve`` and the load tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ..errors import SpeclabError
from ..ports import free_port

VLLM_VENV_ENV = "SPECLAB_VLLM_VENV"
DEFAULT_VLLM_VENV = "/work/vllm-venv"


PORT_TRIES = 3


def start_server(name: str, build, port: int | None, env: dict | None, start_timeout: float) -> "ManagedServer":
    """A :class:`ManagedServer` from ``build(port)``, its command line. With ``port`` None a free one is picked, and
    if another process takes it between :func:`free_port` and the server's bind (seen in CI: several notebooks start
    servers at once, and one exited with "Address already in use"), the server is started again on a new one, up to
    :data:`PORT_TRIES` times."""
    for _ in range(PORT_TRIES - 1 if port is None else 0):
        p = free_port()
        try:
            return ManagedServer(name, build(p), p, env=env, start_timeout=start_timeout)
        except SpeclabError as e:
            if "in use" not in str(e):
                raise
    p = port or free_port()
    return ManagedServer(name, build(p), p, env=env, start_timeout=start_timeout)


class ManagedServer:
    """A server child process: ``url`` once healthy; ``stop()`` (or leaving the ``with`` block) ends it."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict | None = None, start_timeout: float = 180.0):
        self.name, self.cmd, self.port = name, cmd, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(tempfile.mkdtemp(prefix="speclab-server-")) / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        full_env = dict(os.environ, **(env or {}))
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)
        self.started_s = None
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise SpeclabError(f"{self.name} exited with status {self.proc.returncode} before it was healthy: "
                                   f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    self.started_s = time.perf_counter() - t0
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SpeclabError(f"{self.name} was not healthy after {timeout:.0f} s (log: {self.log_path}): "
                           f"{self.log_tail()}")

    def log_tail(self, lines: int = 1) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])[:400]

    def terminate(self) -> None:
        """Ask the server to stop (SIGTERM to its group) without waiting; :meth:`stop` then waits."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, grace: float = 15.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        # the group may hold children that outlive the leader (vLLM's engine core and workers)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def speclab_serve(model: str | None = None, speculative_config: dict | str | None = None, *, policy: str | None = None,
                  threads: int | None = 1, split_tokens: bool = False, port: int | None = None,
                  extra: list[str] | None = None, start_timeout: float = 180.0) -> ManagedServer:
    """Start ``python -m speclab serve`` (``speculative_config``: a dict / JSON string, "none" for plain decoding,
    None for the family default; ``port`` None: a free one, see :func:`start_server`)."""
    cmd = [sys.executable, "-m", "speclab", "serve", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    if model:
        cmd += ["--model", model]
    if speculative_config is not None:
        sc = speculative_config if isinstance(speculative_config, str) else json.dumps(speculative_config)
        cmd += ["--speculative-config", sc]
    if policy:
        cmd += ["--spec-policy", policy]
    if threads:
        cmd += ["--threads", str(threads)]
    if split_tokens:
        cmd.append("--stream-split-tokens")
    cmd += extra or []
    env = {"OMP_NUM_THREADS": str(threads)} if threads else None
    return start_server("speclab-serve", lambda p: cmd + ["--port", str(p)], port, env, start_timeout)


def vllm_venv(path: str | None = None) -> Path | None:
    """The vLLM venv to use (argument, $SPECLAB_VLLM_VENV, /work/vllm-venv), or None when it has no python."""
    p = Path(path or os.environ.get(VLLM_VENV_ENV) or DEFAULT_VLLM_VENV).expanduser()
    return p if (p / "bin" / "python").exists() else None


def vllm_serve(venv: Path, model_dir: str, speculative_config: dict | None = None, *, port: int | None = None,
               max_model_len: int = 1024, start_timeout: float = 400.0, env: dict | None = None,
               eager: bool = False) -> ManagedServer:
    """Start vLLM's OpenAI server from ``venv`` as docs/vllm.md says (fp32, offline, 1 GiB of KV cache);
    ``env``: more environment variables (e.g. ``VLLM_LOG_STATS_INTERVAL``); ``eager``: ``--enforce-eager``, no
    torch.compile warm-up (vLLM 0.32's CPU build recompiles on every start, its AOT cache failing to load: about
    25 s of a start on 2 cores), for checks that need the server's behaviour, not its speed."""
    cmd = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--dtype", "float32", "--max-model-len", str(max_model_len), "--host", "127.0.0.1"]
    template = venv / "speclab_chat_template.jinja"
    if template.exists():
        cmd += ["--chat-template", str(template)]
    if speculative_config:
        cmd += ["--speculative-config", json.dumps(speculative_config)]
    if eager:
        cmd.append("--enforce-eager")
    full_env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                **(env or {})}
    return start_server("vllm", lambda p: cmd + ["--port", str(p)], port, full_env, start_timeout)
