"""What the tabs share: the Space's GPU decorator, the page's CSS, lenient components, one-line errors, Run and
Stop, model labels, and :class:`Shared` (what every tab starts from)."""

from __future__ import annotations

import html
import logging
import os
import time
import traceback
from dataclasses import dataclass

import gradio as gr

from ...errors import SpeclabError
from .. import config, jobs
from ..config import AppConfig

log = logging.getLogger("speclab.app")

try:  # Hugging Face ZeroGPU: a GPU is attached while a decorated function runs
    import spaces  # type: ignore

    def gpu(duration: int = 120):
        return spaces.GPU(duration=duration)
except ImportError:  # anywhere else: a no-op
    def gpu(duration: int = 120):
        return lambda fn: fn


CSS = """
.speclab-rowhead { font-size: 12px; color: #57606a; margin: 10px 0 2px 0; font-family: ui-sans-serif, system-ui; }
.speclab-rows { max-height: 640px; overflow-y: auto; }
.speclab-status { min-height: 1.5em; }
.speclab-error { color: #cf222e; font-weight: 600; }
/* a table's header reads whole: Gradio sizes a column by its cells, so a column of empty or short cells beside a
   long one (the advisor's flags) would break its header letter by letter; the table scrolls sideways instead */
.header-cell { min-width: max-content !important; }
.header-cell .header.text {
  word-break: normal !important; overflow-wrap: normal !important; white-space: nowrap !important;
}
"""



def lenient(comp):
    """Let out-of-range or off-list values sent through the API reach the handler, which validates
    them itself and answers with a readable message (instead of Gradio's generic error)."""
    orig = comp.preprocess

    def preprocess(payload):
        try:
            return orig(payload)
        except Exception:  # noqa: BLE001 - validated by the handler
            return payload

    comp.preprocess = preprocess
    return comp


def one_line(e: BaseException) -> str:
    """The page's one line for an error: a SpeclabError as it is, anything else logged with its traceback and named."""
    if isinstance(e, SpeclabError):
        return str(e)
    log.error("unexpected error in the app:\n%s", "".join(traceback.format_exception(e)))
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"internal error ({type(e).__name__}{': ' + msg[:200] if msg else ''}); the app keeps running"


def error_md(msg: str) -> str:
    """One line in the page, in the error colour (the message escaped)."""
    return f'<div class="speclab-error">⚠ {html.escape(msg)}</div>'


def run_and_stop(run_btn, stop_btn, fn, inputs: list, outputs: list, gate, name: str) -> None:
    """A tab's Run (one run at a time, as API ``name``) and Stop (ends it; the status, ``outputs[0]``, says so
    after the run's last update)."""
    ev = run_btn.click(fn, inputs + [gate], outputs, api_name=name, concurrency_limit=1, concurrency_id=name)
    stop_button(stop_btn, gate, outputs[0], f"⏹ {name} stopped", [ev])


def stop_button(stop_btn, gate, status, said: str, cancels: list) -> None:
    """Stop: cancel ``cancels``, end the run the ``gate`` guards, say ``said`` in ``status``; then say it again once
    updates the run had already sent have landed (:func:`restate`)."""
    stop_btn.click(lambda g: stop(g, said), gate, status, cancels=cancels, api_visibility="private").then(
        lambda g: restate(g, said), gate, status, api_visibility="private")


def stop(gate: jobs.StopGate, said: str) -> str:
    """Stop: end the tab's run, then say so (after its last update, never before)."""
    if gate.stop():
        return said
    return said + " (still finishing its current step)"


def restate(gate: jobs.StopGate, said: str):
    """Say "stopped" again a moment after Stop. An update the run yielded just before Stop travels on the run's own
    stream, and the page may get it after Stop's answer, which travels on another: in CI a round's status landed
    after "stopped" and the page said "decoding" for good. Safe: the gate refuses runs for ``QUIET_S`` after a stop,
    so no new run's status can be overwritten this soon; if one is going anyway, nothing is said."""
    time.sleep(0.6 * jobs.StopGate.QUIET_S)
    return said if gate.idle else gr.skip()


def label(name: str, role: str = "target") -> str:
    """How a model is named in the page: the family's label for it, a preset's hub model and download, a
    directory's last part, or as given."""
    if name in config.DRAFT_LABELS:
        return config.DRAFT_LABELS[name]
    hub = config.preset_label(name, role)
    if hub is not None:
        return hub
    return os.path.basename(os.path.normpath(name)) if os.path.isdir(name) else name


@dataclass(frozen=True)
class Shared:
    """What every tab starts from: the app's configuration, the workloads' example prompts, the first screen's
    workload and prompt, the policies, and the model choices."""

    cfg: AppConfig
    examples: dict
    workloads: list
    first_wl: str | None
    first_prompt: str
    policies: list
    custom: bool
    custom_info: str
    target_choices: list
    draft_choices: list
