"""The base class of every method's options: a dataclass that serialises to JSON, like PEFT's configs."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

from .errors import PosEncError


@dataclasses.dataclass
class PosEncConfig:
    """Options of one positional method. Subclasses are dataclasses that set `method`."""

    method: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check option values that do not depend on the model; raise PosEncError naming the bad one."""

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


def require(condition: bool, message: str) -> None:
    """Raise PosEncError(message) unless condition holds (keeps validate() methods one line per rule)."""
    if not condition:
        raise PosEncError(message)
