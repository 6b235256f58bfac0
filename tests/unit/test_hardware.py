"""rlkit.hardware: CPU facts, the bf16 decision from flags and probe numbers, its cache, threads, crowding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlkit import hardware as hw
from rlkit.errors import RlkitError
from rlkit.recipe.schema import Recipe

EPYC = """\
processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx f16c fma avx2 bmi2 sha_ni
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx f16c fma avx2 bmi2 sha_ni
"""
SAPPHIRE = """\
processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: avx2 fma avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_fp16
"""
GRAVITON = """\
processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics sve bf16
CPU part\t: 0xd40
"""

ZEN4 = """\
processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu avx fma avx2 avx512f avx512_bf16 avx512_vnni
"""


# Measured (DESIGN.md): EPYC fp32 70 GFLOP/s, bf16 0.9 GFLOP/s; Xeon AMX 180 and 1300 GFLOP/s.
SLOW_BF16 = hw.MatmulProbe(fp32_flops=70e9, bf16_flops=0.9e9)
FAST_BF16 = hw.MatmulProbe(fp32_flops=180e9, bf16_flops=1300e9, ratios=(7.1, 7.22, 7.3))


def write(tmp_path, text: str):
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    return path


def test_cpu_info_reads_model_and_relevant_flags(tmp_path):
    epyc = hw.cpu_info(write(tmp_path, EPYC))
    assert epyc.model == "AMD EPYC 7B13"
    assert epyc.flags == ("avx2", "fma") and epyc.native_bf16 == ()  # sse, sha_ni etc. are not relevant
    xeon = hw.cpu_info(write(tmp_path, SAPPHIRE))
    assert xeon.native_bf16 == ("amx_bf16", "avx512_bf16")
    arm = hw.cpu_info(write(tmp_path, GRAVITON))
    assert arm.model == "0xd40" and arm.native_bf16 == ("bf16",) and "sve" in arm.flags
    assert hw.cpu_info(tmp_path / "missing").flags == ()  # no /proc/cpuinfo: a model name, no flags


def test_cpu_flags_reads_every_flag_of_the_first_processor(tmp_path):
    """What a build for this CPU needs (``rlkit.rollout.attention_kernel``), cpu_info's filtered flags too."""
    assert hw.cpu_flags(write(tmp_path, EPYC)) == {
        "fpu",
        "sse",
        "sse2",
        "avx",
        "f16c",
        "fma",
        "avx2",
        "bmi2",
        "sha_ni",
    }
    assert "sve" in hw.cpu_flags(write(tmp_path, GRAVITON))
    assert hw.cpu_flags(tmp_path / "missing") == frozenset()


def test_avx2_cpu_gets_fp32_and_says_how_much_slower_bf16_is(tmp_path):
    d = hw.decide_cpu(hw.cpu_info(write(tmp_path, EPYC)), SLOW_BF16)
    assert (d.mixed_precision, d.decode_dtype) == ("fp32", "float32")
    assert d.ratio == pytest.approx(0.9 / 70)
    assert "AMD EPYC 7B13" in d.reason and "no native bf16" in d.reason
    assert "78x slower than fp32" in d.reason  # 70 / 0.9 = 77.8


def test_amx_cpu_gets_bf16(tmp_path):
    d = hw.decide_cpu(hw.cpu_info(write(tmp_path, SAPPHIRE)), FAST_BF16)
    assert (d.mixed_precision, d.decode_dtype) == ("bf16", "bfloat16")
    assert "amx_bf16" in d.reason and "7.22x fp32" in d.reason  # 1300 / 180


def probe(ratio: float, *rounds: float) -> hw.MatmulProbe:
    return hw.MatmulProbe(fp32_flops=100e9, bf16_flops=100e9 * ratio, ratios=rounds)


@pytest.mark.parametrize(
    "cpu,ratio,want,rule",
    [
        (ZEN4, 2.00, "bf16", "band"),  # the flip of issue 26: 2.00x one run ...
        (ZEN4, 1.88, "bf16", "band"),  # ... and 1.88x the next: the same choice (avx512_bf16 in the band)
        (ZEN4, 2.99, "bf16", "band"),  # just under the top edge: the flags
        (ZEN4, 3.00, "bf16", "probe"),  # at the top edge
        (ZEN4, 1.34, "bf16", "band"),
        (ZEN4, 4 / 3, "bf16", "band"),  # at the bottom edge (2 / 1.5): inside
        (ZEN4, 1.32, "fp32", "probe"),  # below the band: bf16 barely faster, autocast's casts would cost more
        (SAPPHIRE, 1.5, "bf16", "band"),  # AMX inside the band: the flags say bf16
        (SAPPHIRE, 1.0, "fp32", "probe"),  # AMX measured no faster than fp32
        (SAPPHIRE, 7.0, "bf16", "probe"),
        (GRAVITON, 2.0, "fp32", "band"),  # Arm's bf16 inside the band: not measured, fp32
        (GRAVITON, 3.0, "bf16", "probe"),
        (EPYC, 5.0, "fp32", "flags"),  # no native bf16: the flags alone, whatever is read
    ],
)
def test_the_bf16_rule_at_and_near_the_band_edges(tmp_path, cpu, ratio, want, rule):
    d = hw.decide_cpu(hw.cpu_info(write(tmp_path, cpu)), probe(ratio, 1.9, 2.1))
    assert d.mixed_precision == want and d.rule.startswith(rule), d.reason
    assert d.decode_dtype == {"fp32": "float32", "bf16": "bfloat16"}[want]
    assert f"rule {d.rule} -> {want}" in d.reason and "rounds 1.90/2.10" in d.reason
    failed = hw.decide_cpu(
        hw.cpu_info(write(tmp_path, SAPPHIRE)), hw.MatmulProbe(fp32_flops=100e9, bf16_flops=0.0)
    )
    assert failed.mixed_precision == "fp32" and "failed" in failed.reason


def test_repeated_decisions_on_this_machine_agree(tmp_path):
    """Several fresh probes of this machine (no cache) give one choice; its inputs are in the run
    parameters."""
    cpu = hw.cpu_info()
    decisions = [hw.decide_cpu(cpu, hw.probe_matmul(budget_s=0.02, rounds=3)) for _ in range(4)]
    assert len({d.mixed_precision for d in decisions}) == 1, [d.reason for d in decisions]
    params = hw.resolve_precision("auto", "auto", "cpu", decision=decisions[0]).params()
    assert params["precision_rule"] == decisions[0].rule and len(params["bf16_ratios"].split()) == 3
    assert params["bf16_ratio"] == round(decisions[0].probe.ratio, 3)
    assert params["cpu_flags"] == (" ".join(cpu.flags) or "-")


def test_cuda_decision_follows_bf16_support():
    assert hw.decide_cuda(True, "H100").mixed_precision == "bf16"
    d = hw.decide_cuda(False, "T4")
    assert (d.mixed_precision, d.decode_dtype) == ("fp32", "float32") and "T4" in d.reason


def test_probe_cache_round_trip(tmp_path):
    calls = []

    def probe():
        calls.append(1)
        return SLOW_BF16

    cache = tmp_path / "sub" / "hardware.json"
    epyc, xeon = hw.cpu_info(write(tmp_path, EPYC)), hw.cpu_info(write(tmp_path, SAPPHIRE))
    assert hw.cached_probe(epyc, cache, probe=probe) == SLOW_BF16 and len(calls) == 1
    # read back, not measured
    assert hw.cached_probe(epyc, cache, probe=probe) == SLOW_BF16 and len(calls) == 1
    # another machine sharing the home folder: its own entry
    hw.cached_probe(xeon, cache, probe=lambda: FAST_BF16)
    entries = json.loads(cache.read_text())["entries"]
    assert len(entries) == 2
    assert {e["cpu_model"] for e in entries.values()} == {"AMD EPYC 7B13", xeon.model}
    assert all(e["torch"] == torch.__version__ for e in entries.values())
    assert hw.cached_probe(xeon, cache, probe=probe) == FAST_BF16 and len(calls) == 1


@pytest.mark.parametrize(
    "garbage",
    ["{not json", '{"version": 1, "entries": {"k": "v"}}', "[1, 2]", '{"version": 1, "entries": []}'],
)
def test_corrupt_cache_is_ignored_and_rewritten(tmp_path, garbage):
    cache = tmp_path / "hardware.json"
    cache.write_text(garbage)
    epyc = hw.cpu_info(write(tmp_path, EPYC))
    assert hw.cached_probe(epyc, cache, probe=lambda: SLOW_BF16) == SLOW_BF16
    data = json.loads(cache.read_text())
    assert data["version"] == 1 and [
        e["fp32_flops"] for e in data["entries"].values() if "fp32_flops" in e
    ] == [70e9]
    assert hw.cached_probe(epyc, cache, probe=lambda: FAST_BF16) == SLOW_BF16  # the rewritten file is read


def test_a_malformed_entry_of_this_machine_is_measured_again_and_replaced(tmp_path):
    cache = tmp_path / "hardware.json"
    epyc = hw.cpu_info(write(tmp_path, EPYC))
    hw.cached_probe(epyc, cache, probe=lambda: SLOW_BF16)
    data = json.loads(cache.read_text())
    (key,) = data["entries"]
    data["entries"][key] = {"fp32_flops": "fast"}  # this machine's entry, unreadable
    cache.write_text(json.dumps(data))
    assert hw.cached_probe(epyc, cache, probe=lambda: FAST_BF16) == FAST_BF16  # measured again
    assert hw.cached_probe(epyc, cache, probe=lambda: SLOW_BF16) == FAST_BF16  # and written back


def test_real_probe_measures_both_dtypes():
    probe = hw.probe_matmul(size=64, budget_s=0.01)
    assert probe.fp32_flops > 0 and probe.bf16_flops > 0 and probe.threads == 1 and probe.ratio > 0
    assert len(probe.ratios) == hw.PROBE_ROUNDS and probe.ratio == probe.bf16_flops / probe.fp32_flops


def test_explicit_bf16_on_a_slow_cpu_warns_with_the_ratio(tmp_path):
    slow = hw.decide_cpu(hw.cpu_info(write(tmp_path, EPYC)), SLOW_BF16)
    auto = hw.resolve_precision("auto", "auto", "cpu", decision=slow)
    assert (auto.mixed_precision, auto.decode_dtype, auto.warnings) == ("fp32", "float32", ())
    forced = hw.resolve_precision("bf16", "bfloat16", "cpu", decision=slow)
    # kept: the user asked for it
    assert (forced.mixed_precision, forced.decode_dtype) == ("bf16", "bfloat16")
    assert len(forced.warnings) == 2 and all("78x slower" in w for w in forced.warnings)
    assert (
        "actor.mixed_precision=bf16" in forced.warnings[0] and "rollout.backend.dtype" in forced.warnings[1]
    )
    fast = hw.decide_cpu(hw.cpu_info(write(tmp_path, SAPPHIRE)), FAST_BF16)
    assert hw.resolve_precision("bf16", None, "cpu", decision=fast).warnings == ()
    modest = hw.decide_cpu(
        hw.cpu_info(write(tmp_path, ZEN4)), hw.MatmulProbe(fp32_flops=100e9, bf16_flops=120e9)
    )
    # below the band: fp32; an explicit bf16 is not slow (1.2x): no warning
    assert modest.mixed_precision == "fp32"
    assert hw.resolve_precision("bf16", "bfloat16", "cpu", decision=modest).warnings == ()
    assert hw.resolve_precision("fp32", "auto", "cpu", decision=fast).decode_dtype == "bfloat16"
    params = auto.params()
    assert params["mixed_precision"] == "fp32" and params["cpu_model"] == "AMD EPYC 7B13"
    assert params["matmul_gflops_bf16"] == 0.9 and "no native bf16" in params["precision_reason"]


def test_invalid_values_are_refused():
    with pytest.raises(RlkitError, match="auto, fp32, bf16"):
        hw.concrete_mixed_precision("fp16")
    with pytest.raises(RlkitError, match="rollout.backend.dtype='float8'"):
        hw.concrete_decode_dtype("float8")
    assert hw.concrete_decode_dtype(None) is None and hw.concrete_mixed_precision("bf16") == "bf16"


def test_auto_on_this_machine_is_its_cached_decision():
    d = hw.precision_decision("cpu")
    assert hw.concrete_mixed_precision("auto", torch.device("cpu")) == d.mixed_precision
    assert hw.concrete_decode_dtype("auto", "cpu") == d.decode_dtype
    assert d.mixed_precision == ("bf16" if hw.bf16_rule(d.cpu.native_bf16, d.probe.ratio)[0] else "fp32")


def test_worker_threads_are_the_cpus_ray_gives():
    assert hw.worker_threads("auto", 2.0) == 2
    assert hw.worker_threads("auto", 2.0, 0.5) == 1  # a critic sharing the actor's bundle
    assert hw.worker_threads("auto", 3.0, 0.5) == 1  # 1.5 rounds down
    assert hw.worker_threads("auto", 0.5) == 1  # at least one
    assert hw.worker_threads(3, 1.0) == 3  # an explicit number wins


def test_oversubscription_names_the_numbers():
    assert hw.oversubscription(pool_cpus=2, worker_threads_total=2, cores=2, load_1min=0.5) is None
    busy = hw.oversubscription(pool_cpus=2, worker_threads_total=2, cores=2, load_1min=3.4)
    assert "2 usable cores" in busy and "load average is already 3.4" in busy
    crowded = hw.oversubscription(pool_cpus=4, worker_threads_total=6, cores=2, load_1min=0.0)
    assert "reserve 4 CPUs" in crowded and "6 torch threads" in crowded
    assert hw.usable_cpus() >= 1


def test_plan_run_resolves_auto_threads_per_role_and_precision():
    recipe = Recipe.model_validate(
        {
            "model": {"path": "m"},
            "data": {"train_files": ["t.parquet"]},
            "resources": {
                "pools": {
                    "global": {"cpus_per_bundle": 4},
                    "side": {"bundles_per_node": 2, "cpus_per_bundle": 3},
                }
            },
        }
    )
    # the defaults
    assert recipe.actor.mixed_precision == "auto" and recipe.resources.threads_per_worker == "auto"
    # slot -> pool, as Pipeline.roles places them
    colocated = {"actor_rollout_ref": "global", "critic": "global"}
    plan = hw.plan_run(recipe, device="cpu", placed=colocated, decode_dtype="auto")
    assert plan.threads == {"actor_rollout_ref": 2, "critic": 2}  # two roles on one pool: half of 4 each
    d = hw.precision_decision("cpu")
    # no layer given (a backend without fp16 weights): the machine's bf16-or-fp32 decision
    assert (plan.precision.mixed_precision, plan.precision.decode_dtype) == (
        d.mixed_precision,
        d.decode_dtype,
    )
    generic = hw.plan_run(recipe, device="cpu", placed=colocated, decode_dtype="auto", layer=lambda: None)
    # the hf backend's: weighed for the default data.max_response_length (512) on the generic layer
    assert generic.precision.decode_dtype == hw.auto_decode_dtype(d, 512, lambda: None)[0]
    params = plan.params()
    assert params["threads_per_worker.critic"] == 2 and params["precision_reason"] == d.reason
    split = hw.plan_run(
        recipe, device="cpu", placed={"actor_rollout_ref": "global", "critic": "side"}, decode_dtype=None
    )
    assert split.threads == {"actor_rollout_ref": 4, "critic": 3}
    fixed = recipe.model_copy(
        update={"resources": recipe.resources.model_copy(update={"threads_per_worker": 1})}
    )
    plan = hw.plan_run(fixed, device="cpu", placed={"actor_rollout_ref": "global"}, decode_dtype=None)
    assert plan.threads == {"actor_rollout_ref": 1} and plan.precision.decode_dtype is None
    if hw.usable_cpus() < 10:  # the pools reserve 4 + 2 x 3 = 10 CPUs
        assert "reserve 10 CPUs" in plan.oversubscribed


def test_a_cache_shared_with_an_older_rlkit_keeps_both_entries(tmp_path):
    """An older rlkit (single-probe entries, same file version) and this one share ~/.cache/rlkit: neither
    discards the other's entry, so each keeps reading its own probe (no re-probe, no flip between runs)."""
    cache = tmp_path / "hardware.json"
    old = {"fp32_flops": 1.0, "bf16_flops": 2.0, "size": 256, "threads": 1}
    cache.write_text(json.dumps({"version": 1, "entries": {"0123456789abcdef": old}}))
    epyc = hw.cpu_info(write(tmp_path, EPYC))
    assert hw.cached_probe(epyc, cache, probe=lambda: FAST_BF16) == FAST_BF16
    entries = json.loads(cache.read_text())["entries"]
    assert entries["0123456789abcdef"] == old and len(entries) == 2
    assert hw.cached_probe(epyc, cache, probe=lambda: SLOW_BF16) == FAST_BF16  # its own entry, read back


@pytest.mark.heavy  # a subprocess
def test_benchmarks_load_the_probe_and_the_flops_by_file_path_without_rlkit():
    """benchmarks/common.py loads rlkit/hardware/cpu.py and rlkit/model/flops.py by file path in TRL's
    environment, which has no rlkit: both must exist there and import nothing of rlkit."""
    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys\n"
        "class NoRlkit:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'rlkit':\n"
        "            raise ImportError(f'{name}: rlkit is not installed here')\n"
        "sys.meta_path.insert(0, NoRlkit())\n"
        "sys.path.insert(0, 'benchmarks')\n"
        "import common\n"
        "print('MACHINE', common.hardware_line(common.hardware()))\n"
        "print('FLOPS', common.flops_module().__name__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MACHINE machine: " in result.stdout and "FLOPS _rlkit_flops" in result.stdout, result.stdout
