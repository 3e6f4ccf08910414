"""How good a trained target's samples are: distinct 2-grams, and whether code continuations parse as Python."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .model_dir import load_model_dir


def distinct_2(ids: list[int]) -> float:
    grams = list(zip(ids, ids[1:]))
    return len(set(grams)) / max(1, len(grams))


def looks_like_python(text: str) -> bool:
    """Heuristic: the prompt+continuation, cut at its last complete line, parses after dropping up to
    four trailing lines and closing an open block with ``pass``."""
    import ast

    lines = text.split("\n")[:-1] if "\n" in text else [text]
    for drop in range(0, 5):
        cand = lines[: len(lines) - drop] if drop else lines
        if not cand:
            break
        src = "\n".join(cand)
        for suffix in ("", "\n" + " " * (len(cand[-1]) - len(cand[-1].lstrip()) + 4) + "pass"):
            try:
                ast.parse(src + suffix)
                return True
            except SyntaxError:
                pass
            except Exception:
                break
    return False


def python_line_rate(text: str) -> float:
    """Share of non-blank lines that are valid Python on their own: statements that parse (a block
    opener gets a ``pass`` body, ``else``/``except``/... get their head, an unclosed call its closers),
    comments, and lines inside a triple-quoted string (docstrings)."""
    import ast

    closers = {"(": ")", "[": "]", "{": "}"}
    ok = total = 0
    in_str = False
    for raw in text.split("\n"):
        line = raw.strip()
        if not line:
            continue
        total += 1
        quotes = line.count('"""') + line.count("'''")
        if in_str or quotes:
            ok += 1
            if quotes % 2:
                in_str = not in_str
            continue
        if line.startswith("#"):
            ok += 1
            continue
        cand = line
        for head, prefix in (("elif ", "if 0: pass\n"), ("else", "if 0: pass\n"), ("except", "try: pass\n"),
                             ("finally", "try: pass\n")):
            if cand.startswith(head):
                cand = prefix + cand
                break
        if cand.endswith(":"):
            cand += " pass"
        stack = []
        for ch in line:
            if ch in closers:
                stack.append(closers[ch])
            elif stack and ch == stack[-1]:
                stack.pop()
        cand = cand.rstrip(",") + "".join(reversed(stack))
        if cand.startswith(("return", "yield", "await")):
            cand = "def f():\n " + cand
        elif cand.startswith(("break", "continue")):
            cand = "while 1:\n " + cand
        try:
            ast.parse(cand)
            ok += 1
        except (SyntaxError, ValueError):
            pass
    return ok / total if total else 0.0


def quality_report(model_dir: Path, prompts: list[str], code_prompts: list[str] | None = None,
                   max_new_tokens: int = 128, temperature: float = 0.8, seed: int = 0) -> dict:
    """Samples ``max_new_tokens`` at ``temperature`` with HF ``generate`` and reports the mean fraction
    of distinct 2-grams, the share of samples above 0.5, and (code prompts) how many parse as Python."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_model_dir(model_dir).eval()
    d2, samples, parsed = [], [], []
    code_prompts = code_prompts or []
    for i, p in enumerate(list(prompts) + list(code_prompts)):
        torch.manual_seed(seed + i)
        enc = tok(p, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 pad_token_id=tok.eos_token_id)
        new = out[0, enc["input_ids"].shape[1]:].tolist()
        d2.append(distinct_2(new))
        text = tok.decode(new)
        samples.append({"prompt": p[-200:], "continuation": text, "distinct_2": round(d2[-1], 3)})
        if i >= len(prompts):
            parsed.append(looks_like_python(p + text))
            samples[-1]["python_line_rate"] = round(python_line_rate(text), 3)
    return {
        "temperature": temperature, "max_new_tokens": max_new_tokens, "n": len(d2),
        "distinct_2_mean": round(float(np.mean(d2)), 4), "distinct_2_min": round(float(np.min(d2)), 4),
        "share_distinct_2_ge_0.5": round(float(np.mean([x >= 0.5 for x in d2])), 4),
        "code_parse_rate": round(float(np.mean(parsed)), 4) if parsed else None,
        "code_python_line_rate": round(float(np.mean([s["python_line_rate"] for s in samples
                                                      if "python_line_rate" in s])), 4) if parsed else None,
        "samples": samples,
    }


def prompts_for_quality() -> tuple[list[str], list[str]]:
    try:
        from speclab.workloads import load_workload

        code = [p.prompt for p in load_workload("code")][:12]
        other = []
        for w in ("json", "tech_prose", "creative"):
            other += [p.prompt for p in load_workload(w)][:4]
        return other, code
    except Exception:
        code = ["def fibonacci(n):\n", "import os\n\n\ndef list_files(path):\n",
                "class Stack:\n    def __init__(self):\n"]
        return ["The following example shows", '{"id": 1, "name": "'], code
