"""The field policy every API shares (docs/api-fields.md): a field the server does not
know is refused, not ignored, with a 400 naming it (its `param`): at the top of a body
(`refuse_unknown`) or inside one of its objects (`refuse_extra`); a field accepted only
at its neutral value (the one that means "off", or the API's default) is refused at any
other (`refuse_non_neutral`). And a field's value checked against the type it must have
(`optional`, `positive_int`, `real`): JSON null counts as not given."""

from __future__ import annotations

import json
import math
import numbers

from .errors import bad


def refuse_unknown(given, known, where: str = "") -> None:
    """A 400 naming every field of `given` (names) that `known` lacks, the first as the
    param; `where` is their prefix (e.g. "tool_choice.")."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        names = ", ".join(f"{where}{k}" for k in unknown)
        raise bad(f"unsupported field{'s' if len(unknown) > 1 else ''}: {names} (fields that would change the "
                  "result are refused, not ignored)", f"{where}{unknown[0]}")


def refuse_non_neutral(body: dict, neutral_values: dict, wording: dict | None = None) -> None:
    """A 400 for the first field of `neutral_values` that `body` gives at another value;
    `wording` may say, for a field, what is supported instead of the default wording."""
    for name, neutral in neutral_values.items():
        value = body.get(name)
        if value is not None and not _same(value, neutral):
            what = (wording or {}).get(name, f"{name} is not supported (only {json.dumps(neutral)})")
            raise bad(f"{what}, got {json.dumps(value)[:60]}", name)


def _same(value, neutral) -> bool:
    """Equal as JSON values: numbers alike (0 and 0.0), booleans apart from numbers."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def refuse_extra(value: dict, allowed, at: str, label: str | None = None) -> None:
    """A 400 naming the fields of the object at `at` that `allowed` lacks, the first as
    the param (`at.FIELD`); `label` names the object in the message (default: `at`)."""
    extra = sorted(set(value) - set(allowed))
    if extra:
        raise bad(f"{label or at} has unsupported field(s): {', '.join(extra)}", f"{at}.{extra[0]}")


def is_name(value, names) -> bool:
    """`value` is one of `names` (strings): a number, list or object never is (and a list
    or object, unhashable, is never looked up in a set or dict)."""
    return isinstance(value, str) and value in names


def is_int(value) -> bool:
    """An integer, not a boolean (JSON's true is not 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def optional(body: dict, name: str, kind, want: str, param: str | None = None):
    """`body[name]` if it is a `kind` (`want` words it for the 400), None if not given."""
    value = body.get(name)
    if value is None:
        return None
    ok = is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise bad(f"{param or name} must be {want}, got {json.dumps(value)[:60]}", param or name)
    return value


def positive_int(body: dict, name: str) -> int | None:
    value = optional(body, name, int, "an integer >= 1")
    if value is not None and value < 1:
        raise bad(f"{name} must be an integer >= 1, got {value}", name)
    return value


def real(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise bad(f"{name} must be a finite number, got {json.dumps(value)[:60]}", name)
    return float(value)
