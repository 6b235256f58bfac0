"""What ``rollout.backend.dtype: auto`` decides about fp16 decode weights on this machine, measured fresh.

    python benchmarks/fp16_probe.py        # SmolLM2-135M's decoder layer, the tiny test model's, the generic
    python benchmarks/fp16_probe.py --lengths 16,32,64,256 --rounds 5

For each decoder layer it runs ``rlkit.hardware.fp16.probe_fp16_decode`` (the probe ``auto`` caches in
``$RLKIT_CACHE/hardware.json``; here it is measured anew, not read from the cache): that layer's linears at 16
rows on one thread, fp32 ``F.linear`` against fbgemm's fp16-weight linear, and their packing, each the best of
``--rounds``. It prints the speed-up, the break-even length (packing over the saving per decode step) and what
``auto`` picks at each of ``--lengths`` (``data.max_response_length``) on a CPU where bf16 is not fast (on a
CPU where it is, ``auto`` is bfloat16 whatever these say). Writes ``benchmarks/results/<stamp>-fp16-probe.*``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_record, one_thread, save_results  # noqa: E402


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="16,24,32,48,64,128,256,1024", help="max_response_length values")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoConfig

    from rlkit.hardware import fp16_decode_pays, layer_shapes, probe_fp16_decode
    from rlkit.hardware.fp16 import PROBE_LAYER
    from rlkit.model.smollm2 import smollm2_dir
    from rlkit.model.tiny import build_tiny_model

    tiny = Path(__file__).resolve().parent / ".work" / "tiny-qwen2"
    if not (tiny / "config.json").exists():
        build_tiny_model(tiny, "qwen2")
    layers = {
        "SmolLM2-135M": layer_shapes(AutoConfig.from_pretrained(smollm2_dir()).to_dict()),
        "tiny Qwen2 (tests)": layer_shapes(AutoConfig.from_pretrained(tiny).to_dict()),
        "generic (hidden 1024)": PROBE_LAYER,
    }
    lengths = [int(x) for x in args.lengths.split(",")]
    record = machine_record(1)
    rows, lines = (
        [],
        [
            "| layer | parameters | fp32 step ms | fp16 step ms | speed-up | packing ms | break-even tokens "
            "| " + " | ".join(f"auto at {n}" for n in lengths) + " |",
            "|---|---:|---:|---:|---:|---:|---:|" + "---|" * len(lengths),
        ],
    )
    for name, layer in layers.items():
        probe = probe_fp16_decode(layer, rounds=args.rounds)
        picks = {n: "float16" if fp16_decode_pays(probe, n)[0] else "float32" for n in lengths}
        rows.append({"layer": name, "shapes": layer, "probe": vars(probe), "auto": picks})
        lines.append(
            f"| {name} | {probe.params / 1e6:.2f} M | {probe.fp32_s * 1e3:.2f} | {probe.fp16_s * 1e3:.2f} | "
            f"{probe.speedup:.2f}x | {probe.pack_s * 1e3:.1f} | {probe.break_even_tokens:.1f} | "
            + " | ".join(picks.values())
            + " |"
        )
        print(lines[-1], flush=True)
    print(
        "results:",
        save_results("fp16-probe", {"args": vars(args), "layers": rows}, "\n".join(lines), machine=record),
    )


if __name__ == "__main__":
    main()
