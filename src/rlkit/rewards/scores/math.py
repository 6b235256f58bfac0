"""MATH / MATH-500: compare the last ``\\boxed{}`` answer of a solution with the reference answer.

Extraction takes the last ``\\boxed{...}`` or ``\\fbox{...}`` (braces may nest; ``\\boxed 5`` without
braces works too). Both sides are then normalised (LaTeX spacing and sizing commands, ``\\dfrac``,
``\\text{}`` wrappers, degrees, percent and dollar signs, thousands separators, ``x = `` prefixes,
``\\frac12`` shorthands, ...) and compared as strings, then as numbers. When the optional
``math-verify`` package is importable (``pip install rlkit[math]``) it gets the last word on pairs
the rules call different; ``use_math_verify=False`` turns that off.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["compute_score", "last_boxed", "normalize_answer", "is_equiv"]

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _matching_brace(text: str, open_at: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_at`` (escaped ``\\{`` ``\\}`` ignored)."""
    depth = 0
    i = open_at
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\boxed x`` in ``text``, or None."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = start + len(cmd)
    if rest < len(text) and text[rest] == "{":
        end = _matching_brace(text, rest)
        return text[rest + 1 : end] if end is not None else None
    if rest < len(text) and text[rest] == " ":  # "\boxed 5$"
        match = re.match(r"\s+([^\s$]+)", text[rest:])
        return match.group(1) if match else None
    return None


def _unwrap(text: str, command: str) -> str:
    """``\\text{abc}`` → ``abc`` for every occurrence of ``command`` (nested braces kept)."""
    out = text
    while True:
        at = out.find(command + "{")
        if at < 0:
            return out
        brace = at + len(command)
        end = _matching_brace(out, brace)
        if end is None:
            return out
        out = out[:at] + out[brace + 1 : end] + out[end + 1 :]


def _fix_shorthand(text: str, command: str, nargs: int) -> str:
    """``\\frac12`` → ``\\frac{1}{2}``, ``\\sqrt3`` → ``\\sqrt{3}``: single-token arguments get braces."""
    parts = text.split(command)
    out = parts[0]
    for part in parts[1:]:
        args = []
        rest = part
        for _ in range(nargs):
            if rest.startswith("{"):
                end = _matching_brace(rest, 0)
                if end is None:
                    break
                args.append(rest[: end + 1])
                rest = rest[end + 1 :]
            elif rest and rest[0] not in "\\[":
                args.append("{" + rest[0] + "}")
                rest = rest[1:]
            else:
                break
        out += command + "".join(args) + rest
    return out


# A unit written as text after the answer ("10\\text{ inches}", "4\\mbox{ cm}^2"): dropped.
_UNIT_WORDS = re.compile(
    r"\\(?:text|mbox)\{\s*(?:units?|square\s+units|sq\.?\s*units|cm|m|km|inches|inch|feet|foot|ft|"
    r"meters?|miles?|degrees?|dollars?|cents?|hours?|minutes?|seconds?|days?|years?|mph|pounds?)"
    r"\s*\}(?:\^\{?\d\}?)?\s*$"
)


def normalize_answer(answer: str) -> str:
    """A canonical string for a final answer; equal strings mean equal answers."""
    s = str(answer).strip()
    s = s.replace("\n", "").replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\:", "")
    s = re.sub(r"\\(?:quad|qquad)\b", "", s)
    s = s.replace("\\displaystyle", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\bigl", "").replace("\\bigr", "")
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\%", "").replace("%", "")
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s).replace("°", "").replace("\\circ", "")
    s = _UNIT_WORDS.sub("", s) if not re.fullmatch(r"\\text\{[^{}]*\}", s) else s
    for command in ("\\text", "\\textbf", "\\mathrm", "\\mathbf", "\\mbox", "\\textnormal", "\\operatorname"):
        s = _unwrap(s, command)
    s = s.replace("\\{", "{").replace("\\}", "}") if s.startswith("\\{") else s
    s = s.replace(" ", "")
    s = s.rstrip(".")
    s = _fix_shorthand(s, "\\frac", 2)
    s = _fix_shorthand(s, "\\sqrt", 1)
    # "x=5", "k = 3": drop a short variable on the left.
    if s.count("=") == 1 and re.fullmatch(r"[A-Za-z](?:_\{?\w+\}?)?|\\[a-z]+", s.split("=")[0]):
        s = s.split("=", 1)[1]
    # Thousands separators in a plain number ("2,000" → "2000"); lists like "1,2" stay.
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    s = re.sub(r"(?<![\d}])\.(\d)", r"0.\1", s)  # ".5" → "0.5"
    if re.fullmatch(r"-?\d+\.\d*?0+", s):  # "2.50" → "2.5", "3.0" → "3"
        s = s.rstrip("0").rstrip(".")
    if re.fullmatch(r"-?\d+/\d+", s):  # "3/4" → "\frac{3}{4}"
        num, den = s.split("/")
        sign = "-" if num.startswith("-") else ""
        s = f"{sign}\\frac{{{num.lstrip('-')}}}{{{den}}}"
    return s


def _as_number(s: str) -> Fraction | None:
    """Plain numbers and ``\\frac{a}{b}`` (with optional sign) as exact fractions."""
    try:
        if re.fullmatch(r"-?\d+(?:\.\d+)?", s):
            return Fraction(s)
        match = re.fullmatch(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", s)
        if match:
            value = Fraction(match.group(2)) / Fraction(match.group(3))
            return -value if match.group(1) else value
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _math_verify_equal(predicted: str, reference: str) -> bool:
    try:
        from math_verify import parse, verify
    except ImportError:
        return False
    try:
        gold = parse("$" + reference + "$")
        pred = parse("$" + predicted + "$")
        return bool(gold and pred and verify(gold, pred))
    except Exception:  # noqa: BLE001 - math-verify is a best-effort second opinion
        return False


def is_equiv(predicted: str, reference: str, *, use_math_verify: bool = True) -> bool:
    """Whether two final answers are the same after normalisation (or numerically, or by math-verify)."""
    a, b = normalize_answer(predicted), normalize_answer(reference)
    if a == b:
        return True
    na, nb = _as_number(a), _as_number(b)
    if na is not None and nb is not None:
        return na == nb
    return use_math_verify and _math_verify_equal(predicted, reference)


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    *,
    use_math_verify: bool = True,
) -> float:
    """1.0 if the last boxed answer of ``solution_str`` equals ``ground_truth``, else 0.0."""
    predicted = last_boxed(solution_str)
    if predicted is None:
        return 0.0
    reference = last_boxed(ground_truth) or str(ground_truth)
    return 1.0 if is_equiv(predicted, reference, use_math_verify=use_math_verify) else 0.0
