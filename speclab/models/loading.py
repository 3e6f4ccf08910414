"""Loading a causal LM: an embedded family name, a local Hugging Face directory or a hub id.

Safetensors only, ``trust_remote_code`` off, no network for anything already on disk, and every
failure one line (:class:`speclab.errors.SpeclabError`). Llama-architecture models take the native
backend; the other architectures of the exactness suite take the generic one; anything whose cache
cannot be rolled back exactly is refused here, with its name and the reason, before its weights are read.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import torch

# at import time, not inside load_model: transformers resolves these names lazily, and two threads resolving
# them at once (two app users loading models) can see a half-initialised module ("cannot import name")
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from ..errors import SpeclabError
from .hf_backend import rollback_problem
from .lm import LM, default_device
from .native_llama import native_supported
from .presets import offline_error
from .presets import resolve as resolve_preset

_LOAD_LOCK = threading.RLock()
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def _resolve_family(name: str) -> Path | None:
    try:
        from .. import family
    except ImportError:
        return None
    try:
        return family.resolve(name)
    except Exception:
        return None


def _family_names() -> list[str]:
    try:
        from .. import family

        return [m["name"] for m in family.list_models()]
    except Exception:
        return []


def _check_hub_reachable(spec: str, what: str, timeout: float = 3.0) -> None:
    """Fail in seconds, in one line, when the hub cannot be reached (instead of minutes of retries)."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise SpeclabError(f"cannot load {what} '{spec}': not a shipped model or local directory, not in the "
                           f"local cache, and HF_HUB_OFFLINE is set")
    try:
        from huggingface_hub import constants

        url = urlparse(constants.ENDPOINT)
    except Exception:  # noqa: BLE001
        url = urlparse("https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        raise SpeclabError(f"cannot load {what} '{spec}': not a shipped model or local directory, not in the "
                           f"local cache, and the hub ({host}) is unreachable from here") from None


def load_model(spec: str, *, device: str | torch.device | None = None, dtype: torch.dtype | str | None = None,
               backend: str = "auto", role: str = "model") -> LM:
    """Load an embedded family model by short name, a local HF directory, or a hub id.

    Safetensors only, ``trust_remote_code`` off. Any failure is a one-line :class:`SpeclabError`.
    """
    hf_logging.disable_progress_bar()  # a loading bar per model is noise in a CLI, an app and a notebook

    what = role if role == "model" else f"{role} model"  # "model 'x'", "draft model 'x'"
    if not spec or not str(spec).strip():
        raise SpeclabError(f"no {what} given")
    spec = str(spec)
    device = torch.device(device) if device is not None else default_device()
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    fam = _resolve_family(spec)
    preset = None if fam is not None or os.path.isdir(os.path.expanduser(spec)) else resolve_preset(spec, role)
    if fam is not None:
        source, local, name = str(fam), True, spec
    elif preset is not None:  # a curated pair's name: its target, or its draft when loaded as a draft
        source, local, name = preset[0], False, preset[0]
    elif os.path.isdir(os.path.expanduser(spec)):
        source, local, name = os.path.expanduser(spec), True, os.path.basename(os.path.normpath(spec))
    elif HUB_ID.match(spec) and not spec.startswith((".", "/", "~")):
        source, local, name = spec, False, spec
    else:
        known = ", ".join(_family_names()) or "none shipped yet"
        raise SpeclabError(f"unknown {what} '{spec}': not a shipped model ({known}), "
                           f"not a local directory, not a hub id")
    # one load at a time: from_pretrained builds on torch's global meta-device context, which two threads
    # (two app users) would corrupt for each other ("cannot copy out of meta tensor")
    with _LOAD_LOCK:
        try:
            p = preset[1] if preset else None
            tok, config = _from_cache_or_hub(lambda offline: _tokenizer_and_config(source, offline), source, what,
                                             local, p)
            backend = _choose_backend(config, backend, what, spec)  # refusals come before any weights are read
            model = _from_cache_or_hub(lambda offline: AutoModelForCausalLM.from_pretrained(
                source, config=config, local_files_only=offline, use_safetensors=True, dtype=dtype,
                attn_implementation=attention_implementation(config), trust_remote_code=False), source, what, local,
                p)
        except SpeclabError:
            raise
        except Exception as e:  # noqa: BLE001 - any loader failure becomes one line
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SpeclabError(f"cannot load {what} '{spec}' from {source}: {msg[:300]}") from None
        model.to(device).eval()
        model.requires_grad_(False)
        return LM(name, source, model, tok, backend)


def _from_cache_or_hub(load, spec: str, what: str, local: bool, preset=None):
    """``load(offline=True)`` first: a hub id may already be in the local cache, and then the network is
    never touched; a hub id that is not gets one reachability check, then ``load(offline=False)``. A preset's
    files are fetched first with the hub's progress bar (gigabytes: a user should see them coming), and its
    offline failure names the preset and the fallback."""
    try:
        return load(True)
    except SpeclabError:
        raise
    except Exception:
        if local:
            raise
        try:
            _check_hub_reachable(spec, what)
        except SpeclabError:
            if preset is None:
                raise
            offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
            raise offline_error(preset, spec, "HF_HUB_OFFLINE forbids" if offline else
                                "is unreachable from here and not in the local cache") from None
        if preset is not None:
            _download(spec)
        return load(False)


def _download(repo_id: str) -> None:
    """The files a causal LM needs (config, tokenizer, safetensors), with huggingface_hub's progress bars."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import enable_progress_bars

    enable_progress_bars()
    snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"])


def _tokenizer_and_config(source: str, offline: bool):
    kw = dict(local_files_only=offline, trust_remote_code=False)
    return AutoTokenizer.from_pretrained(source, **kw), AutoConfig.from_pretrained(source, **kw)


def _choose_backend(config, backend: str, what: str, spec: str) -> str:
    """The backend for this config ("native" or "hf"), or a one-line refusal naming the model and the reason."""
    mt = getattr(config, "model_type", "?")
    if backend not in ("auto", "native", "hf"):
        raise SpeclabError(f"unknown backend '{backend}' (known: auto, native, hf)")
    if backend == "auto":
        backend = "native" if native_supported(config) else "hf"
    elif backend == "native" and not native_supported(config):
        raise SpeclabError(f"{what} '{spec}' ({mt}) has no native backend; use backend='hf'")
    if backend == "hf":
        problem = rollback_problem(config)
        if problem:
            raise SpeclabError(f"cannot use {what} '{spec}' ({mt}): {problem}")
    return backend


def attention_implementation(config) -> str:
    """SDPA where the architecture supports it, else eager (e.g. Gemma-2: SDPA cannot softcap attention
    logits). Never flash attention: it ignores the 4-D position masks the generic backend relies on,
    whatever the checkpoint's config asks for."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if getattr(config, "attn_logit_softcapping", None):  # SDPA would silently skip the soft cap (Gemma-2/3)
        return "eager"
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", False) else "eager"
