"""Parameter models of the built-in components: the one place their defaults live.

A recipe gives a component its parameters beside its name (``estimator: {name: grpo, epsilon: 1e-6}``);
validation checks them against these models, and the component receives the validated values
(functions as keyword scalars, classes as ``params=``). Unknown keys are refused.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, PrivateAttr

__all__ = [
    "Params",
    "GroupNormParams",
    "DrGrpoParams",
    "GaeParams",
    "DiscountParams",
    "ClipParams",
    "PPOClipParams",
    "SapoParams",
    "ParallelManagerParams",
    "HFRolloutParams",
    "ToolAgentParams",
    "PythonToolParams",
]


class Params(BaseModel):
    """Base of a params model: unknown keys are errors, every field has a description."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# ----- advantage estimators ------------------------------------------------------------------------
class GroupNormParams(Params):
    norm_adv_by_std: bool = Field(
        True, description="divide by the group's std (False = Dr. GRPO's plain difference)"
    )
    epsilon: PositiveFloat = Field(1e-6, description="added to the std before dividing")


class DrGrpoParams(GroupNormParams):
    norm_adv_by_std: bool = Field(
        False, description="Dr. GRPO leaves the group std out (set True for GRPO's)"
    )


class GaeParams(Params):
    gamma: float = Field(1.0, ge=0, le=1, description="discount")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (1 = Monte-Carlo returns minus values)")


class DiscountParams(Params):
    gamma: float = Field(1.0, ge=0, le=1, description="discount of the returns-to-go")


# ----- policy losses -------------------------------------------------------------------------------
class ClipParams(Params):
    clip_ratio_low: float = Field(0.2, ge=0, description="ratio >= 1 - clip_ratio_low")
    clip_ratio_high: float = Field(
        0.2, ge=0, description="ratio <= 1 + clip_ratio_high (DAPO's clip-higher: 0.28)"
    )


class PPOClipParams(ClipParams):
    clip_ratio_c: float = Field(
        3.0, gt=1, description="dual-clip bound for negative advantages (Ye et al. 2020)"
    )


class SapoParams(Params):
    tau_pos: PositiveFloat = Field(1.0, description="gate temperature for positive advantages")
    tau_neg: PositiveFloat = Field(1.05, description="gate temperature for negative advantages")


# ----- reward managers -----------------------------------------------------------------------------
class ParallelManagerParams(Params):
    num_workers: PositiveInt = Field(2, description="scoring processes")


# ----- rollout -------------------------------------------------------------------------------------
class HFRolloutParams(Params):
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description=(
            "decode dtype: auto = bfloat16 where this device's bf16 is fast, else float16 where fp16 "
            "weights pay for their packing within data.max_response_length (rlkit.hardware.fp16), else "
            "float32 (logged as resolved.decode_dtype, resolved.decode_reason); bfloat16 decodes with a bf16 "
            "copy of the actor's weights; float16 with fp16 weights (on the CPU packed for fbgemm, fp32 "
            "activations: faster where bf16 is slow; needs x86 AVX2)"
        ),
    )
    linears: Literal["auto", "torch", "onnxruntime"] = Field(
        "auto",
        description=(
            "the CPU decode's linear layers: torch (F.linear: MKL, or fbgemm with float16) or onnxruntime "
            "(ONNX Runtime's MLAS fp32 GEMM on weights it prepacks after each update: exact fp32, 1.4-1.5x "
            "MKL at 8-64 rows on an AMD EPYC; a Llama-family model decodes every token after the prefill as "
            "one ONNX Runtime graph, rlkit.rollout.ort_step, any other on per-linear sessions, "
            "rlkit.rollout.mlas_weights; decodes in float32, so dtype must be auto or float32; needs "
            "pip install onnxruntime onnx); auto = onnxruntime where the run "
            "decodes in float32 on a CPU, onnxruntime is installed and a timed probe says its packing pays "
            "back within data.max_response_length, or costs less than fp16 weights where those pay too "
            "(then it decodes in float32; rlkit.hardware.mlas), else torch (logged as "
            "resolved.decode_linears, resolved.decode_linears_reason)"
        ),
    )


class PythonToolParams(Params):
    """The ``python`` tool's sandbox limits (``rlkit.rollout.tools.sandbox.SandboxLimits``)."""

    wall_s: PositiveFloat = Field(10.0, description="wall-clock seconds before the process group is killed")
    cpu_s: PositiveInt = Field(5, description="CPU seconds (RLIMIT_CPU)")
    memory_mb: PositiveInt = Field(
        512, description="address space in MiB (RLIMIT_AS); Python itself needs ~30 MiB"
    )
    max_processes: PositiveInt = Field(
        16, description="RLIMIT_NPROC for the sandbox uid (where the uid drop works)"
    )
    max_file_mb: PositiveInt = Field(
        16, description="largest file the code may write, stdout/stderr included"
    )
    max_output_chars: PositiveInt = Field(
        4000, description="stdout and stderr are each cut to this many characters"
    )
    max_open_files: PositiveInt = Field(64, description="open file descriptors (RLIMIT_NOFILE)")
    isolation: Literal["strict", "weak"] = Field(
        "strict",
        description=(
            "strict: an OS boundary (own uid, namespaces, read-only root; see docs/agents-and-tools.md) or "
            "the tool refuses to start; weak: an audit hook and rlimits only, with a warning"
        ),
    )


class ToolAgentParams(Params):
    max_turns: PositiveInt = Field(4, description="assistant turns per trajectory")
    max_tool_response_chars: PositiveInt = Field(
        2000, description="a tool's answer is cut to this many characters"
    )


class EnvironmentAgentParams(Params):
    """``rollout.agent: {name: environment, ...}``; the environment itself comes from ``data.environment``
    (the composition root attaches it, ``with_environment``)."""

    max_turns: PositiveInt = Field(
        8, description="assistant turns per episode; an episode still open is truncated"
    )
    reply_timeout_s: PositiveFloat = Field(
        10.0,
        description="seconds one environment reply may take; past "
        "that the episode ends with an error (counted in env/errors)",
    )
    max_reply_chars: PositiveInt = Field(
        2000, description="an environment reply is cut to this many characters"
    )
    _environment: Any = PrivateAttr(None)

    def with_environment(self, environment: Any) -> EnvironmentAgentParams:
        """A copy carrying ``environment`` (a ``rlkit.recipe.compose.Resolved`` of registry
        `environments`)."""
        out = self.model_copy()
        out._environment = environment
        return out

    @property
    def environment(self) -> Any:
        return self._environment
