#!/usr/bin/env python
"""GPU check (issue 6): run on a CUDA machine as one prepared script.

1. The speclab vs Hugging Face comparison (``speclab bench --compare``) in bf16 on the GPU.
2. One decode step of a ~1B-parameter random-weight Llama (speclab's native forward, batch 1,
   bf16) against the memory-bandwidth roofline: weight bytes / HBM bandwidth.
3. The Triton acceptance kernel against the PyTorch reference on the GPU.

    python scripts/gpu_check.py --out gpu_check.json [--bandwidth-gbs 4800]

H200 HBM3e: 4.8 TB/s peak. The script prints a table and writes JSON. It needs no download.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def roofline_step(bandwidth_gbs: float, hidden=2048, layers=16, heads=16, kv_heads=8, ffn=8192, vocab=32000,
                  ctx=512, reps=50) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from speclab.models.native_llama import NativeLlama, StaticKVCache

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    n_params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # bytes a decode step must read: every weight except the embedding table (only one row is read)
    read_bytes = weight_bytes - model.model.embed_tokens.weight.numel() * 2
    native = NativeLlama(model)
    cache = StaticKVCache(native, 1, ctx + 64)
    ids = torch.randint(0, vocab, (1, ctx), device="cuda")
    with torch.inference_mode():
        cache.forward(ids, torch.arange(ctx, device="cuda")[None], None, kv_len=ctx)
        tok = torch.randint(0, vocab, (1, 1), device="cuda")
        pos = torch.tensor([[ctx]], device="cuda")
        times = []
        for i in range(reps + 5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            cache.forward(tok, pos, None, kv_len=ctx + 1)
            torch.cuda.synchronize()
            if i >= 5:
                times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    floor = read_bytes / (bandwidth_gbs * 1e9)
    return dict(parameters=n_params, weight_bytes=weight_bytes, read_bytes=read_bytes, step_ms=step * 1e3,
                roofline_ms=floor * 1e3, fraction_of_roofline=floor / step,
                achieved_gbs=read_bytes / step / 1e9, bandwidth_gbs=bandwidth_gbs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="HBM bandwidth (H200: 4800 GB/s)")
    ap.add_argument("--skip-compare", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to do", file=sys.stderr)
        return 2
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    print(f"device: {report['device']}  torch {torch.__version__}", flush=True)

    r = roofline_step(args.bandwidth_gbs)
    report["roofline"] = r
    print(f"1B-class step: {r['parameters'] / 1e9:.2f}B params, {r['step_ms']:.3f} ms/step, roofline "
          f"{r['roofline_ms']:.3f} ms ({r['fraction_of_roofline']:.0%} of roofline, {r['achieved_gbs']:.0f} GB/s)",
          flush=True)

    env = dict(**__import__("os").environ, TRITON_INTERPRET="0")
    k = subprocess.run([sys.executable, "-c", (
        "import torch,sys; sys.path.insert(0,'.');"
        "from kernels.rejection import fused_rejection_sample; from speclab.engine.acceptance import rejection_sample;"
        "g=torch.Generator(device='cuda').manual_seed(0); B,K,V=64,4,32000;"
        "tp=torch.rand(B,K+1,V,device='cuda',generator=g).softmax(-1); dp=torch.rand(B,K,V,device='cuda',"
        "generator=g).softmax(-1);"
        "d=torch.multinomial(dp.view(-1,V),1).view(B,K); nd=torch.full((B,),K,device='cuda');"
        "ua=torch.rand(B,K,device='cuda',generator=g); un=torch.rand(B,device='cuda',generator=g);"
        "a=fused_rejection_sample(d,dp,tp,nd,ua,un); b=rejection_sample(d,dp,tp,nd,ua,un);"
        "print('kernel n equal', bool((a.num_accepted==b.num_accepted).all()), 'token mismatches',"
        " int((a.next_token!=b.next_token).sum()))")], cwd=ROOT, env=env, capture_output=True, text=True)
    report["kernel"] = (k.stdout + k.stderr).strip()[-2000:]
    print(report["kernel"], flush=True)

    if not args.skip_compare:
        out = Path(args.out).with_suffix(".compare.json")
        c = subprocess.run([sys.executable, "-m", "speclab", "bench", "--compare", "--device", "cuda", "--json",
                            str(out), "--reps", "3", "--prompts-per-workload", "4"], cwd=ROOT, capture_output=True,
                           text=True)
        print(c.stdout[-6000:], c.stderr[-2000:], flush=True)
        report["compare_rc"] = c.returncode
        if out.exists():
            report["compare"] = json.loads(out.read_text())
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
