"""What one decoding step costs at each preset's real shapes, on this machine, before anything is downloaded.

    python benchmarks/preset_step_time.py --out results/presets          # every preset model, float32
    python benchmarks/preset_step_time.py --only qwen2.5-7b --context 512 --out /tmp/p

Random weights at the real widths, vocabularies and attention layouts (from ``speclab.models.presets``). A whole
8B model does not fit every machine, so each model is built twice with 1 and 3 decoder layers, and the full depth
is extrapolated: T(L) = T(1) + (L - 1) (T(3) - T(1)) / 2 (the layers are identical; embedding, final norm and LM head
are paid once). Two steps are timed after a prefill of ``--context`` tokens: a plain decode step (1 token) and a
verification step (k + 1 tokens), each the fastest of ``--repeats`` runs (the least disturbed by other work on
the machine), the cache cropped back between runs.
Prints a table; writes ``preset_step_time.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speclab.models.presets import PRESETS, Shape  # noqa: E402


def build(shape: Shape, layers: int):
    import transformers as tf

    kw = dict(hidden_size=shape.hidden, intermediate_size=shape.ffn, num_hidden_layers=layers,
              num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
              tie_word_embeddings=shape.tied, max_position_embeddings=4096)
    cfg = tf.Qwen2Config(**kw) if shape.arch == "qwen2" else tf.LlamaConfig(**kw)
    with torch.device("cpu"):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.eval().requires_grad_(False)


@torch.inference_mode()
def step_times(model, context: int, k: int, repeats: int) -> tuple[float, float]:
    """Fastest seconds of a 1-token decode step and a (k + 1)-token verification step after ``context`` tokens."""
    import inspect

    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    cache = DynamicCache()
    # transformers renamed past_key_values -> cache: pass whichever this version takes
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    model(torch.randint(V, (1, context), generator=g), **{name: cache}, use_cache=True, logits_to_keep=1)
    out = []
    for T in (1, k + 1):
        ids = torch.randint(V, (1, T), generator=g)
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            model(ids, **{name: cache}, use_cache=True)
            times.append(time.perf_counter() - t0)
            cache.crop(-T)  # back to the context
        out.append(min(times[1:]))
    return out[0], out[1]


def measure(shape: Shape, context: int, k: int, repeats: int) -> dict:
    per = {}
    for layers in (1, 3):
        model = build(shape, layers)
        per[layers] = step_times(model, context, k, repeats)
        del model
        gc.collect()
    layer = [max(0.0, (per[3][i] - per[1][i]) / 2) for i in (0, 1)]  # one decoder layer: decode, verify
    decode = per[1][0] + (shape.layers - 1) * layer[0]
    verify = per[1][1] + (shape.layers - 1) * layer[1]
    return {"decode_ms": 1e3 * decode, "verify_ms": 1e3 * verify, "parameters": shape.parameters(),
            "layer_decode_ms": 1e3 * layer[0], "rest_decode_ms": 1e3 * (per[1][0] - layer[0])}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for preset_step_time.json")
    p.add_argument("--only", nargs="*", help="preset names (default: all)")
    p.add_argument("--context", type=int, default=256, help="tokens already in the cache (default 256)")
    p.add_argument("--k", type=int, default=4, help="draft length of the verification step (default 4)")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per step, the fastest kept (default 7)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--ship", action="store_true", help="also write the table the app and `speclab models --presets` "
                   "show (speclab/models/preset_steps.json); run it on an idle machine")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.only or list(PRESETS)
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        print(f"preset_step_time: unknown preset(s) {', '.join(unknown)} (known: {', '.join(PRESETS)})",
              file=sys.stderr)
        return 2
    models: dict[str, Shape] = {}
    for n in names:
        p = PRESETS[n]
        models.setdefault(p.draft, p.draft_shape)
        models.setdefault(p.target, p.target_shape)
    rows = {}
    print(f"{'model':<36} {'params':>7} {'decode ms':>10} {'verify k=' + str(args.k) + ' ms':>14}", flush=True)
    for hub_id, shape in sorted(models.items(), key=lambda kv: kv[1].parameters()):
        r = measure(shape, args.context, args.k, args.repeats)
        rows[hub_id] = r
        print(f"{hub_id:<36} {r['parameters'] / 1e9:>6.2f}B {r['decode_ms']:>10.1f} {r['verify_ms']:>14.1f}",
              flush=True)
    pairs = {}
    for n in names:
        p = PRESETS[n]
        t, d = rows[p.target], rows[p.draft]
        # a round at k: k draft steps and one verification; plain decoding spends one target step a token
        pairs[n] = {"round_ms": args.k * d["decode_ms"] + t["verify_ms"], "plain_token_ms": t["decode_ms"],
                    "break_even_tokens_per_round": (args.k * d["decode_ms"] + t["verify_ms"]) / t["decode_ms"]}
        print(f"{n:<14} round at k={args.k}: {pairs[n]['round_ms']:.0f} ms; pays when more than "
              f"{pairs[n]['break_even_tokens_per_round']:.2f} tokens are emitted per round")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"context": args.context, "k": args.k, "repeats": args.repeats, "threads": torch.get_num_threads(),
            "dtype": "float32", "torch": torch.__version__}
    (out / "preset_step_time.json").write_text(json.dumps({"meta": meta, "models": rows, "pairs": pairs}, indent=2))
    print(f"wrote {out / 'preset_step_time.json'}")
    if args.ship:
        ship(meta, rows, pairs)
    return 0


def ship(meta: dict, rows: dict, pairs: dict) -> None:
    """The figures the app and ``speclab models --presets`` show before a download (rounded; where they came from)."""
    import platform

    path = Path(__file__).resolve().parents[1] / "speclab" / "models" / "preset_steps.json"
    doc = {"measured_on": f"{os.cpu_count()}-core {platform.machine()} CPU, {meta['threads']} torch thread(s), float32 "
                          "random weights",
           "command": "python benchmarks/preset_step_time.py --out results/presets --ship", "meta": meta,
           "models": {k: {"decode_ms": round(v["decode_ms"], 1), "verify_ms": round(v["verify_ms"], 1)}
                      for k, v in rows.items()},
           "pairs": {k: {"round_ms": round(v["round_ms"], 1), "plain_token_ms": round(v["plain_token_ms"], 1),
                         "break_even_tokens_per_round": round(v["break_even_tokens_per_round"], 2)}
                     for k, v in pairs.items()}}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
