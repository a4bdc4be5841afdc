"""Math rewards on top of math-verify, with a fast path for plain numbers.

The final ``\\boxed{}`` is the answer. Gold answers are parsed once per distinct value (cached). When both the
gold and the boxed answer are plain decimal numbers they are compared exactly, which is what math-verify
concludes for them too, without its parse (``bench/bench_math_reward.py`` measures the difference). A plain
number may group its thousands by commas (``12,345``, as math-verify reads them) or by spaces or thin spaces
(``12 345``, ``12\\,345``: grpoflow's rule, since math-verify adds the groups: ``1 234`` → 235). One comma after a
first group of four digits or more can only be a decimal comma (``1000,99`` = 1000.99, as math-verify's own tests
read it; its LaTeX parser, which TRL's reward uses, makes a set of it); any other comma or space (``4, 5``,
``2,5``, ``0,111``, ``7 8``) is left to math-verify. Upright constants and operators (``\\mathrm{e}``,
``\\mathrm{i}``, ``\\mathrm{d}x``, ``\\mathrm{sin}``) are written the way math-verify parses them whole
(``upright_to_math``) before either side is parsed: math-verify cuts ``1 - \\frac{1}{\\mathrm{e}}`` short at the
``\\mathrm``. A gold that math-verify's LaTeX parser reads only in part is not judged (None), never scored
against the fragment.
Must not import: Prefect, MLflow, torch, ``tasks``.
"""

from __future__ import annotations

import logging
import re
import threading
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from typing import Any

from reward_fns.text import MAX_ANSWER_CHARS, Completion, boxed_contents, completion_text

# math-verify's own timeout is off on purpose (SIGALRM works only in the main thread; grpoflow bounds the time of
# each reward call itself), so its warning that it is off says nothing a user can act on.
for _name in ("math_verify.grader", "math_verify.parser"):
    logging.getLogger(_name).setLevel(logging.ERROR)

_PLAIN_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")
# Thousands groups: a first group of 1-3 digits (not a lone 0), then groups of exactly three, one separator
# throughout: a comma (also LaTeX's ``{,}``), a space, or a thin space (``\,``, ``\ ``, ``~``).
_GROUPED_NUMBER = re.compile(r"^[+-]?[1-9]\d{0,2}(?P<sep>,|\{,\}| |\\,|\\ |~)\d{3}(?:(?P=sep)\d{3})*(\.\d+)?$")
# One comma after four digits or more: no thousands group starts with four digits, so a decimal comma.
_DECIMAL_COMMA = re.compile(r"^[+-]?\d{4,},\d+$")
_TIMEOUT_SECONDS = 5


def plain_number(text: str) -> Decimal | None:
    """``text`` as a Decimal when it is a plain number, its thousands grouped or not, else None.

    >>> plain_number("1,234"), plain_number(" -7.50 "), plain_number("12 345"), plain_number("\\\\frac{1}{2}")
    (Decimal('1234'), Decimal('-7.50'), Decimal('12345'), None)
    >>> plain_number("1000,99"), plain_number("-12345,6")  # no thousands group has four digits: a decimal comma
    (Decimal('1000.99'), Decimal('-12345.6'))
    >>> [plain_number(t) for t in ["4, 5", "2,5", "0,111", "1,22", "7 8", "1,234 567", "1000,99,5"]]
    [None, None, None, None, None, None, None]
    """
    candidate = text.strip()
    if grouped := _GROUPED_NUMBER.match(candidate):
        candidate = candidate.replace(grouped["sep"], "")
    elif _DECIMAL_COMMA.match(candidate):
        candidate = candidate.replace(",", ".")
    if not _PLAIN_NUMBER.match(candidate):
        return None
    try:
        return Decimal(candidate)
    except InvalidOperation:
        return None


# Letter runs that are mathematics, not prose: functions, constants, operators, LaTeX's words and Greek letters.
_MATH_WORDS = frozenset(
    """sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln lg exp sqrt pi infty infinity inf mod
    gcd lcm max min det dim ker deg arg lim sup frac dfrac tfrac cdot times div pm mp le ge leq geq neq ne
    approx cup cap in notin subset subseteq emptyset varnothing left right begin end matrix pmatrix bmatrix
    vmatrix cases mathbb mathrm mathbf text circ alpha beta gamma delta epsilon varepsilon theta vartheta
    lambda mu nu xi rho sigma tau phi varphi chi psi omega eta zeta kappa iota""".split()  # noqa: SIM905
)
_LETTER_RUN = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")  # not the name of a LaTeX command


def is_prose(answer: str) -> bool:
    r"""Whether a math answer is words rather than mathematics: no digit, and two or more words, or one word of
    three or more letters that is no mathematical name. math-verify reads such text as a product of letters, so
    any arrangement of the same letters in ``\boxed{}`` would be scored correct.

    >>> [is_prose(a) for a in ["see the figure", "undefined", r"\text{no solution}", "x", "ab", r"\frac{\pi}{2}"]]
    [True, True, True, False, False, False]
    >>> [is_prose(a) for a in ["5 meters", r"\sin x", r"(1, \infty)", r"\begin{pmatrix} a & b \end{pmatrix}"]]
    [False, False, False, False]
    """
    if any(character.isdigit() for character in answer):
        return False
    words = [w for w in _LETTER_RUN.findall(answer) if w.lower() not in _MATH_WORDS]
    return len(words) >= 2 or any(len(w) >= 3 for w in words)


# LaTeX's operator names: ``\\mathrm{sin}`` is ``\\sin``.
_OPERATOR_NAMES = frozenset(
    """sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh coth log ln lg exp det gcd max min arg deg dim
    ker lim sup inf""".split()  # noqa: SIM905
)
_UPRIGHT = re.compile(
    r"\\(?:mathrm|operatorname|textrm|mathup|rm)\s*"  # an upright command, then its braced name or one bare letter
    r"(?:\{\s*(?P<braced>\\?[A-Za-z]+)\s*\}|(?P<bare>[A-Za-z]))"
)
_DIFFERENTIAL_NEXT = re.compile(r"\s*(?:[A-Za-z]|\\[A-Za-z])")


def upright_to_math(latex: str) -> str:
    r"""``latex`` with its upright constants and operators written as math-verify reads them: ``\mathrm{e}`` → ``e``
    (Euler's number), ``\mathrm{i}`` → ``i``, ``\mathrm{d}`` before a variable → ``d`` (a differential),
    ``\mathrm{\pi}`` → ``\pi``, ``\mathrm{sin}`` or ``\operatorname{sin}`` → ``\sin``. Anything else upright (a unit
    such as ``\mathrm{cm}``, a ``d`` that is a day) is left as it is.

    >>> upright_to_math(r"1 - \frac{1}{\mathrm{e}}"), upright_to_math(r"\mathrm{e}^{\mathrm{i} \pi}")
    ('1 - \\frac{1}{e}', 'e^{i \\pi}')
    >>> upright_to_math(r"\int x \,\mathrm{d}x"), upright_to_math(r"5\mathrm{d}"), upright_to_math(r"\mathrm{sin}x")
    ('\\int x \\,dx', '5\\mathrm{d}', '\\sin x')
    >>> upright_to_math(r"3\,\mathrm{cm}"), upright_to_math(r"\operatorname{ln} 2"), upright_to_math(r"\rm e")
    ('3\\,\\mathrm{cm}', '\\ln  2', 'e')
    """
    if "\\" not in latex:
        return latex

    def replace(match: re.Match[str]) -> str:
        name = match["braced"] or match["bare"]
        if name in ("e", "i"):
            return name
        if name == "\\pi":
            return "\\pi "  # ``\\mathrm{\\pi}x`` is ``\\pi x``, not ``\\pix``
        if name == "d":
            return "d" if _DIFFERENTIAL_NEXT.match(latex, match.end()) else match[0]
        if name in _OPERATOR_NAMES:
            return f"\\{name} "
        return match[0]

    return _UPRIGHT.sub(replace, latex)


def _timeout() -> int | None:
    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    return _TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None


def load_math_verify() -> Any:
    """math-verify, imported at its first use: it imports sympy and an ANTLR parser, a second that every command
    (``--help``, the registry's) would otherwise pay at start-up."""
    import math_verify

    return math_verify


def partial_parse(text: str) -> str | None:
    """What math-verify's default parse makes of ``text`` when its LaTeX parser cannot read all of it but its
    plain-expression extraction finds a fragment (None otherwise): validation names it in the row's reason.

    >>> partial_parse("4 + \\mathbb{R}"), partial_parse("10^{3"), partial_parse("\\frac{1}{2}")
    ('4', '10', None)
    """
    if parse_gold(text):
        return None
    try:
        fragment = load_math_verify().parse(f"${upright_to_math(text)}$", parsing_timeout=_timeout())
    except Exception:
        return None
    values = [item for item in fragment if not isinstance(item, str)]
    return str(values[0]) if values else None


@lru_cache(maxsize=65536)
def parse_gold(gold: str) -> tuple[Any, ...]:
    """math-verify's LaTeX parse of a gold answer, cached: one parse per distinct gold. Empty when its LaTeX
    parser cannot read the whole answer. (math-verify's default also tries plain-expression extraction, which
    takes a number out of a fragment: ``4 + \\mathbb{R}`` → 4, ``10^{3`` → 10; that is no gold to score against.)

    >>> bool(parse_gold("\\frac{1}{2}")), bool(parse_gold("\\frac{")), bool(parse_gold("4 + \\mathbb{R}"))
    (True, False, False)
    """
    try:
        math_verify = load_math_verify()
        config = [math_verify.LatexExtractionConfig()]
        latex = upright_to_math(gold)
        parsed = tuple(math_verify.parse(f"${latex}$", extraction_config=config, parsing_timeout=_timeout()))
    except Exception:
        return ()
    return parsed if any(not isinstance(item, str) for item in parsed) else ()


def _parse_boxed(answer: str) -> list[Any]:
    math_verify = load_math_verify()
    config = [math_verify.LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
    try:
        latex = upright_to_math(answer)
        return math_verify.parse(f"\\boxed{{{latex}}}", extraction_config=config, parsing_timeout=_timeout())
    except Exception:
        return []


def math_verdict(completion: str, gold: str) -> float | None:
    """1.0 if the boxed answer equals ``gold``, 0.0 if not (or no box), None if ``gold`` cannot be judged
    (unparseable, or words rather than mathematics). Several boxes must all hold the right answer: boxing two
    different answers is hedging, not solving; and a box over ``MAX_ANSWER_CHARS`` characters scores 0.

    >>> math_verdict(r"so \\boxed{42}", "42"), math_verdict(r"\\boxed{41}", "42"), math_verdict("42", "42")
    (1.0, 0.0, 0.0)
    >>> math_verdict(r"\\boxed{\\frac{2}{4}}", "0.5"), math_verdict(r"\\boxed{41} or \\boxed{42}", "42")
    (1.0, 0.0)
    """
    if is_prose(gold) or (plain_number(gold) is None and not parse_gold(gold)):
        return None
    answers = [answer.strip() for answer in boxed_contents(completion)]
    if not answers or any(len(answer) > MAX_ANSWER_CHARS for answer in answers):
        return 0.0
    verdicts = {boxed_verdict(answer, gold) for answer in dict.fromkeys(answers)}
    return 1.0 if verdicts == {1.0} else None if None in verdicts else 0.0


@lru_cache(maxsize=65536)
def boxed_verdict(answer: str, gold: str) -> float | None:
    """The verdict for one boxed answer against one gold, cached: GRPO groups and datasets repeat them."""
    gold_number = plain_number(gold)
    if gold_number is None and not parse_gold(gold):
        return None
    answer_number = plain_number(answer)
    if gold_number is not None and answer_number is not None:
        return float(gold_number == answer_number)
    gold_parsed = parse_gold(gold) if gold_number is None else parse_gold(str(gold_number))
    if not gold_parsed:
        return None
    predicted = _parse_boxed(answer)
    if not any(not isinstance(item, str) for item in predicted):
        return 0.0
    try:
        return float(load_math_verify().verify(list(gold_parsed), predicted, timeout_seconds=_timeout()))
    except Exception:
        return 0.0


def math_accuracy(completions: list[Completion], ground_truth: list[str], **kwargs: Any) -> list[float | None]:
    """Math accuracy: does the final ``\\boxed{}`` answer equal the (normalized) ground truth?

    >>> math_accuracy(completions=[r"\\boxed{7}", r"\\boxed{8}", "7"], ground_truth=["7", "7", "7"])
    [1.0, 0.0, 0.0]
    >>> math_accuracy(completions=[[{"role": "assistant", "content": r"\\boxed{1/2}"}]], ground_truth=["0.5"])
    [1.0]
    """
    return [math_verdict(completion_text(c), str(g)) for c, g in zip(completions, ground_truth, strict=True)]


def boxed_match(completions: list[Completion], ground_truth: list[str], **kwargs: Any) -> list[float | None]:
    """Exact string match of the ``\\boxed{}`` content (whitespace-stripped) with the ground truth; several boxes
    must all match (hedging scores 0).

    >>> boxed_match(completions=[r"\\boxed{ 12 }", r"\\boxed{12.0}", r"\\boxed{1} \\boxed{12}"], ground_truth=["12"]*3)
    [1.0, 0.0, 0.0]
    """
    rewards: list[float | None] = []
    for completion, gold in zip(completions, ground_truth, strict=True):
        answers = {answer.strip() for answer in boxed_contents(completion_text(completion))}
        rewards.append(float(answers == {str(gold).strip()}))
    return rewards
