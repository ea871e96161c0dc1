"""The base class of every method's options: a dataclass that serialises to JSON, like PEFT's configs.

Every config checks its options with the few shared validators below (`require_bool`, `require_choice`,
`require_int`, `require_size`, `require_number`, `require_numbers`), so the rules are written once: types are exact (a bool is
neither an integer nor a float, and a number is not a bool), and numbers stay within ranges that keep the float32
arithmetic of positions, frequencies and biases finite. Each refusal names the option, the bad value and what to
pass instead.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, ClassVar, Sequence

from .errors import PosEncError

# float32 facts the ranges are derived from (positions, angles and biases are computed in float32).
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32; non-zero values below it round towards 0
FLOAT32_EPS = 2.0 ** -23  # the gap between 1 and the next float32
# Every integer up to 2^24 is exact in float32, so 2^24 is the longest distance (and position) that float32
# arithmetic tells apart: the ranges below keep the computations finite for distances up to here.
MAX_DISTANCE = 2 ** 24
# The largest attention-bias magnitude that leaves half of float32's range for the content scores added to it.
BIAS_MAX = FLOAT32_MAX / 2
# The smallest base of sinusoids / RoPE (theta) whose frequencies base ** (-2k / d) are not all 1 in float32.
MIN_BASE = 1.0 + FLOAT32_EPS
BASE_WHY = ("the frequencies base ** (-2k / d) are computed in float32: closer to 1 they all round to 1, and a base "
            "beyond float32's largest number overflows")
# The largest amplitude of something added to the hidden states: normalisation layers square them in float32.
HIDDEN_MAX = math.sqrt(FLOAT32_MAX)
# Normal draws stay within 8 standard deviations (the chance of one beyond is about 1e-15).
NORMAL_REACH = 8.0

# The upper bound of every size option (`require_size`), with its reason: unbounded, mlp_width=10**9 tried to allocate
# about 40 GB (issue 51). Each is what a method can use, far beyond what its paper does.
SIZE_BOUNDS = {
    # windows, trained windows, groups, sink counts, rescale steps: positions themselves
    "positions": (MAX_DISTANCE, "positions past 2^24 are not exact in float32, so a larger size is never reached"),
    # learned tables with one row per position or bucket
    "table": (2 ** 20, "one learned row per position or bucket: 2^20 rows cover a million-token context"),
    # hidden units of a positional MLP or update (FIRE, CAPE, TAPE), computed for every token or query-key pair
    "width": (4096, "hidden units computed for every token or query-key pair: 4096 is over 80x the papers' 32 to 48"),
    # dimensions of a sinusoid or of a rotation block, at most a head's size in use
    "dim": (2 ** 14, "a dimension of a sinusoid or rotation block: 2^14 is 64x the largest head size in use, 256"),
}


@dataclasses.dataclass
class PosEncConfig:
    """Options of one positional method. Subclasses are dataclasses that set `method`."""

    method: ClassVar[str] = ""
    # Options added after checkpoints were first saved whose default now differs from what a checkpoint saved before
    # them computed: {option: the value such a checkpoint meant}. `from_saved_options` fills them in.
    options_before: ClassVar[dict[str, Any]] = {}

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check option values that do not depend on the model; raise PosEncError naming the bad one."""

    def sub_configs(self) -> list["PosEncConfig"]:
        """The configs of the other registered methods this one is built from, named by its options (a hybrid's
        parts, CAPE's bias). Standalone export ships their code too (checkpoints/export.py)."""
        return []

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, **dataclasses.asdict(self)}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_options(cls, **options: Any) -> "PosEncConfig":
        unknown = sorted(set(options) - set(cls.option_names()))
        if unknown:
            valid = ", ".join(cls.option_names()) or "none"
            raise PosEncError(
                f"Unknown option(s) {', '.join(map(repr, unknown))} for method {cls.method!r}; "
                f"its options are: {valid}."
            )
        return cls(**options)

    @classmethod
    def from_saved_options(cls, **options: Any) -> "PosEncConfig":
        """`from_options` for options read from a checkpoint: an option it lacks means what it meant when saved."""
        return cls.from_options(**{**cls.options_before, **options})

    # --- the shared validators ----------------------------------------------------------------------------
    def refuse(self, name: str, problem: str, expected: str, why: str = "") -> None:
        """Raise the one error format: the option, its bad value, what is wrong, and what to pass."""
        value = getattr(self, name)
        reason = f" ({why})" if why else ""
        raise PosEncError(f"{type(self).__name__}.{name}={value!r} {problem}; pass {expected}{reason}.")

    def require_bool(self, name: str) -> None:
        if not isinstance(getattr(self, name), bool):
            self.refuse(name, "is not a bool", "True or False")

    def require_choice(self, name: str, choices: Sequence[str]) -> None:
        value = getattr(self, name)
        if not (isinstance(value, str) and value in choices):
            self.refuse(name, "is not one of the choices", " or ".join(map(repr, choices)))

    def require_size(self, name: str, low: int, kind: str, *, none_means: str | None = None, even: bool = False,
                     why: str = "") -> None:
        """`require_int` up to the bound of its kind of size (SIZE_BOUNDS), whose reason the refusal gives too."""
        high, bound_why = SIZE_BOUNDS[kind]
        self.require_int(name, low, high, none_means=none_means, even=even,
                         why=f"{why}; {bound_why}" if why else bound_why)

    def require_int(self, name: str, low: int, high: int, *, none_means: str | None = None,
                    even: bool = False, why: str = "") -> None:
        """An int (not a bool) in [low, high]; None too when `none_means` says what None stands for. Every integer
        option has an upper bound (sizes: `require_size`)."""
        value = getattr(self, name)
        if value is None and none_means is not None:
            return
        kind = "an even integer" if even else "an integer"
        expected = f"{kind} from {low} to {high}"
        if none_means is not None:
            expected += f", or None ({none_means})"
        if isinstance(value, bool) or not isinstance(value, int):
            self.refuse(name, f"is a {type(value).__name__}, not an integer", expected, why)
        if value < low or (high is not None and value > high) or (even and value % 2):
            self.refuse(name, "is out of range", expected, why)

    def require_number(self, name: str, low: float, high: float = FLOAT32_MAX, *, none_means: str | None = None,
                       why: str = "") -> None:
        """An int or float (not a bool), finite, in [low, high]; None too when `none_means` says what it stands
        for. Non-zero values too small for float32 are refused whatever `low` is (they would round to 0)."""
        value = getattr(self, name)
        if value is None and none_means is not None:
            return
        problem = number_problem(value, low, high)
        if problem:
            expected = number_range(low, high)
            if none_means is not None:
                expected += f", or None ({none_means})"
            self.refuse(name, problem, expected, why)

    def require_numbers(self, name: str, low: float, high: float = FLOAT32_MAX, *, why: str = "") -> None:
        """A non-empty list of numbers, each as `require_number` wants; stored as a list of floats."""
        value = getattr(self, name)
        expected = f"a non-empty list of numbers, each {number_range(low, high)}"
        if not isinstance(value, (list, tuple)) or not value:
            self.refuse(name, "is not a non-empty list", expected, why)
        for item in value:
            problem = number_problem(item, low, high)
            if problem:
                self.refuse(name, f"holds {item!r}, which {problem}", expected, why)
        setattr(self, name, [float(item) for item in value])


def number_problem(value: Any, low: float, high: float) -> str | None:
    """What is wrong with `value` as a number in [low, high], or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"is a {type(value).__name__}, not a number"
    if not math.isfinite(value):
        return "is not finite"
    if value != 0 and abs(value) < FLOAT32_TINY:
        return "is too small for float32 (it would round to 0)"
    if not low <= value <= high:
        return "is out of range"
    return None


def number_range(low: float, high: float) -> str:
    return f"a number from {low:.9g} to {high:.9g}"


def require(condition: bool, message: str) -> None:
    """Raise PosEncError(message) unless condition holds (for rules that tie several options together)."""
    if not condition:
        raise PosEncError(message)
