"""A family model as a Hugging Face directory: its Llama config from a spec, a fresh model, and saving and
loading the directory (fp16 storage, fp32 compute, the tokenizer beside it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from .specs import ModelSpec
from .tokenizer import save_hf_tokenizer


def make_config(spec: ModelSpec, vocab_size: int, eot_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=spec.hidden, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.heads, intermediate_size=spec.ffn,
        max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        attention_bias=False, mlp_bias=False, hidden_act="silu", initializer_range=0.02,
        bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id,
    )


def new_model(spec: ModelSpec, vocab_size: int, eot_id: int, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(make_config(spec, vocab_size, eot_id))
    model.config._attn_implementation = "sdpa"
    return model


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied embeddings counted once


def save_model_dir(model, tok, directory: Path) -> None:
    """HF directory: config.json (fp32 compute dtype), model.safetensors (fp16 storage), tokenizer."""
    import copy

    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    m = copy.deepcopy(model).to("cpu", torch.float16)
    m.save_pretrained(str(tmp), safe_serialization=True)
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for k in ("dtype", "torch_dtype"):
        if k in cfg:
            cfg[k] = "float32"
    cfg.pop("_attn_implementation", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_hf_tokenizer(tok, tmp)
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)


def load_model_dir(directory: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    return model
