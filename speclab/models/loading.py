"""Loading a causal LM: an embedded family name, a local Hugging Face directory or a hub id.

Safetensors only, ``trust_remote_code`` off, no network for anything already on disk, and every
failure one line (:class:`speclab.errors.SpeclabError`). Llama-architecture models take the native
backend; the other architectures of the exactness suite take the generic one; anything whose cache
cannot be rolled back exactly is refused here, with its name and the reason.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from ..errors import SpeclabError
from .hf_backend import rollback_problem
from .lm import LM, default_device
from .native_llama import native_supported

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


def _check_hub_reachable(spec: str, role: str, timeout: float = 3.0) -> None:
    """Fail in seconds, in one line, when the hub cannot be reached (instead of minutes of retries)."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise SpeclabError(f"cannot load {role} model '{spec}': not a shipped model or local directory, not in the "
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
        raise SpeclabError(f"cannot load {role} model '{spec}': not a shipped model or local directory, not in the "
                           f"local cache, and the hub ({host}) is unreachable from here") from None


def load_model(spec: str, *, device: str | torch.device | None = None, dtype: torch.dtype | str | None = None,
               backend: str = "auto", role: str = "model") -> LM:
    """Load an embedded family model by short name, a local HF directory, or a hub id.

    Safetensors only, ``trust_remote_code`` off. Any failure is a one-line :class:`SpeclabError`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a loading bar per model is noise in a CLI, an app and a notebook

    if not spec or not str(spec).strip():
        raise SpeclabError(f"no {role} model given")
    spec = str(spec)
    device = torch.device(device) if device is not None else default_device()
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    fam = _resolve_family(spec)
    if fam is not None:
        source, local, name = str(fam), True, spec
    elif os.path.isdir(os.path.expanduser(spec)):
        source, local, name = os.path.expanduser(spec), True, os.path.basename(os.path.normpath(spec))
    elif HUB_ID.match(spec) and not spec.startswith((".", "/", "~")):
        source, local, name = spec, False, spec
    else:
        known = ", ".join(_family_names()) or "none shipped yet"
        raise SpeclabError(f"unknown {role} model '{spec}': not a shipped model ({known}), "
                           f"not a local directory, not a hub id")
    kw = dict(trust_remote_code=False)
    try:
        try:  # a hub id may already be in the local cache: never touch the network for it
            tok = AutoTokenizer.from_pretrained(source, local_files_only=True, **kw)
            model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True, use_safetensors=True,
                                                         dtype=dtype, attn_implementation="sdpa", **kw)
        except Exception:
            if local:
                raise
            _check_hub_reachable(spec, role)
            tok = AutoTokenizer.from_pretrained(source, **kw)
            model = AutoModelForCausalLM.from_pretrained(source, use_safetensors=True, dtype=dtype,
                                                         attn_implementation="sdpa", **kw)
    except SpeclabError:
        raise
    except Exception as e:  # noqa: BLE001 - any loader failure becomes one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpeclabError(f"cannot load {role} model '{spec}' from {source}: {msg[:300]}") from None
    model.to(device).eval()
    model.requires_grad_(False)
    if backend == "auto":
        backend = "native" if native_supported(model.config) else "hf"
    elif backend == "native" and not native_supported(model.config):
        raise SpeclabError(f"{role} model '{spec}' ({model.config.model_type}) has no native backend; use backend='hf'")
    if backend == "hf":
        problem = rollback_problem(model.config)
        if problem:
            raise SpeclabError(f"cannot use {role} model '{spec}' ({model.config.model_type}): {problem}")
    return LM(name, source, model, tok, backend)
