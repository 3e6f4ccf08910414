"""The loaded model: a causal LM, its tokenizer and its backend, ready for the decoder."""

from __future__ import annotations

import torch

from .hf_backend import HFKVCache
from .native_llama import NativeLlama

# The embedded family has no chat template of its own; this plain one (also given to vLLM with
# --chat-template, so both servers see the same prompt) renders messages as "role: content" lines.
PLAIN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _ids(x) -> list[int]:
    if x is None:
        return []
    return [int(i) for i in (x if isinstance(x, (list, tuple)) else [x])]


class LM:
    """A causal LM with its tokenizer. ``backend`` is "native" (our Llama forward) or "hf"."""

    def __init__(self, name: str, path: str, hf_model, tokenizer, backend: str):
        self.name = name
        self.path = path
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.config = hf_model.config
        self.device = hf_model.device
        self.dtype = hf_model.dtype
        self.backend = backend
        self.native = NativeLlama(hf_model) if backend == "native" else None
        self.vocab_size = hf_model.get_output_embeddings().weight.shape[0]
        cfg = self.config
        self.max_context = int(getattr(cfg, "max_position_embeddings", 0) or getattr(cfg, "n_positions", 0) or
                               getattr(tokenizer, "model_max_length", 0) or 2048)
        self.hidden_size = int(getattr(cfg, "hidden_size", 0) or getattr(cfg, "n_embd", 0))
        self.n_layers = int(getattr(cfg, "num_hidden_layers", 0) or getattr(cfg, "n_layer", 0))
        # every id that ends a row: the tokenizer's, the config's and the generation config's (lists allowed)
        gen = getattr(hf_model, "generation_config", None)
        eos: list[int] = []
        for src in (tokenizer.eos_token_id, cfg.eos_token_id, getattr(gen, "eos_token_id", None)):
            eos += [i for i in _ids(src) if i not in eos]
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self._vocab_key = None
        self._token_text: dict[int, str] = {}

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id (for APIs that take one); every id in ``eos_token_ids`` stops a row."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @eos_token_id.setter
    def eos_token_id(self, value: int | None) -> None:
        self.eos_token_ids = tuple(_ids(value))

    def __repr__(self) -> str:
        return f"LM({self.name!r}, backend={self.backend}, params={self.num_parameters():,})"

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.hf_model.parameters())

    def new_cache(self, capacity: int, max_len: int):
        """A rollback-by-length KV cache for up to ``capacity`` rows of ``max_len`` slots."""
        if self.native is not None:
            return self.native.new_cache(capacity, max_len)
        return HFKVCache(self.hf_model, capacity, max_len)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        s = self._token_text.get(token)
        if s is None:
            s = self._token_text[token] = self.tokenizer.decode([token])
        return s

    def vocab_map(self) -> dict[str, int]:
        if self._vocab_key is None:
            self._vocab_key = self.tokenizer.get_vocab()
        return self._vocab_key

    @property
    def chat_template(self) -> str:
        """The tokenizer's chat template, or :data:`PLAIN_CHAT_TEMPLATE` when it has none."""
        return getattr(self.tokenizer, "chat_template", None) or PLAIN_CHAT_TEMPLATE

    def apply_chat(self, messages: list[dict]) -> str:
        """Messages ({role, content}) rendered as a prompt ending where the assistant's reply starts."""
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=True)
