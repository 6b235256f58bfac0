"""``rlkit serve MODEL``: serve a model over SGLang's native HTTP API subset, on CPU (``rlkit.cli.server``).

rlkit serve path/to/hf_model --port 30000
curl -s localhost:30000/generate -d '{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}}'
"""

from __future__ import annotations

import argparse

from rlkit.cli.server import MAX_N, MAX_NEW_TOKENS

__all__ = ["add_parser"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model on CPU over SGLang's native HTTP API subset (for the sglang backend)",
        description="A CPU server speaking /generate, /update_weights_from_disk, /release_memory_occupation, "
        "/resume_memory_occupation, /flush_cache, /health as SGLang 0.5 does, and vLLM's token-in "
        "/inference/v1/generate and /v1/models (verifiers' renderers client), backed by the HF "
        "rollout backend.",
    )
    parser.add_argument("model", help="HF model folder holding *.safetensors")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; a non-loopback one needs --allow-remote)",
    )
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --host: the API has no authentication",
    )
    parser.add_argument(
        "--max-n",
        type=int,
        default=MAX_N,
        help=f"largest sampling_params.n a request may ask (default {MAX_N}); more: HTTP 400",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=MAX_NEW_TOKENS,
        help=f"largest sampling_params.max_new_tokens (default {MAX_NEW_TOKENS}); more: HTTP 400",
    )
    parser.add_argument("--port", type=int, default=30000, help="port (default 30000; 0 = any free port)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--eos-token", default=None, help="override the end-of-response token")
    parser.add_argument("--verbose", action="store_true", help="log every request")
    parser.set_defaults(func=_run)
    return parser


def _run(args: argparse.Namespace) -> int:
    from rlkit.cli.server import serve

    serve(
        args.model,
        args.host,
        args.port,
        dtype=args.dtype,
        seed=args.seed,
        eos_token=args.eos_token,
        verbose=args.verbose,
        max_n=args.max_n,
        max_new_tokens=args.max_new_tokens,
        allow_remote=args.allow_remote,
    )
    return 0
