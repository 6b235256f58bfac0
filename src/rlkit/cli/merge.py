"""``rlkit merge CHECKPOINT --out DIR`` and ``rlkit plot RUN_DIR ... --out PNG``."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    merge = subparsers.add_parser("merge", help="write a checkpoint's actor as a Hugging Face model folder")
    merge.add_argument(
        "checkpoint", help="a checkpoint folder, e.g. outputs/rlkit/run/checkpoints/global_step_20"
    )
    merge.add_argument("--out", required=True, help="folder to write (config, tokenizer, safetensors)")
    merge.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="weights' dtype (default float32)",
    )
    merge.add_argument(
        "--merge-lora",
        action="store_true",
        help="LoRA checkpoint: write the base with the adapter merged in (default: the PEFT adapter folder)",
    )
    merge.set_defaults(func=run_merge)

    plot = subparsers.add_parser("plot", help="plot score and key metrics over steps from the tracking store")
    plot.add_argument("runs", nargs="+", help="run output folders (trainer.output_dir); one line per run")
    plot.add_argument("--out", required=True, help="PNG file to write")
    plot.add_argument(
        "--keys",
        nargs="*",
        default=None,
        help="metric names or patterns (default: score, validation, length, entropy, loss)",
    )
    plot.add_argument("--labels", nargs="*", default=None, help="legend label per run")
    plot.set_defaults(func=run_plot)


def run_merge(args: argparse.Namespace) -> int:
    from rlkit.runtime.merge import merge_checkpoint

    out = merge_checkpoint(args.checkpoint, args.out, args.dtype, merge_lora=args.merge_lora)
    if (out / "adapter_config.json").is_file():
        print(
            f"wrote the LoRA adapter {out}; load it with PeftModel.from_pretrained(base_model, {str(out)!r}) "
            "(or merge it: rlkit merge --merge-lora)"
        )
    else:
        print(f"wrote {out}; load it with AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def run_plot(args: argparse.Namespace) -> int:
    from rlkit.cli.plot import DEFAULT_KEYS, plot_runs

    out = plot_runs(args.runs, args.out, tuple(args.keys) if args.keys else DEFAULT_KEYS, args.labels)
    print(f"wrote {out}")
    return 0
