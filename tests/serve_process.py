"""``python -m speclab serve`` as a real process on a free port, for the tests that need one (test_serve,
test_supervision): started at once, waited for when first used, its output kept in a log file."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from speclab.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


class ServeProcess:
    """The server's stderr goes to ``log_path`` (its stdout too unless ``stdout=False``: a test that reads the
    last line the server wrote keeps stdout's buffered text out of it)."""

    def __init__(self, args: list[str], log_path: Path, stdout: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        self._ready = False
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "speclab", "serve", "--port", str(self.port), "--threads",
                                      "1", "--disable-uvicorn-access-log", *args], cwd=ROOT, env=env,
                                     stdout=self.log if stdout else subprocess.DEVNULL, stderr=self.log)

    def output(self) -> str:
        return self.log_path.read_text()

    @property
    def ready(self) -> "ServeProcess":
        """This server, once healthy."""
        if not self._ready:
            self.wait_healthy()
            self._ready = True
        return self

    def wait_healthy(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        pytest.fail(f"the server was not healthy after {timeout:.0f} s:\n{self.output()[-3000:]}")

    def stop(self) -> None:
        """SIGTERM, if it still runs (stopping several at once: each takes seconds to exit)."""
        if self.proc.poll() is None:
            self.proc.terminate()

    def close(self) -> None:
        self.stop()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
