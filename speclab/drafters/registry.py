"""One way to get a drafter from a name: what the CLI, the app, the sweeps and the server call.

Spec strings: a name, then ``:``-separated options (keyword arguments win over them)::

    ngram                                  prompt lookup (a chain)
    ngram:tree=dynamic:nodes=8             prompt lookup, its matches merged into a tree of 8 nodes
    suffix / suffix:depth=24:factor=1:min_prob=0.1:cache=1000   suffix decoding (suffix trees over the request
                                           and earlier outputs, vLLM's method "suffix")
    draft-xs-distill:tree=dynamic:width=3  a draft model proposing EAGLE-2-style dynamic trees
    early-exit / early-exit:2 / early-exit:3:tuned   the target's first m layers (tuned: a trained exit)
    eagle / eagle:tree=dynamic:nodes=8     the EAGLE head (a chain, or a tree)
    medusa / medusa:tree=static:branch=3-2-1   the Medusa heads
    suffix-match / suffix-match:min_match=2:factor=1   the longest earlier match alone, draft length follows it
    eagle+suffix / eagle+suffix:min_match=3   the suffix draft where the context repeats, the EAGLE head elsewhere

Tree options (every drafter but early exit): ``tree`` = chain | static | dynamic, ``nodes`` (budget cap;
the round's k also caps it), ``branch`` (static: children per node per depth, e.g. 3-2-1), ``width``
(dynamic: candidates expanded per level), ``depth`` (deepest level), ``trunk`` (ranking exponent on each
node's most likely child, see :class:`~speclab.drafters.trees.TreeShape`). ``head=PATH`` loads a head
from a directory instead of the shipped one.
"""

from __future__ import annotations

import re

from ..errors import SpeclabError
from ..models import check_same_tokenizer, load_model
from .lookup import PromptLookupDrafter
from .model import ModelDrafter
from .trees import TreeShape

NONE_NAMES = ("", "none", "off", "baseline")
LOOKUP_NAMES = ("ngram", "prompt-lookup", "prompt_lookup", "pld")
SUFFIX_NAMES = ("suffix", "suffix-decoding", "suffix_decoding")  # suffix trees (speclab.drafters.suffix_tree)
SUFFIX_KEYS = {"depth": int, "max_depth": int, "factor": float, "offset": float, "min_prob": float, "cache": int,
               "min_match": int}
MATCH_NAMES = ("suffix-match",)  # the longest earlier match alone (speclab.drafters.suffix)
EXIT_NAMES = ("early-exit", "early_exit", "layerskip")
HEAD_NAMES = ("eagle", "medusa")
HYBRID_NAMES = ("eagle+suffix", "hybrid")
TREE_KEYS = ("tree", "nodes", "branch", "width", "depth", "trunk")
_OPTION = re.compile(r"^[a-z_]+=[^=]*$|^\d+$|^tuned$")


def _eagle_head(head: str, target):
    """(module, config) of an EAGLE head by name or path: speclab's own format or a speculators directory."""
    from .heads import load_head
    from .speculators import load_speculators, speculators_dir

    path = speculators_dir(head)
    if path is not None:
        return load_speculators(path, target)
    module, cfg = load_head(head, target)
    if cfg.kind != "eagle":
        raise SpeclabError(f"head '{head}' is a {cfg.kind} head, not eagle")
    return module, cfg


def is_none(spec) -> bool:
    return spec is None or str(spec).strip().lower() in NONE_NAMES


def parse_spec(spec: str) -> tuple[str, dict]:
    """'eagle:tree=dynamic:nodes=8' -> ('eagle', {'tree': 'dynamic', 'nodes': '8'}); 'early-exit:3:tuned' ->
    ('early-exit', {'m': '3', 'tuned': True}). A spec whose parts after the first are not all options (a
    path with a colon) is a name as a whole."""
    s = str(spec).strip()
    parts = s.split(":")
    if len(parts) < 2 or not all(_OPTION.match(p.strip().lower()) for p in parts[1:]):
        return s, {}
    opts: dict = {}
    for p in parts[1:]:
        p = p.strip()
        if p.isdigit():
            opts["m"] = p
        elif p.lower() == "tuned":
            opts["tuned"] = True
        else:
            key, val = p.split("=", 1)
            opts[key.lower()] = val
    return parts[0].strip(), opts


def _tree(opts: dict) -> TreeShape:
    return TreeShape.from_options(**{k: opts.pop(k) for k in TREE_KEYS if k in opts})


def _no_more(name: str, opts: dict) -> None:
    if opts:
        raise SpeclabError(f"drafter '{name}' does not take option(s) {', '.join(sorted(opts))}")


def make_drafter(spec: str | None, target, load=load_model, **kw):
    """'none' (plain target decoding: returns None), 'ngram' (prompt lookup), 'suffix' (suffix decoding),
    'early-exit[:m][:tuned]', 'eagle', 'medusa', or a draft model name / path / hub id (loaded with ``load``, e.g.
    a caching loader), each with the options above. Every drafter is fresh: drafters keep per-run state, so they
    are never shared between runs."""
    if is_none(spec):
        return None
    base, opts = parse_spec(spec)
    opts.update(kw)
    low = base.lower()
    if low in LOOKUP_NAMES:
        tree = _tree(opts)
        return PromptLookupDrafter(**{k: float(v) if k in ("recency", "decay") else int(v) for k, v in opts.items()},
                                   tree=tree)
    if low in SUFFIX_NAMES:
        from .suffix_tree import SuffixTreeDrafter

        args = {key: opts.pop(key) for key in SUFFIX_KEYS if key in opts}
        _no_more(base, opts)
        if "max_depth" in args:
            args["depth"] = args.pop("max_depth")
        try:
            return SuffixTreeDrafter(**{key: SUFFIX_KEYS[key](v) for key, v in args.items()})
        except ValueError as e:
            raise SpeclabError(f"drafter 'suffix': bad option value ({e})") from None
    if low in MATCH_NAMES:
        from .suffix import SuffixDrafter

        args = {k: float(v) if k == "factor" else int(v) for k, v in opts.items()
                if k in ("max_depth", "factor", "min_match")}
        _no_more(base, {k: v for k, v in opts.items() if k not in args})
        return SuffixDrafter(**args)
    if low in HYBRID_NAMES:
        from .heads import EagleDrafter, load_head
        from .hybrid import HybridDrafter

        min_match = int(opts.pop("min_match", 3))
        head = opts.pop("head", None) or "eagle"
        _no_more(base, opts)
        module, cfg = _eagle_head(head, target)
        return HybridDrafter(EagleDrafter(target, module, cfg, TreeShape(), name=head), min_match=min_match)
    if low.startswith("synthetic"):
        from .synthetic import SyntheticDrafter

        return SyntheticDrafter.from_spec(str(spec).strip(), target)
    if low in EXIT_NAMES:
        from .early_exit import EarlyExitDrafter

        m = opts.pop("m", None)
        tuned = bool(opts.pop("tuned", False))
        head = opts.pop("head", None)
        _no_more(base, opts)
        drafter = EarlyExitDrafter(target, None if m is None else int(m))
        if tuned or head:
            from .heads import load_head

            adapter, cfg = load_head(head or f"exit-{drafter.m}", target)
            if cfg.kind != "exit" or cfg.exit_layer != drafter.m:
                raise SpeclabError(f"head '{head or f'exit-{drafter.m}'}' is not an exit adapter for layer {drafter.m}")
            drafter = EarlyExitDrafter(target, drafter.m, adapter)
        return drafter
    if low in HEAD_NAMES:
        from .heads import EagleDrafter, MedusaDrafter, load_head

        tree = _tree(opts)
        head = opts.pop("head", None) or low
        _no_more(base, opts)
        if low == "eagle":
            return EagleDrafter(target, *_eagle_head(head, target), tree, name=low)
        module, cfg = load_head(head, target)
        if cfg.kind != low:
            raise SpeclabError(f"head '{head}' is a {cfg.kind} head, not {low}")
        return MedusaDrafter(target, module, cfg, tree, name=low)
    tree = _tree(opts)
    _no_more(base, opts)
    from .speculators import speculators_dir

    path = speculators_dir(base)
    if path is not None:  # an EAGLE-3 head in the speculators format (vLLM's, SGLang's; the family's eagle3)
        from .heads import EagleDrafter
        from .speculators import load_speculators

        module, cfg = load_speculators(path, target)
        return EagleDrafter(target, module, cfg, tree, name="eagle3")
    draft = load(base, device=target.device, dtype=target.dtype, role="draft")
    check_same_tokenizer(target, draft)
    return ModelDrafter(draft, target.vocab_size, tree)
