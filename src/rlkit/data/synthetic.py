"""A seeded arithmetic task (``rlkit/arithmetic``) that a small model can visibly learn on a CPU.

Problems are sums (and, if asked, differences) of ``num_terms`` integers in
``[min_operand, max_operand]``, asked in plain words: "What is 3 + 5?". The defaults (two one-digit
terms, addition only, "Answer with only the number.") are the regime where SmolLM2-135M-Instruct
starts partly right, so GRPO has signal from the first step (how often it is right: docs/data-and-rewards.md).
Raise ``max_operand`` / ``num_terms`` or add ``-`` to make it harder. Differences are written so
that no intermediate result is negative.

Test problems are held out from training whenever the problem space allows it: if it holds fewer
distinct problems than ``train_size + test_size``, the test set is drawn first (distinct problems)
and training problems are sampled, with repetition, from the rest.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from rlkit.data._io import join_instruction, make_row, write_rows
from rlkit.errors import DataError

__all__ = ["DATA_SOURCE", "DEFAULT_INSTRUCTION", "generate_arithmetic", "make_problem"]

DATA_SOURCE = "rlkit/arithmetic"
DEFAULT_INSTRUCTION = "Answer with only the number."  # no format demand: the score reads the natural answer
_ENUMERATE_LIMIT = 200_000  # spaces up to this size are enumerated, larger ones sampled


def make_problem(operands: tuple[int, ...], ops: tuple[str, ...]) -> tuple[str, int] | None:
    """``((7, 2), ("-",))`` → ``("What is 7 - 2?", 5)``; None if a partial result goes negative."""
    total = operands[0]
    text = str(operands[0])
    for op, value in zip(ops, operands[1:]):
        total = total + value if op == "+" else total - value
        if total < 0:
            return None
        text += f" {op} {value}"
    return f"What is {text}?", total


def _space(min_operand: int, max_operand: int, num_terms: int, ops: tuple[str, ...]):
    values = range(min_operand, max_operand + 1)
    for operands in itertools.product(values, repeat=num_terms):
        for chosen in itertools.product(ops, repeat=num_terms - 1):
            problem = make_problem(operands, chosen)
            if problem is not None:
                yield problem


def _sample(rng: random.Random, min_operand: int, max_operand: int, num_terms: int, ops: tuple[str, ...]):
    while True:
        operands = tuple(rng.randint(min_operand, max_operand) for _ in range(num_terms))
        problem = make_problem(operands, tuple(rng.choice(ops) for _ in range(num_terms - 1)))
        if problem is not None:
            return problem


def _draw(rng, train_size, test_size, min_operand, max_operand, num_terms, ops):
    size = (max_operand - min_operand + 1) ** num_terms * len(ops) ** (num_terms - 1)
    if size <= _ENUMERATE_LIMIT:
        space = sorted(set(_space(min_operand, max_operand, num_terms, ops)))
        rng.shuffle(space)
        if len(space) >= train_size + test_size:
            return space[test_size : test_size + train_size], space[:test_size]
        if len(space) <= test_size:
            raise DataError(
                f"the arithmetic task has only {len(space)} distinct problems, not enough to hold out "
                f"{test_size} for testing and train on the rest. Lower --test-size or raise --max-operand."
            )
        test, rest = space[:test_size], space[test_size:]
        return [rng.choice(rest) for _ in range(train_size)], test
    seen: set[str] = set()
    test = []
    while len(test) < test_size:
        problem = _sample(rng, min_operand, max_operand, num_terms, ops)
        if problem[0] not in seen:
            seen.add(problem[0])
            test.append(problem)
    train = []
    while len(train) < train_size:
        problem = _sample(rng, min_operand, max_operand, num_terms, ops)
        if problem[0] not in seen:
            train.append(problem)
    return train, test


def generate_arithmetic(
    output_dir: str | Path,
    train_size: int = 2000,
    test_size: int = 50,
    seed: int = 0,
    *,
    min_operand: int = 0,
    max_operand: int = 9,
    num_terms: int = 2,
    ops: tuple[str, ...] | str = ("+",),
    instruction: str = DEFAULT_INSTRUCTION,
    data_source: str = DATA_SOURCE,
) -> dict[str, Path]:
    """Write ``train.parquet`` and ``test.parquet`` of seeded arithmetic problems; same seed, same files.

    ``data_source`` labels the rows for another scorer (``--smoke`` writes GSM8K- or MATH-labelled sums
    whose instruction asks for that scorer's answer format)."""
    ops = tuple(ops)
    if not ops or any(op not in "+-" for op in ops):
        raise DataError(f"arithmetic ops must be '+' and/or '-', got {ops!r}.")
    if num_terms < 2 or min_operand < 0 or max_operand < min_operand:
        raise DataError(
            f"arithmetic needs num_terms >= 2 and 0 <= min_operand <= max_operand "
            f"(got num_terms={num_terms}, min_operand={min_operand}, max_operand={max_operand})."
        )
    if train_size < 0 or test_size < 0:
        raise DataError(f"sizes must be >= 0, got train_size={train_size}, test_size={test_size}.")
    rng = random.Random(seed)
    train, test = _draw(rng, train_size, test_size, min_operand, max_operand, num_terms, ops)
    written = {}
    for split, problems in (("train", train), ("test", test)):
        rows = [
            make_row(
                data_source,
                join_instruction(question, instruction),
                str(answer),
                {"split": split, "index": i, "question": question, "answer": str(answer)},
            )
            for i, (question, answer) in enumerate(problems)
        ]
        written[split] = write_rows(rows, Path(output_dir) / f"{split}.parquet")
    return written
