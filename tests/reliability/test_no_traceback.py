"""Errors, not tracebacks: every `rlkit` command, given bad arguments, answers with one message and exit
code 1 (or argparse's usage and 2); a traceback only with `rlkit --debug` / RLKIT_DEBUG=1.

The sweep drives each command `rlkit --help` lists (the test fails when a command is added without cases)
in this process through ``rlkit.cli.main`` (the code `rlkit` runs); a sample runs `python -m rlkit` in a
subprocess.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
from rlkit_harness import recipe_text, reliability_overrides, rlkit_env, run

from rlkit.cli import build_parser, main


@pytest.fixture
def base(assets, tmp_path) -> Path:
    """A valid tiny recipe (its own output folder)."""
    model, data = assets
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_text(model, data, tmp_path / "out", reliability_overrides(steps=2, keep=2)))
    return path


def sweep_cases(base: Path, tmp: Path) -> dict[str, list[list[str]]]:
    """command -> argument lists that must be refused (missing files, bad overrides, bad values)."""
    a_file = tmp / "a_file"
    a_file.write_text("not a folder")
    not_model = tmp / "not_a_model"
    not_model.mkdir()
    (not_model / "config.json").write_text("{}")
    (not_model / "pytorch_model.bin").write_bytes(b"pickle")
    bad_yaml = tmp / "bad.yaml"
    bad_yaml.write_text("model: [unclosed\n")
    return {
        "run": [
            ["run", str(tmp / "missing.yaml")],
            ["run", str(base), "rollout.n=many"],
            ["run", str(base), "trainer.total_steps=-3"],
            ["run", str(base), "no_equals_sign"],
            ["run", str(base), f"trainer.output_dir={a_file}/out"],
            ["run", str(bad_yaml)],
            ["run", str(base), "--smoke-model", "tiny"],
            ["run"],
        ],
        "validate": [
            ["validate", str(tmp / "missing.yaml")],
            ["validate", str(base), "data.train_batch_size=0"],
            ["validate", str(base), f"data.train_files=[{tmp / 'nope.parquet'}]"],
            ["validate", "--bogus"],
        ],
        "recipe": [
            ["recipe", "show", str(tmp / "missing.yaml")],
            ["recipe", "show", str(base), "actor.optim.lr=fast"],
            ["recipe", "nonsense"],
            ["recipe"],
        ],
        "plugins": [["plugins", "--json", "extra"]],
        "data": [
            ["data", "gsm8k", "--input", str(tmp / "nope"), "--output", str(tmp / "o")],
            ["data", "math500", "--input", str(a_file), "--output", str(tmp / "o")],
            ["data", "arithmetic", "--output", str(tmp / "o"), "--train-size", "-5"],
            ["data", "arithmetic", "--output", str(a_file / "sub")],
            ["data", "nonsense"],
        ],
        "merge": [
            ["merge", str(tmp / "no_checkpoint"), "--out", str(tmp / "m")],
            ["merge", str(tmp), "--out", str(tmp / "m")],
            ["merge", str(tmp), "--out", str(tmp / "m"), "--dtype", "int3"],
        ],
        "plot": [
            ["plot", str(tmp / "no_run"), "--out", str(tmp / "p.png")],
            ["plot", str(tmp), "--out", str(tmp / "p.png")],
        ],
        "serve": [
            ["serve", str(tmp / "no_model")],
            ["serve", str(not_model)],
            ["serve", str(base.parent), "--max-n", "0"],
            ["serve", str(not_model), "--host", "0.0.0.0"],
            ["serve", str(not_model), "--port", "http"],
        ],
        "eval": [
            ["eval", str(tmp / "no_model"), "--data", str(tmp / "no.parquet")],
            ["eval", str(not_model), "--data", str(tmp / "no.parquet")],
            ["eval", str(base.parent), "--data", str(base), "--n", "zero"],
            ["eval", str(base.parent)],
            ["eval", "--compare", str(tmp / "a.json")],
        ],
    }


def commands() -> set[str]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return set(action.choices)


def call(capsys, argv: list[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: usage and exit code 2
        code = exc.code
    return code, capsys.readouterr().err


def test_every_command_refuses_bad_arguments_without_a_traceback(capsys, base, tmp_path, monkeypatch):
    monkeypatch.delenv("RLKIT_DEBUG", raising=False)
    cases = sweep_cases(base, tmp_path)
    assert set(cases) == commands(), "a command of `rlkit --help` has no bad-argument cases here"
    unexpected = []
    for argvs in cases.values():
        for argv in argvs:
            code, err = call(capsys, argv)
            assert code in (1, 2), (argv, code, err)
            assert "Traceback" not in err, (argv, err)
            assert err.startswith("error: ") or "usage: rlkit" in err, (argv, err)
            if "error: unexpected" in err:
                unexpected.append((argv, err.splitlines()[0]))
    assert not unexpected, f"refused only by the catch-all (add a check that names the problem): {unexpected}"


def test_debug_flag_shows_the_traceback_of_an_unexpected_error(capsys, monkeypatch):
    """An exception that is no RlkitError (a bug): one `error: unexpected ...` line; --debug and
    RLKIT_DEBUG=1 raise it."""

    def broken(args):
        raise ValueError("a bug")

    monkeypatch.delenv("RLKIT_DEBUG", raising=False)
    monkeypatch.setattr("rlkit.cli.build_parser", _parser_with(broken))  # `rlkit plugins` runs ``broken``
    code, err = call(capsys, ["plugins"])
    assert code == 1 and "Traceback" not in err
    assert err.startswith("error: unexpected ValueError in `rlkit plugins`: a bug") and "--debug" in err
    # --debug: the exception itself, so Python prints its traceback
    with pytest.raises(ValueError, match="a bug"):
        main(["--debug", "plugins"])
    monkeypatch.setenv("RLKIT_DEBUG", "1")
    with pytest.raises(ValueError, match="a bug"):
        main(["plugins"])


def _parser_with(func):
    def build():
        parser = build_parser()
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        action.choices["plugins"].set_defaults(func=func)
        return parser

    return build


def test_refusals_in_subprocesses_exit_1_with_one_message(base, tmp_path):
    """The real `python -m rlkit`: a refused run and serve print `error: ...`, no traceback; --debug adds
    it."""
    for argv in (["run", str(base), f"trainer.output_dir={base}/out"], ["serve", str(tmp_path / "no_model")]):
        result = run(*argv, env=rlkit_env(), timeout=120)
        assert result.returncode == 1, (argv, result.stderr[-2000:])
        assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr, (argv, result.stderr)
    debug = run("--debug", "serve", str(tmp_path / "no_model"), env=rlkit_env(), timeout=120)
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr, debug.stderr
    assert "error: " in debug.stderr.splitlines()[-1] or "error: " in debug.stderr


def test_unwritable_output_dir_found_by_validate(capsys, base, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder should be")
    code, err = call(capsys, ["validate", str(base), f"trainer.output_dir={blocker}/run"])
    assert code == 1 and "Traceback" not in err
    assert "trainer.output_dir" in err and f"cannot create {blocker}/run: {blocker} is a file" in err, err


@pytest.mark.skipif(sys.platform != "linux" or __import__("os").geteuid() == 0, reason="root writes anywhere")
def test_output_dir_without_write_permission_found_by_validate(capsys, base, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    code, err = call(capsys, ["validate", str(base), f"trainer.output_dir={locked}/run"])
    assert code == 1 and "trainer.output_dir" in err and "no write permission" in err, err


# ----- resume from another model's checkpoint --------------------------------------------------------
def test_loading_a_checkpoint_of_other_shapes_names_the_tensor_and_both_shapes(tmp_path):
    import torch

    from rlkit.model.fsdp import load_checkpoint, save_checkpoint
    from rlkit.runtime.checkpoint import CheckpointMismatchError

    written = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3))
    other = torch.nn.Sequential(torch.nn.Embedding(12, 4), torch.nn.Linear(4, 3))
    save_checkpoint(tmp_path / "actor", written)
    with pytest.raises(CheckpointMismatchError) as error:
        load_checkpoint(tmp_path / "actor", other)
    message = str(error.value)
    assert f"cannot resume from {tmp_path}: it was written by another model" in message
    assert (
        "Tensor '0.weight' has shape [10, 4] in the checkpoint and [12, 4] in the model being trained"
        in message
    )
    assert "trainer.resume=never" in message
    load_checkpoint(tmp_path / "actor", torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3)))


def test_a_run_resuming_another_models_checkpoint_stops_with_one_message(assets, recipe, tmp_path):
    """Step 1 of the tiny model (hidden 64), then the same output folder with a hidden-32 model: exit 1, the
    tensor and both shapes named, how to start fresh, no traceback."""
    from rlkit.model.tiny import build_tiny_model

    out = tmp_path / "out"
    path = recipe(out, steps=1)
    assert run("run", str(path)).returncode == 0
    other = build_tiny_model(tmp_path / "model_b", hidden=32)
    result = run("run", str(path), f"model.path={other}")
    assert result.returncode == 1, result.stderr[-3000:]
    error = result.stderr[result.stderr.index("error: ") :]
    assert "Traceback" not in error and "remote traceback" not in error and "Size mismatch" not in error, (
        error
    )
    assert "error: role 'actor_rollout_ref', rank 0: cannot resume from " in error
    assert (
        "Tensor 'model.embed_tokens.weight' has shape [" in error and "64] in the checkpoint and [" in error
    )
    assert "32] in the model being trained (model.path). Start fresh with trainer.resume=never" in error
