"""Models: loading and resolution (:mod:`.loading`), the loaded model (:mod:`.lm`), the native Llama
forward (:mod:`.native_llama`), the generic Hugging Face backend (:mod:`.hf_backend`) and tokenizer
checks (:mod:`.tokenizers`)."""

from .lm import LM, PLAIN_CHAT_TEMPLATE, default_device
from .loading import load_model
from .native_llama import StepOut
from .tokenizers import check_draft_context, check_same_tokenizer

__all__ = ["LM", "PLAIN_CHAT_TEMPLATE", "StepOut", "check_draft_context", "check_same_tokenizer", "default_device",
           "load_model"]
