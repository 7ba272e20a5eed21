"""How an on/off value is read, from the environment or from code: one rule for every switch."""

from __future__ import annotations

from typing import Any

_TRUE = {"1", "true", "on"}
_FALSE = {"0", "false", "off"}


def parse_switch(value: Any) -> Any:
    """Accept 1/0, true/false, on/off in any case (and real booleans); refuse anything else."""
    if isinstance(value, bool) or value is None:
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError("accepted values are 1/0, true/false, on/off (any case)")
