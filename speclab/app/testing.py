"""Helpers for the app's tests (and for developing the app before the embedded family exists): the
models to use (the shipped family, else a tiny family from :mod:`speclab.testing`) and a launcher
that starts ``python app.py`` on a free local port.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..ports import free_port

REPO = Path(__file__).resolve().parents[2]


def family_models() -> dict[str, str] | None:
    """{'target', 'draft', 'mismatch'} names of the shipped family when its weights are present."""
    try:
        from speclab.family import DEFAULT_TARGET, list_models

        names = {m["name"]: m for m in list_models()}
    except Exception:
        return None
    if DEFAULT_TARGET not in names:
        return None
    # the weakest draft gives the most rejections (tests want both kinds of token)
    drafts = [n for n in ("draft-xs", "draft-s", "draft-distill") if n in names]
    drafts += [n for n, m in names.items() if m.get("role") in ("draft", "distilled-draft") and n not in drafts]
    if not drafts:
        return None
    mism = [n for n, m in names.items() if m.get("role") == "mismatched"]
    return {"target": DEFAULT_TARGET, "draft": drafts[0], "mismatch": mism[0] if mism else None}


def build_tiny_models(out: str | Path, seed: int = 0) -> dict[str, str]:
    """A tiny random target, a draft that is the target plus noise (accepts often, not always), and a
    model with a different tokenizer. Returns {'target', 'draft', 'mismatch'} -> directory."""
    from speclab.testing import tiny_family

    return tiny_family(out, seed=seed, vocab=384, init=0.02, head_scale=8.0, max_pos=512, target="target",
                       drafts={"draft": 0.35}, mismatch="mismatch")


def models_for_tests(tmp_dir: str | Path) -> dict[str, str | None]:
    """The family when shipped, else tiny random models built under ``tmp_dir``."""
    fam = family_models()
    if fam is not None:
        return fam
    return build_tiny_models(tmp_dir)


class AppProcess:
    """``python app.py ...`` in a subprocess on 127.0.0.1:<free port>."""

    def __init__(self, args: list[str], env: dict | None = None, timeout: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        e = dict(os.environ)
        e.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                  "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
        e.update(env or {})
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"speclab-app-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, str(REPO / "app.py"), "--port", str(self.port), *args],
                                     cwd=str(REPO), env=e, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"app exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                time.sleep(0.5)
        else:
            self.close()
            raise RuntimeError(f"app did not start in {timeout:.0f}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
