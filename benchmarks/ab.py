"""In-process A/B of one speed change: the same phase with the change off (A) and on (B), interleaved.

    python benchmarks/ab.py --model DIR --change head --phase update [--dtype bf16] [--reps 3]
    python benchmarks/ab.py --model DIR --change precision --phase step --prompts 8 --samples 64 --tokens 16 \
        --micro 16 --threads 2 --reps 1 --warmup-tokens 2      # one quickstart-sized step, fp32 vs bf16

Changes (each toggled here by patching, never by a setting in rlkit):
  head   actor forward: LM head on response positions only (``logits_to_keep``) vs every position
  prefix actor forward/backward: one prompt pass per group (KV cache indexed to its rows) vs one per row
  fsdp   world size 1: the plain module vs an FSDP2-wrapped one
  prefill  rollout: one prefill per distinct prompt (KV cache shared by its n rows) vs one per row
  fused  fused AdamW vs the foreach implementation
  attn   eager attention vs SDPA (CPU flash attention's bf16 backward is slow)
  bf16w  rollout: a bf16 weight copy for decoding (rollout.backend.dtype) vs the fp32 weights
  fp16w  rollout: fbgemm fp16 decode weights (rollout.backend.dtype=float16) vs the fp32 weights; the step
  phase hands the rollout the weights after each update, as the weight sync does, so B repacks them
  precision  fp32 everywhere vs bf16 autocast plus a bf16 decode copy (what ``auto`` picks between)
  pack   actor: each micro-batch in the cheapest layout incl. packed rows (rlkit.model.packing) vs
         shared/padded
  fusedhead  actor: log-prob / entropy from hidden states in row chunks (rlkit.algos.fused_head) vs [b, t, V]
         logits
  headkeep  actor, fused head: each vocabulary slice's logits kept from forward to backward (within
         ``KEEP_LOGITS_BYTES``) vs recomputed in backward
  mlas   rollout: the decode copy's linears on ONNX Runtime's MLAS fp32 GEMM over weights it prepacks
         (``rollout.backend.linears=onnxruntime``, rlkit.rollout.mlas_weights) vs torch's F.linear (or, with
         ``--decode-dtype float16``, fbgemm's fp16 weights); the step phase hands the rollout the weights
         after each update, so B (and an fp16 A) repacks them
  lean   rollout: tokens after the prefill through the lean decode step (rlkit.rollout.lean_step) vs the
         model's own forward (``--decode-dtype float16``: both on the fp16 decode copy)
  sharedattn  rollout, lean step: a group's prompt K/V read once per step for its rows
         (``DecodePlan.share_prompt_attention``, rlkit.rollout.shared_prompt) vs SDPA over every row's copy
  scripted  rollout, lean step: its layers as one TorchScript function (``DecodePlan.scripted_layers``,
         rlkit.rollout.scripted_step) vs its Python loop (``--decode-dtype bfloat16``: both on the bf16 copy)
  bf16kv  rollout, lean step over the bf16 copy (use ``--decode-dtype bfloat16``): bf16 K/V in the slab cache
         (rlkit.rollout.bf16_kv) at any cache length vs fp32 K/V (the default takes bf16 from
         ``BF16_KV_MIN_POSITIONS`` positions)
  kernel  rollout, lean step over fp32 K/V: attention by the compiled kernel (``DecodePlan.attention_kernel``,
         rlkit.rollout.attention_kernel) vs SDPA
  glue  rollout, scripted lean step: the work between the GEMMs (norms, casts, rotary, K/V writes, SiLU·up) by
         the compiled operators of kernels/decode_glue.cpp (``DecodePlan.fused_glue``,
         rlkit.rollout.scripted_step.fused_layer_loop) vs torch's operators
  sampling  rollout: a greedy or untruncated draw by the compiled ``rlkit::sample_rows``
         (kernels/sampling.cpp, ``DecodePlan.fused_sampling``; over the logits as the head wrote them: bf16
         from the bf16 copy) vs torch's operators (widen to fp32, softmax, block sums)
  castonce  actor, bf16 autocast over several micro-batches: each weight cast to bf16 once per optimizer step
         (``rlkit.model.forward.casts_kept``) vs once per micro-batch (use with ``--micro``)
  micro  update in micro-batches of ``--micro`` samples vs all samples in one micro-batch (same gradient)
  compile  actor: each decoder layer's MLP and RMSNorms under ``torch.compile`` (inductor, dynamic shapes;
         the parts with no KV cache and no data-dependent branch) vs eager; measured, not built into rlkit
         (docs/benchmarks.md, "session 28"). The first call compiles (warm-up; a C++ compiler at run time)
  malloc glibc's malloc keeps freed memory for reuse (``keep_freed_memory``: no mmap'd blocks, no heap trim)
         vs its defaults; measured, not built into rlkit (docs/benchmarks.md, "Three more levers on AVX2").
         The setting is process-wide, so A and B run in separate processes: ``--processes`` pairs (A B, then
         B A, ...), each with ``--reps`` reps after its warm-up; the medians are over all reps
Every rep also records the minor page faults it took (``ru_minflt``) and the resident memory after it.
Phases: gen, log_prob, update, or step (gen then update on the generated batch: the quickstart's step,
whose old log-prob equals the new one and is not recomputed).
One actor per variant (same seed, same weights), world size 1 (gloo), ``--threads`` torch threads (1).
Prints the machine (CPU model, flags, torch, matmul GFLOP/s), then the median seconds of A and B and B/A;
for the update phase also the FLOPs each variant executes (``perf/flops/actor``, ``rlkit.model.flops``) and
its GFLOP/s against the best fp32 1024² matmul measured here (``matmul_peak_flops``). ``--only off|on`` builds
and runs one variant and prints the process's peak RSS (run it twice, one process per variant, to compare peak
memory). Everything printed after the warm-up also goes to
``benchmarks/results/<stamp>-ab-<change>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    arithmetic_chat_texts,
    hardware_line,
    keep_freed_memory,
    matmul_peak_flops,
    memory_bandwidth,
    one_thread,
    parquet_chat_texts,
    save_results,
)


def plans(change: str, on: bool):
    """The ForwardPlan and DecodePlan of a variant: B (``on``) is the current default; A turns the change
    off."""
    from rlkit.model.forward import ForwardPlan
    from rlkit.rollout.decode import DecodePlan

    off = not on
    forward = ForwardPlan(
        share_prefix=not (change == "prefix" and off),
        pack=not (change == "pack" and off),
        fused_head=not (change == "fusedhead" and off),
        keep_head_logits=not (change == "headkeep" and off),
        plain_at_world_size_1=not (change == "fsdp" and off),
        cast_weights_once=not (change == "castonce" and off),
    )
    return forward, DecodePlan(
        share_prefill=not (change == "prefill" and off),
        lean_step=not (change == "lean" and off),
        share_prompt_attention=not (change == "sharedattn" and off),
        scripted_layers=not (change == "scripted" and off),
        fused_glue=not (change == "glue" and off),
        fused_sampling=not (change == "sampling" and off),
        # bf16kv: A fp32 K/V, B bf16 K/V at any length (where it pays decides BF16_KV_MIN_POSITIONS)
        **({"bf16_kv_from": 0 if on else None, "bf16_kv_probe": False} if change == "bf16kv" else {}),
        # kernel: A SDPA, B the compiled kernel wherever it builds (without asking its probe)
        **({"attention_kernel": on, "attention_kernel_probe": False} if change == "kernel" else {}),
    )


def compile_mlp_and_norms(module) -> None:
    """``compile``'s B: every decoder layer's ``mlp``, ``input_layernorm`` and ``post_attention_layernorm``
    compiled in place (``nn.Module.compile``, dynamic shapes: one graph per module class serves every layer
    and every token width)."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in module.model.layers:
        for part in (layer.mlp, layer.input_layernorm, layer.post_attention_layernorm):
            part.compile(dynamic=True)


@contextmanager
def variant(change: str, on: bool):
    """The variants that are not a plan: AdamW without ``fused`` and the head over every position."""
    from rlkit.model import forward

    saved = []
    if change == "fused" and not on:
        import torch

        saved.append((torch.optim, "AdamW", torch.optim.AdamW))
        torch.optim.AdamW = lambda *a, fused=None, _cls=torch.optim.AdamW, **k: _cls(*a, **k)
    if change == "head" and not on:
        saved.append((forward, "_accepts_logits_to_keep", forward._accepts_logits_to_keep))
        forward._accepts_logits_to_keep = lambda cls: False
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def main() -> None:
    one_thread()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--change", required=True)
    parser.add_argument("--phase", default="update")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument(
        "--samples",
        type=int,
        default=16,
        help="completions (rows) in all: samples / prompts for each of --prompts prompts",
    )
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="distinct prompts; samples / prompts each")
    parser.add_argument(
        "--prompt-file",
        help="parquet of chat prompts (run.py's rows, e.g. benchmarks/.work/arithmetic/train-long512.parquet "
        "for smollm2-long's); default: the 8 arithmetic questions",
    )
    parser.add_argument("--micro", type=int, default=0, help="update micro-batch (0 = all samples at once)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--worker-thread",
        action="store_true",
        help="run every rep on one second thread, as a Ray worker runs its methods (glibc reuses freed "
        "memory differently there: docs/benchmarks.md, 'Three more levers on AVX2')",
    )
    parser.add_argument(
        "--decode-dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="rollout.backend.dtype of both variants (the bf16w, fp16w and precision changes set B's own)",
    )
    parser.add_argument(
        "--eos",
        action="store_true",
        help="responses end at eos (unequal lengths, as in a real run); default: all --tokens long",
    )
    parser.add_argument(
        "--only",
        choices=("off", "on"),
        default=None,
        help="build and time one variant alone, then print the process's peak RSS",
    )
    parser.add_argument(
        "--warmup-tokens",
        type=int,
        default=0,
        help="warm up each variant on one prompt: this many tokens and a forward pass "
        "(0 = one full round). The optimizer's first-step allocation then falls in A's and B's first rep",
    )
    parser.add_argument(
        "--processes", type=int, default=2, help="malloc: pairs of processes (A B, B A, ...) to run"
    )
    parser.add_argument("--child-json", default=None, help=argparse.SUPPRESS)  # malloc: a child's raw numbers
    args = parser.parse_args()
    if args.change == "malloc" and args.only is None:
        across_processes(args)
        return
    if args.change == "malloc" and args.only == "on" and not keep_freed_memory():
        raise SystemExit("ab.py --change malloc: this C library is not glibc; nothing to compare")
    machine = hardware_line()
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import torch.distributed as dist

    from rlkit.batch import Batch
    from rlkit.plugin.registry import build_registries
    from rlkit.recipe.compose import resolve
    from rlkit.recipe.schema import ActorConfig, ModelConfig, RolloutConfig
    from rlkit.workers.actor import FSDPActor
    from rlkit.workers.base import find_free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    registries = build_registries()
    built = {}
    variants = (False, True) if args.only is None else (args.only == "on",)
    for on in variants:
        bf16 = args.dtype == "bf16" or (args.change == "precision" and on)
        decode = "bfloat16" if (args.change in ("bf16w", "precision") and on) else args.decode_dtype
        decode = "float16" if (args.change == "fp16w" and on) else decode
        with variant(args.change, on):
            cfg = ActorConfig(
                mixed_precision="bf16" if bf16 else "fp32",
                ppo_micro_batch_size_per_rank=args.samples
                if (args.change == "micro" and on)
                else (args.micro or args.samples),
                ppo_mini_batch_size=1,
            )
            backend = {"name": "hf", "dtype": decode}
            if args.change == "mlas" and on:  # fp32 (against A's --decode-dtype: float32, or float16)
                backend |= {"dtype": "float32", "linears": "onnxruntime"}
            # components resolved as the driver resolves them (rlkit.recipe.compose), built as the worker
            # builds them
            (loss, p1), (engine, p2) = (
                resolve("actor.policy_loss", "policy_losses", cfg.policy_loss, registries),
                resolve("rollout.backend", "rollout_backends", backend, registries),
            )
            assert not p1 and not p2, p1 + p2
            forward_plan, decode_plan = plans(args.change, on)
            actor = FSDPActor(
                ModelConfig(path=args.model),
                cfg,
                loss,
                rollout_n=args.samples,
                total_steps=10,
                forward_plan=forward_plan,
            )
            rollout = engine.build(
                module=actor.module,
                tokenizer=actor.tokenizer,
                seed=1,
                max_response_length=args.tokens,
                rollout_config=RolloutConfig(ignore_eos=not args.eos, backend=backend),
                decode_plan=decode_plan,
            )
            if args.change == "compile" and on:
                compile_mlp_and_norms(actor.module)
            if args.change == "attn" and on:
                actor.module.set_attn_implementation("eager")
            built[on] = (actor, rollout)
    tok = built[variants[0]][0].tokenizer
    if args.prompt_file:
        texts = parquet_chat_texts(tok, args.prompt_file, args.prompts)
    else:
        texts = arithmetic_chat_texts(tok)[: args.prompts]
    enc = tok(texts, return_tensors="pt", padding=True)
    prompts = Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    n = args.samples // len(texts)  # prompts × n samples (default 4 × 4, the benchmark's SmolLM2 workload)
    batch = built[variants[0]][1].generate(prompts, n=n)
    batch["advantages"] = torch.randn(len(batch), 1).expand_as(batch["response_mask"]).contiguous()

    cpu_s: dict[bool, list[float]] = {False: [], True: []}  # process CPU seconds: robust to other jobs' load
    executed: dict[bool, float] = {}  # FLOPs the last update of each variant executed (perf/flops/actor)
    parts: dict[bool, list[tuple[float, float]]] = {False: [], True: []}  # (gen, the rest) wall s per rep
    faults: dict[bool, list[int]] = {False: [], True: []}  # minor page faults per rep
    rss: dict[bool, list[float]] = {False: [], True: []}  # resident MiB after each rep

    def run(on: bool, small: bool = False, record: bool = True) -> float:
        actor, rollout = built[on]
        p, b = (prompts[:1], batch[: max(2, n)]) if small else (prompts, batch)
        with variant(args.change, on):
            faults_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start, cpu_start = time.perf_counter(), time.process_time()
            if args.phase in ("gen", "step"):
                rollout.generate(p, n=n, **({"max_new_tokens": args.warmup_tokens} if small else {}))
            gen_end = time.perf_counter()
            # a small update would not fill a mini-batch: warm up a forward
            if args.phase == "log_prob" or small:
                actor.compute_log_prob(b)
            elif args.phase in ("update", "step"):
                # rlkit.model.flops, as a run counts
                executed[on] = actor.update(b).get("perf/flops/actor", 0.0)
                rollout.update_weights(actor.module)  # the hybrid engine's weight sync
            if record:
                cpu_s[on].append(time.process_time() - cpu_start)
                parts[on].append((gen_end - start, time.perf_counter() - gen_end))
                faults[on].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_start)
                rss[on].append(resident_mib())
            return time.perf_counter() - start

    from concurrent.futures import ThreadPoolExecutor

    thread = ThreadPoolExecutor(1, thread_name_prefix="ab-worker") if args.worker_thread else None

    def call(on: bool, small: bool = False, record: bool = True) -> float:
        return thread.submit(run, on, small, record).result() if thread else run(on, small, record)

    for on in variants:
        call(on, bool(args.warmup_tokens), False)  # warm-up
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.reps):
        for on in variants if r % 2 == 0 else variants[::-1]:
            times[on].append(call(on))
    report: list[str] = []

    def emit(text: str) -> None:
        print(text, flush=True)
        report.append(text)

    def save() -> None:
        record = {
            "args": vars(args),
            "wall_s": {"off": times[False], "on": times[True]},
            "cpu_s": {"off": cpu_s[False], "on": cpu_s[True]},
            "gen_and_rest_s": {"off": parts[False], "on": parts[True]},
            "minor_faults": {"off": faults[False], "on": faults[True]},
            "resident_mib": {"off": rss[False], "on": rss[True]},
        }
        print("results:", save_results(f"ab-{args.change}", record, "\n\n".join(report)))

    emit(machine + f"; load average {os.getloadavg()[0]:.2f}; {args.threads} torch thread(s)")
    if args.only is not None:
        on = variants[0]
        if args.child_json:  # one process of ``across_processes``: its numbers go back to the parent
            Path(args.child_json).write_text(
                json.dumps(
                    {
                        "machine": machine,
                        "wall_s": times[on],
                        "cpu_s": cpu_s[on],
                        "gen_and_rest_s": parts[on],
                        "minor_faults": faults[on],
                        "resident_mib": rss[on],
                        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
                    }
                )
            )
            dist.destroy_process_group()
            return
        emit(
            f"{args.change} {args.phase} {args.dtype} {args.only} alone: {statistics.median(times[on]):.3f} "
            f"s {[round(x, 3) for x in times[on]]}; peak RSS "
            f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB"
        )
        save()
        dist.destroy_process_group()
        return
    a, b = statistics.median(times[False]), statistics.median(times[True])
    emit_faults(emit, faults, rss)
    emit(
        f"{args.change} {args.phase} {args.dtype} (decode {args.decode_dtype}): A(off) {a:.3f} s  B(on) "
        f"{b:.3f} s  B/A {b / a:.3f}  (A {[round(x, 3) for x in times[False]]}, B "
        f"{[round(x, 3) for x in times[True]]})"
    )
    if args.phase == "step":
        for on in (False, True):
            gens, rests = zip(*parts[on], strict=True)
            emit(
                f"  {'B(on)' if on else 'A(off)'}: gen {statistics.median(gens):.3f} s "
                f"{[round(x, 3) for x in gens]}, update {statistics.median(rests):.3f} s "
                f"{[round(x, 3) for x in rests]}"
            )
    if args.phase == "update":
        peak = matmul_peak_flops("fp32")
        for on, seconds in ((False, a), (True, b)):
            flops = executed[on]
            emit(
                f"  {'B(on)' if on else 'A(off)'}: {flops / 1e9:.1f} GFLOP executed (perf/flops/actor), "
                f"{flops / seconds / 1e9:.1f} GFLOP/s = {100 * flops / seconds / peak:.0f}% of the fp32 "
                f"1024² matmul probe {peak / 1e9:.1f} GFLOP/s"
            )
        emit(f"  memory read bandwidth (256 MiB sum, 1 thread): {memory_bandwidth() / 1e9:.1f} GB/s")
    ca, cb = statistics.median(cpu_s[False]), statistics.median(cpu_s[True])
    emit(
        f"  process CPU s: A {ca:.3f}  B {cb:.3f}  B/A {cb / ca:.3f}  (with {args.threads} thread(s), CPU s "
        "/ threads is the wall time on an idle machine)"
    )
    save()
    dist.destroy_process_group()


def resident_mib() -> float:
    """This process's resident memory now, MiB (Linux; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def emit_faults(emit, faults: dict, rss: dict) -> None:
    """One line per variant: median minor page faults per rep and the resident memory after the reps."""
    for on in (False, True):
        if faults[on]:
            emit(
                f"  {'B(on)' if on else 'A(off)'}: minor page faults per rep median "
                f"{statistics.median(faults[on]):.0f} {faults[on]}; resident MiB after each rep "
                f"{[round(x) for x in rss[on]]}"
            )


def across_processes(args) -> None:
    """``--change malloc``: A and B in separate processes, ``args.processes`` pairs in alternating order,
    each a child run of this script with ``--only``; reports the medians over every child's reps."""
    argv = sys.argv[1:]
    got: dict[bool, list[dict]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.processes):
            for on in (False, True) if pair % 2 == 0 else (True, False):
                out = Path(tmp) / f"{pair}-{int(on)}.json"
                cmd = [
                    sys.executable,
                    __file__,
                    *argv,
                    "--only",
                    "on" if on else "off",
                    "--child-json",
                    str(out),
                ]
                subprocess.run(cmd, check=True)
                got[on].append(json.loads(out.read_text()))
    keys = ("wall_s", "cpu_s", "minor_faults", "resident_mib")
    merged = {on: {k: [x for child in got[on] for x in child[k]] for k in keys} for on in got}
    report: list[str] = []

    def emit(text: str) -> None:
        print(text, flush=True)
        report.append(text)

    emit(
        got[False][0]["machine"] + f"; load average {os.getloadavg()[0]:.2f}; {args.threads} torch thread(s)"
    )
    a, b = statistics.median(merged[False]["wall_s"]), statistics.median(merged[True]["wall_s"])
    walls = {on: [round(x, 3) for x in merged[on]["wall_s"]] for on in merged}
    emit(
        f"{args.change} {args.phase} {args.dtype}: A(off) {a:.3f} s  B(on) {b:.3f} s  B/A {b / a:.3f}  over "
        f"{args.processes} process pairs × {args.reps} reps (A {walls[False]}, B {walls[True]})"
    )
    emit_faults(
        emit,
        {on: merged[on]["minor_faults"] for on in merged},
        {on: merged[on]["resident_mib"] for on in merged},
    )
    for on in (False, True):
        emit(
            f"  {'B(on)' if on else 'A(off)'}: peak RSS per process MiB "
            f"{[round(child['peak_rss_mib']) for child in got[on]]}"
        )
    ca, cb = statistics.median(merged[False]["cpu_s"]), statistics.median(merged[True]["cpu_s"])
    emit(f"  process CPU s: A {ca:.3f}  B {cb:.3f}  B/A {cb / ca:.3f}")
    record = {"args": vars(args), "children": {"off": got[False], "on": got[True]}}
    print("results:", save_results(f"ab-{args.change}", record, "\n\n".join(report)))


if __name__ == "__main__":
    main()
