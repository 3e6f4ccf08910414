"""The Gradio lab (``python app.py``; also a Hugging Face Space).

    python app.py [--target NAME|PATH] [--draft NAME|PATH] [--allow-custom-models] [--allow-remote-servers]
                  [--host 127.0.0.1] [--port 7860] [--share]

Environment: SPECLAB_TARGET, SPECLAB_DRAFT, SPECLAB_DRAFTS (extra drafts, comma separated),
SPECLAB_ALLOW_CUSTOM_MODELS=1, SPECLAB_ALLOW_REMOTE_SERVERS=1, SPECLAB_DEVICE;
GRADIO_SERVER_NAME / GRADIO_SERVER_PORT as usual.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["build_demo", "check_port", "main", "parse_args"]


def build_demo(cfg=None):
    from .ui import build_demo as _build

    return _build(cfg)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="app.py", description="speclab: the speculative decoding lab (Gradio)")
    p.add_argument("--target", help="target model: a family name, a local HF directory or a hub id "
                   "(default: the embedded family's target; env SPECLAB_TARGET)")
    p.add_argument("--draft", help="default draft (family name, path, 'ngram' or 'none'; env SPECLAB_DRAFT)")
    p.add_argument("--drafts", nargs="*", default=None, help="extra drafts offered in the app (env SPECLAB_DRAFTS)")
    p.add_argument("--allow-custom-models", action="store_true", default=None,
                   help="let users type any local directory or hub id as target/draft (off by default)")
    p.add_argument("--allow-remote-servers", action="store_true", default=None,
                   help="let the Load tab measure a server at a URL (off by default: only its own speclab serve)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                   help="interface to bind (default 127.0.0.1; a Space sets GRADIO_SERVER_NAME)")
    p.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    p.add_argument("--share", action="store_true", help="create a public gradio.live link (off by default)")
    p.add_argument("--concurrency", type=int, default=int(os.environ.get("SPECLAB_CONCURRENCY", "2")),
                   help="decode runs served at once (default 2); sweeps always run one at a time")
    return p.parse_args(argv)


def check_port(host: str, port: int) -> None:
    """A busy port is one line, before any model loads (Gradio's own error is a traceback after the build).
    The probe binds as uvicorn does (SO_REUSEADDR: a port a closed app left in TIME_WAIT is free) and lets go."""
    import socket

    from ..errors import SpeclabError

    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise SpeclabError(f"cannot listen on {host}:{port}: {e.strerror or e} (choose another with --port, "
                               f"or set GRADIO_SERVER_PORT)") from None


def main(argv=None) -> int:
    args = parse_args(argv)
    from ..errors import SpeclabError
    from .config import AppConfig

    try:
        check_port(args.host, args.port)  # before Gradio's import: a busy port answers in a second
        cfg = AppConfig.from_env(target=args.target, draft=args.draft, extra_drafts=args.drafts,
                                 allow_custom_models=args.allow_custom_models, device=args.device,
                                 allow_remote_servers=args.allow_remote_servers)
    except SpeclabError as e:
        print(f"app.py: {e}", file=sys.stderr)
        return 2
    from .ui import CSS
    from .ui import build_demo as _build

    demo = _build(cfg)
    demo.queue(default_concurrency_limit=max(1, args.concurrency))
    # quiet: Gradio's own lines tell a user of app.py to edit launch() for a public link; ours name the flag
    try:
        demo.launch(server_name=args.host, server_port=args.port, share=args.share, css=CSS, ssr_mode=False,
                    show_error=False, footer_links=["api", "gradio"], quiet=True, prevent_thread_lock=True)
    except OSError as e:  # the port was taken between the check and the bind
        print(f"app.py: cannot listen on {args.host}:{args.port}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"speclab app on {demo.local_url}", flush=True)
    if demo.share_url:
        print(f"public link: {demo.share_url} (temporary; anyone with it can use the app)", flush=True)
    elif not os.environ.get("SPACE_ID"):
        print("a public gradio.live link: python app.py --share", flush=True)
    demo.block_thread()
    return 0
