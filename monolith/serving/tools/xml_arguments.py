"""A string parameter of Qwen3.5/3.6's XML tool calls is raw text, not JSON: the regex
its text must match, for llguidance (structured.py builds the call grammar around it).

The schema's `enum` / `const` (their string members), `pattern`, `minLength` /
`maxLength` (in characters) and `format` all hold at once. A `pattern` is anchored at
both ends, as llguidance anchors it in JSON (a match is then also a match anywhere, so
the text stays valid). Each format is a regex of its RFC's grammar, or of a strict part
of it where the whole cannot be a regex (dates check their month's length; times have
no leap second and at most 9 digits of fraction; hostnames, emails and URIs are ASCII).
A format not listed in FORMATS, and a keyword that would restrict a string in a way this
module does not implement (`anyOf`, `$ref`, `not`...), are refused with a 400 naming the
parameter: ignoring them would change what the call may hold. Keywords that do not apply
to strings, and annotations, change nothing.

The text can never hold the tags that would end it early for serving/tools/calls.py:
`</parameter>`, `</function>` and `</tool_call>`.
"""

from __future__ import annotations

import json

import llguidance

from ..errors import bad

CLOSING_TAGS = ("</parameter>", "</function>", "</tool_call>")
UNSUPPORTED = ("allOf", "anyOf", "oneOf", "not", "$ref", "$dynamicRef", "if", "then", "else")
REGEX_SPECIAL = "\\.+*?()|[]{}^$#&~-/"


def _escape(char: str) -> str:
    return "\\" + char if char in REGEX_SPECIAL else char


def _avoiding(tags) -> str:
    """A regex of the texts that hold none of `tags` (each begins with `<` and holds no
    other `<`), written without negation: llguidance's lexer cannot intersect a negation
    with a long count (`.{0,60}` already exhausts it). After each `<` the text follows a
    tag's spelling for a while, then leaves it by a character no tag continues with (a
    `<` starts over); a text may end inside a spelling."""
    trie: dict = {}
    for tag in tags:
        node = trie
        for char in tag[1:]:
            node = node.setdefault(char, {})

    def prefixes(node: dict) -> str:  # the spellings a text may stop at (no tag is whole)
        branches = [_escape(c) + prefixes(child) for c, child in sorted(node.items()) if child]
        return "(?:" + "|".join(["", *branches]) + ")" if branches else ""

    def departures(node: dict) -> str:  # a spelling, then a character that leaves every tag
        leave = "[^<" + "".join(_escape(c) for c in sorted(node)) + "]"
        branches = [_escape(c) + departures(child) for c, child in sorted(node.items()) if child]
        return "(?:" + "|".join([leave, *branches]) + ")"

    stop = "<" + prefixes(trie)
    return f"(?:[^<]|(?:{stop})*<{departures(trie)})*(?:{stop})*"


NO_CLOSING_TAG = f"/{_avoiding(CLOSING_TAGS)}/"

# ------------------------------------------------------------------ formats (regex text)

DIGIT_RUN = "[0-9]{1,9}"
YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"  # 0001-9999
MULTIPLE_OF_4 = "(?:0[48]|[2468][048]|[13579][26])"  # 04..96
LEAP_YEAR = f"(?:[0-9]{{2}}{MULTIPLE_OF_4}|{MULTIPLE_OF_4}00)"
MONTH_DAY = ("(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
             "|02-(?:0[1-9]|1[0-9]|2[0-8]))")
DATE = f"(?:{YEAR}-{MONTH_DAY}|{LEAP_YEAR}-02-29)"
HOUR_MINUTE = "(?:[01][0-9]|2[0-3]):[0-5][0-9]"
TIME = f"{HOUR_MINUTE}:[0-5][0-9](?:\\.[0-9]{{1,9}})?(?:Z|[+\\-]{HOUR_MINUTE})"
DURATION_TIME = (f"T(?:{DIGIT_RUN}H(?:{DIGIT_RUN}M(?:{DIGIT_RUN}S)?)?|{DIGIT_RUN}M(?:{DIGIT_RUN}S)?"
                 f"|{DIGIT_RUN}S)")
DURATION_DATE = (f"(?:{DIGIT_RUN}D|{DIGIT_RUN}M(?:{DIGIT_RUN}D)?|{DIGIT_RUN}Y(?:{DIGIT_RUN}M(?:{DIGIT_RUN}D)?)?)"
                 f"(?:{DURATION_TIME})?")
DURATION = f"P(?:{DURATION_DATE}|{DURATION_TIME}|{DIGIT_RUN}W)"
OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
IPV4 = f"{OCTET}(?:\\.{OCTET}){{3}}"
LABEL = "[A-Za-z0-9](?:[A-Za-z0-9\\-]{0,61}[A-Za-z0-9])?"
HOSTNAME = f"(?:{LABEL}(?:\\.{LABEL})*)"
ATOM = "[A-Za-z0-9!#$%\\&'*+\\/=?\\^_`{|}\\~\\-]+"
EMAIL_LOCAL = f"{ATOM}(?:\\.{ATOM})*"
HEX = "[0-9A-Fa-f]"
UUID = f"{HEX}{{8}}-{HEX}{{4}}-{HEX}{{4}}-{HEX}{{4}}-{HEX}{{12}}"
PCT = f"%{HEX}{{2}}"
PCHAR = f"(?:[A-Za-z0-9\\-._\\~!$\\&'()*+,;=:@]|{PCT})"
AUTHORITY = (f"(?:(?:[A-Za-z0-9\\-._\\~!$\\&'()*+,;=:]|{PCT})*@)?"
             f"(?:[A-Za-z0-9\\-._\\~!$\\&'()*+,;=]|{PCT})*(?::[0-9]*)?")
URI = (f"[A-Za-z][A-Za-z0-9+\\-.]*:(?:\\/\\/{AUTHORITY}(?:\\/{PCHAR}*)*|\\/(?:{PCHAR}+(?:\\/{PCHAR}*)*)?"
       f"|{PCHAR}+(?:\\/{PCHAR}*)*)?(?:\\?(?:{PCHAR}|[\\/?])*)?(?:#(?:{PCHAR}|[\\/?])*)?")


def _ipv6() -> str:
    """RFC 4291's text forms: 8 groups, or fewer around one `::` (which stands for at
    least one group), the last two groups possibly written as an IPv4 address."""
    group = f"{HEX}{{1,4}}"

    def run(n: int, tail: str = "") -> str:
        return ":".join([group] * n + ([tail] if tail else []))

    forms = [run(8), run(6, IPV4)]
    for width, tail in ((8, ""), (6, IPV4)):
        for left in range(width):
            for right in range(width - left):
                forms.append(f"{run(left)}::{run(right, tail)}")
    return "(?:" + "|".join(forms) + ")"


def _bounded(regex: str, most: int) -> str:
    """A Lark lexeme: `regex`, at most `most` characters long."""
    return f"(/{regex}/ & /(?s:.){{1,{most}}}/)"


# Lark lexeme expressions (a regex between slashes; `&` intersects them)
FORMATS = {"date": f"/{DATE}/", "time": f"/{TIME}/", "date-time": f"/{DATE}T{TIME}/", "duration": f"/{DURATION}/",
           "email": f'{_bounded(EMAIL_LOCAL, 64)} "@" {_bounded(HOSTNAME, 253)}',
           "hostname": _bounded(HOSTNAME, 253), "ipv4": f"/{IPV4}/", "ipv6": f"/{_ipv6()}/", "uuid": f"/{UUID}/",
           "uri": f"/{URI}/"}


# ------------------------------------------------------------------ schema -> lexeme


def is_raw_text(schema) -> bool:
    """Whether a parameter of this schema is written (and read back) as raw text."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind == "string" or kind == ["string"]


def lexeme(schema: dict, where: str) -> str:
    """The Lark lexeme body for the raw text of a string parameter whose schema is
    `schema` (`where` names it in errors, e.g. "tool 'paint': parameters.properties.color")."""
    for key in UNSUPPORTED:
        if key in schema:
            raise bad(f"{where}.{key}: not supported for a string parameter written as raw text "
                      "(the chat template's XML tool calls)", "tools")
    terms = [term for term in (_choices(schema, where), _pattern(schema, where), _length(schema, where),
                               _format(schema, where)) if term]
    return " & ".join([*(f"({term})" for term in terms), NO_CLOSING_TAG])


def _choices(schema: dict, where: str) -> str | None:
    """`const` / `enum` (both, when both are given) as an alternation of string literals."""
    if "const" not in schema and "enum" not in schema:
        return None
    values = schema.get("enum", [])
    if not isinstance(values, list):
        raise bad(f"{where}.enum must be an array", "tools")
    if "const" in schema:
        values = [schema["const"]] if "enum" not in schema or schema["const"] in values else []
    key = "const" if "const" in schema else "enum"
    strings = [v for v in values if isinstance(v, str) and not any(tag in v for tag in CLOSING_TAGS)]
    if not strings:
        raise bad(f"{where}.{key}: no value that raw text can hold (a string that const and enum allow, "
                  "without </parameter>, </function> or </tool_call>)", "tools")
    return " | ".join(json.dumps(v, ensure_ascii=False) for v in dict.fromkeys(strings))


def _pattern(schema: dict, where: str) -> str | None:
    pattern = schema.get("pattern")
    if pattern is None:
        return None
    if not isinstance(pattern, str):
        raise bad(f"{where}.pattern must be a string", "tools")
    regex = "/" + llguidance.regex_to_lark(pattern, "dw") + "/"  # JSON schema's \d and \w are ASCII
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_lark(f"start: X\nX: {regex}"), None)
    if failed:
        detail = messages[0].splitlines()[0] if messages else "invalid"
        raise bad(f"{where}.pattern {pattern!r} is not supported: {detail}", "tools")
    return regex


def _length(schema: dict, where: str) -> str | None:
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    for key, value in (("minLength", low), ("maxLength", high)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise bad(f"{where}.{key} must be an integer >= 0", "tools")
    if low == 0 and high is None:
        return None
    return f"/(?s:.){{{low},{'' if high is None else high}}}/"


def _format(schema: dict, where: str) -> str | None:
    name = schema.get("format")
    if name is None:
        return None
    if name not in FORMATS:
        raise bad(f"{where}.format {name!r} is not supported (supported: {', '.join(sorted(FORMATS))})", "tools")
    return FORMATS[name]
