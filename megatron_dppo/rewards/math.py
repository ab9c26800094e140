"""Built-in rewards for math answers: math-verify, GSM8K, boxed answers, an answer-format bonus, exact arithmetic.

Every reward here has the signature ``reward(completion: str, gold) -> float`` and returns 1.0 (correct) or 0.0.

- ``math_verify_reward``: symbolic equivalence with `math-verify`. The gold answer is wrapped in ``$...$`` unless it
  already carries ``$`` or ``\\boxed{}`` (a bare LaTeX string parses to nothing). The prediction is the model's
  last ``\\boxed{}`` answer when there is one, otherwise the last LaTeX / plain expression it wrote.
  math-verify bounds its own parsing and comparison time with ``signal.alarm``, which only works in the main thread;
  off the main thread these calls run without that internal timeout (use ``RewardScorer(isolation="process")`` to
  get a hard time limit there).
- ``gsm8k_reward``: numeric equality of the final answer. Gold: the number after ``#### `` (a bare number is also
  accepted). Prediction: the number after the last ``####``, else the number in the last ``\\boxed{}``, else the
  last number in the text. Commas, ``$`` signs and a trailing period are ignored; 18, 18.0 and 18.00 are equal.
- ``format_reward``: 1.0 when the completion states a final answer where the graders look for it (a ``\\boxed{}``
  or a ``#### `` line), else 0.0. Meant as a small additive bonus next to a correctness reward.
- ``arithmetic_reward``: exact match of the stripped completion with the integer gold (the quickstart task).
- ``arithmetic_worked_reward``: a worked arithmetic answer "7,5,11" (comma-separated integers) whose last
  integer is the gold.
- ``final_number_reward``: the last number in the completion equals the number gold ("The largest number is 91."
  for 91); the procedural tasks' reward (data/procedural.py).
"""
from __future__ import annotations

import re
import threading
from fractions import Fraction
from functools import lru_cache
from typing import Any

# ---------------------------------------------------------------------------------------------------------------
# Answer extraction
# ---------------------------------------------------------------------------------------------------------------

_BOXED_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in ``text``; None when absent.

    Braces are matched, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. An unclosed box gives None.
    """
    start = max(text.rfind(cmd) for cmd in _BOXED_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOXED_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    if i < len(text) and text[i] == " ":  # "\boxed 5": the argument runs to the next space or "$"
        match = re.match(r" +([^\s$]+)", text[i:])
        return match.group(1) if match else None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


# A number: optional sign, digits with optional thousands separators, optional decimals; or a bare ".5".
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


def parse_number(text: str) -> Fraction | None:
    """The first number in ``text`` as an exact Fraction ("1,234.50" -> 2469/2), ignoring ``$`` and commas; None
    when there is no number. A simple ``a/b`` fraction or ``\\frac{a}{b}`` is read as a/b."""
    cleaned = text.replace("\\$", "").replace("$", "").replace("\\!", "").replace("{,}", ",")
    frac = re.search(r"(-?)\\[dt]?frac\{(-?\d+)\}\{(\d+)\}", cleaned)
    if frac:
        value = Fraction(int(frac.group(2)), int(frac.group(3)))
        return -value if frac.group(1) else value
    ratio = re.fullmatch(r"\s*(-?\d+)\s*/\s*(\d+)\s*\.?\s*", cleaned)
    if ratio and int(ratio.group(2)) != 0:
        return Fraction(int(ratio.group(1)), int(ratio.group(2)))
    match = _NUMBER_RE.search(cleaned)
    if not match:
        return None
    return Fraction(match.group(0).replace(",", ""))


def _last_number(text: str) -> Fraction | None:
    matches = _NUMBER_RE.findall(text.replace("\\$", "").replace("$", ""))
    return Fraction(matches[-1].replace(",", "")) if matches else None


def format_number(value: Fraction) -> str:
    """Canonical text of a number: "18" for 18 and 18.0, "0.5" for 1/2, "1/3" when not a finite decimal."""
    if value.denominator == 1:
        return str(value.numerator)
    as_float = float(value)
    if Fraction(repr(as_float)) == value:
        return repr(as_float)
    return f"{value.numerator}/{value.denominator}"


def extract_gsm8k_gold(answer: str) -> str:
    """The gold number of a GSM8K ``answer`` field (the text after ``#### ``), normalized ("1,000" -> "1000").

    A bare number (already extracted) is accepted too. Raises ValueError when neither is present."""
    text = str(answer)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    value = parse_number(text)
    if value is None:
        raise ValueError(f"GSM8K gold answer has no number after '#### ': {answer[-80:]!r}")
    return format_number(value)


def extract_gsm8k_prediction(completion: str) -> str | None:
    """The model's final number: after the last ``####``, else in the last ``\\boxed{}``, else the last number in
    the text; normalized like the gold. None when the completion contains no number."""
    if "####" in completion:
        value = parse_number(completion.rsplit("####", 1)[1])
        if value is not None:
            return format_number(value)
    boxed = last_boxed(completion)
    if boxed is not None:
        value = parse_number(re.sub(r"\\text\{[^}]*\}", "", boxed))
        if value is not None:
            return format_number(value)
    value = _last_number(completion)
    return None if value is None else format_number(value)


# ---------------------------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------------------------


def gsm8k_reward(completion: str, gold: Any) -> float:
    """1.0 when the completion's final number equals the GSM8K gold number (see module docstring), else 0.0."""
    predicted = extract_gsm8k_prediction(completion)
    if predicted is None:
        return 0.0
    return float(Fraction(predicted) == Fraction(extract_gsm8k_gold(str(gold))))


MATH_VERIFY_TIMEOUT_S = 5


def _math_verify_timeout() -> int | None:
    """math-verify's signal-based timeouts only work in the main thread; elsewhere disable them (see docstring)."""
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def wrap_gold_for_math_verify(gold: str) -> str:
    """``$gold$`` unless the gold already has math delimiters or a ``\\boxed{}``."""
    text = str(gold).strip()
    if "\\boxed" in text or "$" in text or text.startswith("\\(") or text.startswith("\\["):
        return text
    return f"${text}$"


@lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout: int | None):
    from math_verify import parse

    return parse(wrap_gold_for_math_verify(gold), parsing_timeout=timeout)


_LATEX_NOISE = re.compile(r"\\left|\\right|\\[!,;: ]|\\displaystyle|\\text\{\s*\}|\$|\s")


def normalize_answer_text(text: str) -> str:
    """An answer's text with the formatting that never changes its meaning removed: ``$``, spaces, ``\\left`` /
    ``\\right``, LaTeX spacing commands, a trailing period; ``\\dfrac`` / ``\\tfrac`` read as ``\\frac``."""
    text = _LATEX_NOISE.sub("", str(text)).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return text.rstrip(".")


def math_verify_reward(completion: str, gold: Any) -> float:
    """1.0 when math-verify finds the completion's answer equivalent to ``gold``, else 0.0.

    A boxed answer whose text equals the gold up to formatting (``normalize_answer_text``) is correct too: this
    covers the gold answers math-verify cannot parse or times out on (differential equations, lists of
    tuples, "9:03:36 a.m."; a few percent of Minerva Math and OlympiadBench). A gold answer math-verify cannot
    parse and the completion does not match textually raises ValueError (the scorer turns that into a 0 and a
    warning)."""
    from math_verify import parse, verify

    boxed = last_boxed(completion)
    if boxed is not None and normalize_answer_text(boxed) == normalize_answer_text(gold) != "":
        return 1.0
    timeout = _math_verify_timeout()
    gold_parsed = _parse_gold(str(gold), timeout)
    if not gold_parsed:
        raise ValueError(f"math-verify cannot parse the gold answer {str(gold)[:80]!r}")
    predicted = parse(completion, parsing_timeout=timeout)
    if not predicted:
        return 0.0
    return float(verify(gold_parsed, predicted, timeout_seconds=timeout))


def format_reward(completion: str, gold: Any = None) -> float:
    """1.0 when the completion gives a final answer in ``\\boxed{}`` or after ``#### ``, else 0.0."""
    if last_boxed(completion):
        return 1.0
    if "####" in completion and parse_number(completion.rsplit("####", 1)[1]) is not None:
        return 1.0
    return 0.0


_INTEGER_RE = re.compile(r"-?\d+")


def arithmetic_reward(completion: str, gold: Any) -> float:
    """1.0 when the stripped completion is exactly the integer ``gold`` (e.g. "33" for "12+7*3="), else 0.0."""
    text = completion.strip()
    return float(bool(_INTEGER_RE.fullmatch(text)) and int(text) == int(str(gold).strip()))


_WORKED_RE = re.compile(r"-?\d+(,-?\d+)*")


def arithmetic_worked_reward(completion: str, gold: Any) -> float:
    """1.0 when the stripped completion is comma-separated integers ("7,5,11") whose last one is ``gold``; the
    intermediate totals are the model's working and are not scored."""
    text = completion.strip()
    return float(bool(_WORKED_RE.fullmatch(text)) and int(text.rsplit(",", 1)[-1]) == int(str(gold).strip()))


def final_number_reward(completion: str, gold: Any) -> float:
    """1.0 when the last number written in the completion equals the number ``gold`` (18, 18.0 and "18." are
    equal; "1,234" is one number), else 0.0; a completion without a number scores 0."""
    value = _last_number(completion)
    return float(value is not None and value == Fraction(str(gold).strip()))
