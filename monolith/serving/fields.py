"""The field policy every API shares (docs/api-fields.md), declared on the typed request
bodies each API parses its JSON body into (pydantic models, `Body`), and the 400 a body
gets when it breaks it.

A body's fields are declared as pydantic fields; a field's policy is a marker in its
`Annotated` metadata: no marker, it is honoured; `inert(why)`: accepted, no effect
(metadata, ids, client and caching hints: still of the type declared); `neutral(value,
why)`: refused, but accepted at the value that means "off" (or the API's default);
`refused(why)`: refused whatever its value. A field the body does not declare is refused
too (a typo must not pass as a default). `Body`'s own check runs before the fields'
types are: refused fields first, then unknown ones, then neutral ones, each a 400 naming
the field (`param`). JSON null counts as not given, except that a body whose
`nulls_given` is true (Anthropic's) refuses an unknown field even when it is null; a
body whose `nulls_anywhere_unset` is true (Ollama's) leaves out nulls at any depth. A
Body may be nested in another (Ollama's `options`): its policy is checked as the outer
one's, and its refusals name its fields by their path (`options.mirostat`).

`parse(model, body)` validates a body (or any object) against a model: a value of the
wrong type anywhere is a 400 whose `param` is its path (`messages[2].content[0].text`)
and whose message says what it must be; a validator's own `bad(...)` passes through as
it is. Objects nested in a body are `Strict` models: a field they do not declare is
refused naming it. `policy(model)` lists a body's declared fields with their marks (the
rows of docs/api-fields.md's tables).

The helpers at the end (`refuse_unknown`, `refuse_extra`, `is_name`) are for the parts
of a body still read by hand (an image part, a schema, a context edit, a Responses item)."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from .errors import APIError, bad

HONOURED, INERT, REFUSED = "honoured", "accepted, no effect", "refused"
_UNSET = object()


@dataclass(frozen=True)
class Policy:
    """A field's mark (HONOURED, INERT, REFUSED) and why; a refused field with a
    `neutral` value accepts that value (`wording`: what the 400 says instead of the
    default)."""

    mark: str
    why: str = ""
    neutral: Any = _UNSET
    wording: str | None = None


def inert(why: str) -> Policy:
    return Policy(INERT, why)


def refused(why: str) -> Policy:
    return Policy(REFUSED, why)


def neutral(value, why: str, wording: str | None = None) -> Policy:
    return Policy(REFUSED, why, value, wording)


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


# the JSON types a body's fields take (strict: "1" is no integer, true is no 1)
Text = StrictStr
Flag = StrictBool
Integer = StrictInt
Positive = Annotated[StrictInt, Field(ge=1)]
Real = Annotated[float, Field(strict=True), AfterValidator(_finite)]
Object = dict[str, Any]


class Strict(BaseModel):
    """An object nested in a body: its fields' types strict, a field it does not
    declare refused."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


def by_type(tags, implied: str | None = None) -> Discriminator:
    """A union's member chosen by an object's `type`: `tags` maps a type to its member's
    tag (a collection: each type is its own tag); an object of no type has the type
    `implied` when given; any other value is the "other" member's (it refuses it)."""
    tags = tags if isinstance(tags, dict) else {tag: tag for tag in tags}

    def tag(value) -> str:
        kind = value.get("type", implied) if isinstance(value, dict) else None
        return tags.get(kind, "other") if isinstance(kind, str) else "other"
    return Discriminator(tag)


class Body(BaseModel):
    """A request body, its field policy declared on its fields (above). A Body may also be
    nested in another (Ollama's `options`): its refusals then name the fields by their
    path in the whole body."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    nulls_given: ClassVar[bool] = False  # a null field counts as sent (an unknown one is refused)
    nulls_anywhere_unset: ClassVar[bool] = False  # a null anywhere inside counts as not given (Ollama's)

    @model_validator(mode="before")
    @classmethod
    def _policy(cls, body):
        if not isinstance(body, dict):
            return body
        if cls.nulls_anywhere_unset:
            body = without_nulls(body)
        given = {k: v for k, v in body.items() if v is not None}
        checked = body if cls.nulls_given else given
        if policy_fault(cls, checked) is not None:
            raise _Refusal(cls, checked)  # `refusal` words it, where it is in the body
        return given


class _Refusal(ValueError):
    """A Body's policy broken, raised inside pydantic's validation so that `refusal` can
    name the fields by their path in the whole body (`policy_fault` with that prefix)."""

    def __init__(self, model: type[BaseModel], given: dict):
        super().__init__(f"{model.__name__}'s field policy")
        self.model, self.given = model, given


def without_nulls(value):
    """`value` with every object's null fields left out, at any depth."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


@functools.cache
def policy(model: type[BaseModel]) -> dict[str, Policy]:
    """The declared fields of a body (by their JSON names) and their policy."""
    out = {}
    for name, info in model.model_fields.items():
        marks = [m for m in info.metadata if isinstance(m, Policy)]
        out[info.alias or name] = marks[0] if marks else Policy(HONOURED)
    return out


def policy_fault(model: type[BaseModel], given: dict, where: str = "") -> APIError | None:
    """The 400 for the first field of `given` (the body's fields as sent) that the
    model's policy refuses: a refused field, an unknown one, one off its neutral value;
    `where` prefixes the fields' names (a nested body's path and a dot)."""
    rules, refusing, neutrals = _rules(model)
    stopped = sorted(refusing.intersection(given))
    if stopped:
        return bad(f"{where}{stopped[0]}: {rules[stopped[0]].why}", f"{where}{stopped[0]}")
    if not rules.keys() >= given.keys():
        try:
            refuse_unknown(given, rules, where)
        except APIError as e:
            return e
    for name in sorted(neutrals.intersection(given)):
        rule, value = rules[name], given[name]
        if value is not None and not _same(value, rule.neutral):
            what = rule.wording or f"{where}{name} is not supported (only {json.dumps(rule.neutral)})"
            return bad(f"{what}, got {json.dumps(value)[:60]}", f"{where}{name}")
    return None


@functools.cache
def _rules(model: type[BaseModel]) -> tuple[dict[str, Policy], frozenset[str], frozenset[str]]:
    """(the policy, the fields refused whatever their value, those accepted at a neutral value)."""
    rules = policy(model)
    refusing = frozenset(k for k, r in rules.items() if r.mark == REFUSED and r.neutral is _UNSET)
    return rules, refusing, frozenset(k for k, r in rules.items() if r.neutral is not _UNSET)


def _same(value, neutral) -> bool:
    """Equal as JSON values: numbers alike (0 and 0.0), booleans apart from numbers."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


# ------------------------------------------------------------------ a wrong type, named by its path


def parse(model: type[BaseModel], value, where: str = ""):
    """`value` validated as a `model`, or the 400 naming the first fault's path (after
    `where`, the path of `value` in its body)."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise refusal(e.errors(include_url=False), value, where) from None


WANTS = {"string_type": "a string", "bool_type": "true or false", "int_type": "an integer",
         "int_from_float": "an integer", "float_type": "a number", "dict_type": "an object",
         "model_type": "an object", "model_attributes_type": "an object", "list_type": "a list",
         "finite_number": "a finite number", "none_required": "null", "string_too_short": "a non-empty string"}


def refusal(errors: list[dict], body, where: str = "") -> APIError:
    """The 400 for pydantic's `errors` about `body`: the deepest fault (an alternative of
    a union that does not apply fails less deep), its param the path in the body."""
    located = [(([where] if where else []) + _path(e["loc"], body, e["type"]), e) for e in errors]
    for path, e in located:  # a Body's policy first, as a body's own refusals come before its types
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, _Refusal):
            prefix = _param(path)
            return policy_fault(cause.model, cause.given, f"{prefix}." if prefix else "")
    extra = [(path, e) for path, e in located if e["type"] == "extra_forbidden"]
    if extra:  # a field an object does not declare, all of that object's named at once
        parent = extra[0][0][:-1]
        names = sorted(str(path[-1]) for path, _ in extra if path[:-1] == parent)
        return bad(f"{_param(parent) or 'the body'} has unsupported field{'s' if len(names) > 1 else ''}: "
                   f"{', '.join(names)} (fields that would change the result are refused, not ignored)",
                   _param([*parent, names[0]]))
    deepest = max(len(path) for path, _ in located)
    path, first = next((path, e) for path, e in located if len(path) == deepest)
    param = _param(path)
    kind = first["type"]
    if kind == "missing":
        return bad(f"{param} is required", param)
    wants = []
    for p, e in located:
        want = WANTS.get(e["type"]) or _constraint(e)
        if p == path and want and want not in wants:
            wants.append(want)
    if not wants:
        reason = str(first["msg"]).removeprefix("Value error, ")
        return bad(f"{param} {reason}" if reason.startswith("must be ") else f"{param}: {reason}", param)
    got = json.dumps(first.get("input"), default=str)[:60]
    return bad(f"{param} must be {' or '.join(wants)}, got {got}", param)


def _constraint(error: dict) -> str | None:
    ctx = error.get("ctx") or {}
    kind = error["type"]
    if kind == "literal_error":
        return f"one of {ctx['expected']}" if " or " in ctx["expected"] else ctx["expected"]
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        sign = {"greater_than_equal": ">=", "less_than_equal": "<=", "greater_than": ">", "less_than": "<"}[kind]
        bound = next(iter(ctx.values()))
        return f"{'an integer' if isinstance(bound, int) else 'a number'} {sign} {bound}"
    if kind == "too_short":
        return "a non-empty list" if ctx.get("min_length") == 1 else f"a list of at least {ctx.get('min_length')}"
    if kind == "too_long":
        return f"{'an object' if isinstance(error.get('input'), dict) else 'a list'} of at most {ctx.get('max_length')}"
    return None


def _path(loc: tuple, body, kind: str) -> list:
    """The path of `loc` in `body`: pydantic's location less the labels of union
    members (a member's type, a tagged member's tag), which name no field of the body.
    A label may also be a key of the object it labels (a text block's tag, "text"): the
    reading that ends at the location's last element, then the longest, is taken."""
    return _walk(loc, 0, body, kind in ("missing", "extra_forbidden"))[1]


def _walk(loc: tuple, i: int, value, named_last: bool) -> tuple[tuple[bool, int], list]:
    """((whether the last element was read, elements read), the path) of loc[i:] in `value`."""
    if i == len(loc):
        return (True, 0), []
    key, last = loc[i], i == len(loc) - 1
    skip = ((False, 0), []) if last or not isinstance(key, str) else _walk(loc, i + 1, value, named_last)
    if (isinstance(value, list) and isinstance(key, int) and 0 <= key < len(value)) or (
            isinstance(value, dict) and key in value):
        inner = value[key]
    elif last and named_last and isinstance(value, dict):  # a field missing, or one not declared
        return (True, 1), [key]
    else:
        return skip
    (read_last, n), rest = _walk(loc, i + 1, inner, named_last)
    return max(((read_last, n + 1), [key, *rest]), skip, key=lambda r: r[0])


def _param(path: list) -> str:
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


# ------------------------------------------------------------------ what is read by hand


def refuse_unknown(given, known, where: str = "") -> None:
    """A 400 naming every field of `given` (names) that `known` lacks, the first as the
    param; `where` is their prefix (e.g. "tool_choice.")."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        names = ", ".join(f"{where}{k}" for k in unknown)
        raise bad(f"unsupported field{'s' if len(unknown) > 1 else ''}: {names} (fields that would change the "
                  "result are refused, not ignored)", f"{where}{unknown[0]}")


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
