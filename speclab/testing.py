"""Tiny random-weight model families, built locally from a config: the one builder behind the tests,
the notebooks' CI mode and app development without trained weights.

Each model is saved with its tokenizer and loaded back through :func:`speclab.models.load_model`, the
path a user's model takes. Drafts are the target's weights plus Gaussian noise (more noise, lower
acceptance); a model with another tokenizer exercises the mismatch check.
"""

from __future__ import annotations

from pathlib import Path

CHARS = "abcdefghijklmnopqrstuvwxyz .,"


def char_tokenizer(chars: str = CHARS):
    """One token per character plus ``<eos>`` (the last id): small vocabularies for exact enumeration."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(chars)}
    vocab["<eos>"] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


def bpe_tokenizer(vocab_size: int, texts: list[str] | None = None):
    """A byte-level BPE (the family's trainer) on ``texts``, by default the bundled workload prompts."""
    from .family.tokenizer import hf_tokenizer, train_tokenizer
    from .workloads import load_all

    if texts is None:
        texts = [p.prompt for ps in load_all().values() for p in ps]
    return hf_tokenizer(train_tokenizer(texts, vocab_size), max_length=1024)


def tiny_from_config(path, cfg, tokenizer, *, seed: int = 0, base_state=None, noise: float = 0.0,
                     head_scale: float = 1.0, never_eos: bool = False, dtype=None):
    """A random model of any architecture from its config, saved at ``path`` with ``tokenizer``.
    ``base_state`` + ``noise``: a perturbed copy of another model (noise x each tensor's std);
    ``head_scale`` sharpens the LM head (a random model that prefers some tokens strongly, so greedy
    argmax is never a near-tie); ``never_eos`` zeroes the EOS row of the head (rows run their budget)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg).float().eval()
    if dtype is not None:
        m = m.to(dtype)
    with torch.no_grad():
        if base_state is not None:
            m.load_state_dict(base_state)
            if noise:
                g = torch.Generator().manual_seed(seed)
                for p in m.parameters():
                    p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * noise * p.std().clamp(min=1e-3))
        else:
            head = m.get_output_embeddings().weight
            if head_scale != 1.0:
                head.mul_(head_scale)
            if never_eos:
                head[cfg.eos_token_id] = 0.0
    Path(path).mkdir(parents=True, exist_ok=True)
    m.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return m


def tiny_llama(path, tokenizer, *, seed: int = 0, vocab_size: int | None = None, layers: int = 2, hidden: int = 64,
               heads: int = 4, kv_heads: int = 4, ffn: int | None = None, max_pos: int = 512, init: float = 0.02,
               eos: int | None = None, base_state=None, noise: float = 0.0, head_scale: float = 1.0,
               dtype=None):
    """A random Llama (see :func:`tiny_from_config`)."""
    from transformers import LlamaConfig

    V = vocab_size or len(tokenizer)
    eos = eos if eos is not None else tokenizer.eos_token_id
    cfg = LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=ffn or 2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                      initializer_range=init, eos_token_id=eos, bos_token_id=eos, pad_token_id=eos,
                      tie_word_embeddings=False)
    return tiny_from_config(path, cfg, tokenizer, seed=seed, base_state=base_state, noise=noise,
                            head_scale=head_scale, dtype=dtype)


def tiny_family(out_dir, *, seed: int = 0, vocab: int = 512, hidden: int = 64, layers: int = 2, init: float = 0.1,
                head_scale: float = 1.0, max_pos: int = 1024, target: str = "tiny-target",
                drafts: dict[str, float] | None = None, mismatch: str | None = None) -> dict[str, str]:
    """A target, drafts that are the target plus noise (``{name: noise}``; more noise, lower acceptance),
    and optionally a model with a different tokenizer (``mismatch``: its name). One BPE tokenizer, trained
    on the bundled workloads, is shared by target and drafts. Returns ``{name: directory}``; directories
    that already hold a model are reused."""
    drafts = drafts if drafts is not None else {"tiny-draft": 0.03, "tiny-draft-noisy": 0.15}
    out = Path(out_dir)
    names = [target, *drafts] + ([mismatch] if mismatch else [])
    dirs = {n: str(out / n) for n in names}
    if all((Path(d) / "model.safetensors").is_file() for d in dirs.values()):
        return dirs
    tok = bpe_tokenizer(vocab)
    kw = dict(layers=layers, hidden=hidden, ffn=3 * hidden, max_pos=max_pos, init=init)
    base = tiny_llama(dirs[target], tok, seed=seed, head_scale=head_scale, **kw)
    for i, (name, noise) in enumerate(drafts.items()):
        tiny_llama(dirs[name], tok, seed=seed + 1 + i, base_state=base.state_dict(), noise=noise, **kw)
    if mismatch:
        other = bpe_tokenizer(max(64, vocab * 3 // 5), [t[::-1] for t in _texts()] + ["alt"])
        tiny_llama(dirs[mismatch], other, seed=seed + 99, **kw)
    return dirs


def _texts() -> list[str]:
    from .workloads import load_all

    return [p.prompt for ps in load_all().values() for p in ps]
