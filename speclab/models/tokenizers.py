"""Do a draft and a target speak the same tokens? Compare token -> id maps, never vocab sizes alone
(padded LM heads make sizes differ for the same tokenizer)."""

from __future__ import annotations

from ..errors import SpeclabError


def check_same_tokenizer(target, draft) -> None:
    """Same tokenizer means the same token -> id map; vocab_size alone says nothing (padded heads)."""
    if target.vocab_map() != draft.vocab_map():
        a, b = target.vocab_map(), draft.vocab_map()
        differing = len(set(a.items()) ^ set(b.items()))
        raise SpeclabError(
            f"draft '{draft.name}' and target '{target.name}' use different tokenizers "
            f"({len(b)} vs {len(a)} tokens, {differing} token->id entries differ); "
            f"a draft must share the target's tokenizer")


def check_draft_context(target, draft, needed: int) -> None:
    """A draft must hold every position the run needs: refused up front, not mid-run."""
    if draft.max_context < needed:
        raise SpeclabError(f"draft '{draft.name}' has a context of {draft.max_context} tokens, but this run needs "
                           f"{needed} (target '{target.name}': {target.max_context}); use a draft with a longer "
                           f"context or shorter prompts / max_new_tokens")
