"""JSON schema -> regex (the approach of outlines' build_regex_from_schema): properties in their declared order,
compact JSON with at most one space where JSON allows whitespace, unsupported keywords refused by name."""
import json
import math
from decimal import Decimal
from functools import lru_cache

from nanoinfer.structured.regex import escape, parse

WHITESPACE = "[ ]?"  # outlines' choice: bounded, so that a model cannot pad forever
STRING_INNER = r'(?:[^"\\\x00-\x1f\x7f-\x9f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'  # one character of a JSON string
STRING = f'"{STRING_INNER}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
BOOLEAN = "(?:true|false)"
NULL = "null"
# Schemas that allow any value ({}, true, json_object's members) nest objects and arrays this deep at most: a
# regular language cannot count brackets.
ANY_VALUE_DEPTH = 3

_SEP = f"{WHITESPACE},{WHITESPACE}"
_COLON = f"{WHITESPACE}:{WHITESPACE}"
_DATE = r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])?"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_LABEL = "[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"  # a DNS label (RFC 1123)
_ATOM = "[a-zA-Z0-9!#$%&'*+/=?^_`{|}~-]+"  # of an email address's local part (RFC 5322's dot-atom)
# email: the common form (a dot-atom local part, a hostname with a dot), not RFC 5322's quoted or bracketed forms.
FORMATS = {"uuid": "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
           "date": _DATE, "time": _TIME, "date-time": f"{_DATE}T{_TIME}", "ipv4": rf"{_OCTET}(?:\.{_OCTET}){{3}}",
           "hostname": rf"{_LABEL}(?:\.{_LABEL})*", "email": rf"{_ATOM}(?:\.{_ATOM})*@{_LABEL}(?:\.{_LABEL})+"}
SCALARS = {"string": STRING, "integer": INTEGER, "number": NUMBER, "boolean": BOOLEAN, "null": NULL}

# Keywords that annotate and constrain nothing (OpenAPI's discriminator, which Pydantic writes beside a tagged union's
# oneOf, names the property that tells the alternatives apart: oneOf constrains already).
_ANNOTATIONS = frozenset({"title", "description", "$schema", "$id", "$comment", "default", "examples", "readOnly",
                          "writeOnly", "deprecated", "$defs", "definitions", "discriminator"})
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_KEYWORDS = {"string": {"minLength", "maxLength", "pattern", "format"}, "integer": set(_BOUNDS),
             "number": set(_BOUNDS), "boolean": set(), "null": set(),
             "array": {"items", "prefixItems", "minItems", "maxItems"},
             "object": {"properties", "required", "additionalProperties"}}
_COMMON = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref"}


def any_value(depth: int = ANY_VALUE_DEPTH) -> str:
    """Any JSON value, objects and arrays nested at most depth deep."""
    scalars = "|".join(SCALARS.values())
    if depth == 0:
        return f"(?:{scalars})"
    inner = any_value(depth - 1)
    return f"(?:{scalars}|{_object_of(inner)}|{_array_of(inner, 0, None)})"


@lru_cache(maxsize=1)
def json_object() -> str:
    """json_object=True: any JSON object (see ANY_VALUE_DEPTH); built once, it is long (~36k characters)."""
    return _object_of(any_value())


def schema_to_regex(schema: dict | bool | str) -> str:
    """The regex of the JSON texts a schema allows (a subset where noted: declared properties only, bounded
    nesting for schemas that allow any value); ValueError naming what is not supported."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from None
    return _Converter(schema).regex(schema, "#", ())


class _Converter:
    def __init__(self, root: object):
        self.root = root

    def regex(self, schema: object, path: str, refs: tuple[str, ...]) -> str:
        """refs: the $refs being expanded (a recursive one cannot be a regex)."""
        if schema is True or schema == {}:
            return any_value()
        if not isinstance(schema, dict):
            raise ValueError(f"{path}: a schema must be an object or true, got {schema!r}")
        unknown = set(schema) - _ANNOTATIONS - _COMMON - set().union(*_KEYWORDS.values())
        if unknown:
            raise ValueError(f"{path}: unsupported keyword {sorted(unknown)[0]!r}")
        if "$ref" in schema:
            return self.ref(schema, path, refs)
        if "const" in schema:
            return _literal_json(schema["const"])
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise ValueError(f"{path}/enum: must be a non-empty list, got {values!r}")
            return "(?:" + "|".join(_literal_json(v) for v in values) + ")"
        for key in ("anyOf", "oneOf"):  # oneOf's exclusivity is not enforced (as in outlines)
            if key in schema:
                return self.alternatives(schema, key, path, refs)
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1:
                raise ValueError(f"{path}/allOf: only a single schema is supported, got {parts!r}")
            return self.regex(parts[0], f"{path}/allOf/0", refs)
        types = schema.get("type", _implied_type(schema))
        if types is None:
            return any_value()
        if isinstance(types, list):
            return "(?:" + "|".join(self.typed(schema, t, path, refs) for t in types) + ")"
        return self.typed(schema, types, path, refs)

    def alternatives(self, schema: dict, key: str, path: str, refs: tuple[str, ...]) -> str:
        options = schema[key]
        if not isinstance(options, list) or not options:
            raise ValueError(f"{path}/{key}: must be a non-empty list, got {options!r}")
        rest = {k: v for k, v in schema.items() if k != key and k not in _ANNOTATIONS}
        if rest:
            raise ValueError(f"{path}: {key} beside {sorted(rest)[0]!r} is not supported")
        return "(?:" + "|".join(self.regex(o, f"{path}/{key}/{i}", refs) for i, o in enumerate(options)) + ")"

    def ref(self, schema: dict, path: str, refs: tuple[str, ...]) -> str:
        ref = schema["$ref"]
        if ref in refs:
            raise ValueError(f"{path}: recursive $ref {ref!r} is not supported")
        target = self.root
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ValueError(f"{path}: only local $refs (#/...) are supported, got {ref!r}")
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise ValueError(f"{path}: $ref {ref!r} points to nothing")
            target = target[part]
        return self.regex(target, ref, refs + (ref,))

    def typed(self, schema: dict, kind: object, path: str, refs: tuple[str, ...]) -> str:
        if kind not in _KEYWORDS:
            raise ValueError(f"{path}: unsupported type {kind!r}")
        misplaced = set(schema) & set().union(*_KEYWORDS.values()) - _KEYWORDS[kind]
        if misplaced and not isinstance(schema.get("type"), list):
            raise ValueError(f"{path}: keyword {sorted(misplaced)[0]!r} does not apply to type {kind!r}")
        if kind == "string":
            return _string(schema, path)
        if kind == "array":
            return self.array(schema, path, refs)
        if kind == "object":
            return self.object(schema, path, refs)
        if kind == "integer" and set(_BOUNDS) & set(schema):
            return _integer_range(*_integer_bounds(schema, path))
        if kind == "number" and set(_BOUNDS) & set(schema):
            return _number_range(*_number_bounds(schema, path))
        return SCALARS[kind]

    def array(self, schema: dict, path: str, refs: tuple[str, ...]) -> str:
        lo, hi = _bounds(schema, "minItems", "maxItems", path)
        items = schema.get("items", True)
        later = None if items is False else self.regex(items, f"{path}/items", refs)  # false: no items (past the prefix)
        prefix = schema.get("prefixItems", [])
        if not isinstance(prefix, list):
            raise ValueError(f"{path}/prefixItems: must be a list of schemas, got {prefix!r}")
        if not prefix and later is not None:
            return _array_of(later, lo, hi)
        if later is None and lo > len(prefix):
            raise ValueError(f"{path}: minItems={lo} exceeds the {len(prefix)} items prefixItems allows")
        return _tuple_of([self.regex(s, f"{path}/prefixItems/{i}", refs) for i, s in enumerate(prefix)], later, lo, hi)

    def object(self, schema: dict, path: str, refs: tuple[str, ...]) -> str:
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        if not isinstance(properties, dict) or not isinstance(required, list):
            raise ValueError(f"{path}: properties must be an object and required a list")
        missing = [name for name in required if name not in properties]
        if missing:
            raise ValueError(f"{path}: required property {missing[0]!r} is not among the properties")
        extra = schema.get("additionalProperties", True)
        if not properties:
            if extra is False:
                return rf"\{{{WHITESPACE}\}}"
            return _object_of(self.regex(extra, f"{path}/additionalProperties", refs))
        # Declared properties only, in their order (a subset of what additionalProperties may also allow).
        members = [(_literal_json(name) + _COLON + self.regex(sub, f"{path}/properties/{name}", refs),
                    name in required) for name, sub in properties.items()]
        return rf"\{{{WHITESPACE}{_members(members)}{WHITESPACE}\}}"


def _implied_type(schema: dict) -> str | None:
    """The type a schema without one has by its keywords; None (any value) when none says."""
    return next((kind for kind in ("object", "array", "string") if set(schema) & _KEYWORDS[kind]), None)


def _members(members: list[tuple[str, bool]]) -> str:
    """Comma-separated members in order, the optional ones (required False) omissible: R(i, first) is members i..
    with `first` true when none was written before; R(i, False) chains, R(i, True) branches (size O(n^2))."""
    later = [""] * (len(members) + 1)  # R(i, False)
    for i in reversed(range(len(members))):
        member, required = members[i]
        later[i] = f"{_SEP}{member}{later[i + 1]}" if required else f"(?:{_SEP}{member})?{later[i + 1]}"
    first = ""  # R(n, True)
    for i in reversed(range(len(members))):
        member, required = members[i]
        first = f"{member}{later[i + 1]}" if required else f"(?:{member}{later[i + 1]}|{first})"
    return first


def _object_of(value: str) -> str:
    member = f"{STRING}{_COLON}{value}"
    return rf"\{{{WHITESPACE}(?:{member}(?:{_SEP}{member})*)?{WHITESPACE}\}}"


def _array_of(item: str, lo: int, hi: int | None) -> str:
    if hi == 0:
        return rf"\[{WHITESPACE}\]"
    more = f"(?:{_SEP}{item}){{{max(lo - 1, 0)},{'' if hi is None else hi - 1}}}"
    items = f"{item}{more}" if lo >= 1 else f"(?:{item}{more})?"
    return rf"\[{WHITESPACE}{items}{WHITESPACE}\]"


def _tuple_of(firsts: list[str], later: str | None, lo: int, hi: int | None) -> str:
    """Arrays of lo to hi items whose first ones match firsts in order and any after them `later` (None: none)."""
    options = [_SEP.join(firsts[:n]) for n in range(lo, min(len(firsts), len(firsts) if hi is None else hi) + 1)]
    if later is not None and (hi is None or hi > len(firsts)):
        more = f"(?:{_SEP}{later}){{{max(lo - len(firsts), 1)},{'' if hi is None else hi - len(firsts)}}}"
        options.append(_SEP.join(firsts) + more)  # firsts: not empty (else _array_of)
    return rf"\[{WHITESPACE}(?:{'|'.join(options)}){WHITESPACE}\]"


def _string(schema: dict, path: str) -> str:
    given = [k for k in ("format", "pattern") if k in schema] + (
        ["length"] if {"minLength", "maxLength"} & set(schema) else [])
    if len(given) > 1:
        raise ValueError(f"{path}: {given[0]!r} together with {given[1]!r} is not supported")
    if "format" in schema:
        if schema["format"] not in FORMATS:
            raise ValueError(f"{path}: unsupported format {schema['format']!r} (supported: {sorted(FORMATS)})")
        return f'"{FORMATS[schema["format"]]}"'
    if "pattern" in schema:
        return f'"(?:{_pattern(schema["pattern"], path)})"'
    lo, hi = _bounds(schema, "minLength", "maxLength", path)
    if (lo, hi) == (0, None):
        return STRING
    return f'"{STRING_INNER}{{{lo},{"" if hi is None else hi}}}"'


def _pattern(pattern: object, path: str) -> str:
    """A string's pattern, anchors at its ends dropped (it must match the whole string); checked on its own so that
    an error names it. It is applied to the JSON text between the quotes (escapes included), as outlines does."""
    if not isinstance(pattern, str):
        raise ValueError(f"{path}/pattern: must be a string, got {pattern!r}")
    body = pattern.removeprefix("^")
    if body.endswith("$") and not body.endswith("\\$"):
        body = body[:-1]
    try:
        parse(body)
    except ValueError as e:
        raise ValueError(f"{path}/pattern {pattern!r}: {e}") from None
    return body


def _bounds(schema: dict, low: str, high: str, path: str) -> tuple[int, int | None]:
    lo, hi = schema.get(low, 0), schema.get(high)
    for name, value in ((low, lo), (high, hi)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{path}/{name}: must be an integer >= 0, got {value!r}")
    if hi is not None and lo > hi:
        raise ValueError(f"{path}: {low}={lo} exceeds {high}={hi}")
    return lo, hi


Bound = tuple[Decimal, bool] | None  # a value and whether it is excluded; None: unbounded


def _number_bounds(schema: dict, path: str) -> tuple[Bound, Bound]:
    """The tightest lower and upper bounds minimum/maximum and their exclusive forms (numbers, as in JSON Schema 6+)
    give, exact as decimals."""
    lo = hi = None
    for name in _BOUNDS:
        value = schema.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"{path}/{name}: must be a finite number, got {value!r}")
        bound = Decimal(str(value)), name.startswith("exclusive")
        # The tighter of two: the higher minimum (the lower maximum), or, at the same value, the exclusive one.
        if name in ("minimum", "exclusiveMinimum"):
            lo = bound if lo is None else max(lo, bound)
        else:
            hi = bound if hi is None else min(hi, bound, key=lambda b: (b[0], not b[1]))
    if lo is not None and hi is not None and (lo[0] > hi[0] or lo[0] == hi[0] and (lo[1] or hi[1])):
        raise ValueError(f"{path}: no number lies within its bounds")
    return lo, hi


def _integer_bounds(schema: dict, path: str) -> tuple[int | None, int | None]:
    """The least and greatest integers the bounds allow (see _number_bounds); None where unbounded."""
    lo, hi = _number_bounds(schema, path)
    first = None if lo is None else math.floor(lo[0]) + 1 if lo[1] else math.ceil(lo[0])
    last = None if hi is None else math.ceil(hi[0]) - 1 if hi[1] else math.floor(hi[0])
    if first is not None and last is not None and first > last:
        raise ValueError(f"{path}: no integer lies within its bounds (from {first} to {last})")
    return first, last


def _number_range(lo: Bound, hi: Bound) -> str:
    """JSON numbers between the bounds, written without an exponent (a subset: with one, a bounded range is no simple
    language): negative ones as "-" and a magnitude above 0, the others as a magnitude."""
    zero = Decimal(0)
    parts = []
    if lo is None or lo[0] < 0:
        above = (zero, True) if hi is None or hi[0] >= 0 else (-hi[0], hi[1])
        parts.append("-" + _magnitudes(above, None if lo is None else (-lo[0], lo[1])))
    if hi is None or hi[0] > 0 or hi == (zero, False):
        parts.append(_magnitudes((zero, False) if lo is None or lo[0] < 0 else lo, hi))
    return "(?:" + "|".join(parts) + ")"


def _magnitudes(lo: tuple[Decimal, bool], hi: Bound) -> str:
    """Non-negative decimals from lo to hi (None: unbounded): an integer part, then a fraction where the integer
    part is a bound's."""
    first, first_digits = _split(lo[0])
    if hi is None:
        options = [_with_fraction(first, _fraction_at_least(first_digits, lo[1])),
                   _naturals(first + 1, None) + ANY_FRACTION]
    else:
        last, last_digits = _split(hi[0])
        if first == last:
            options = [_with_fraction(first, _fraction_between(first_digits, last_digits, lo[1], hi[1]))]
        else:
            options = [_with_fraction(first, _fraction_at_least(first_digits, lo[1])),
                       _with_fraction(last, _fraction_at_most(last_digits, hi[1]))]
            if first + 1 < last:
                options.append(_naturals(first + 1, last - 1) + ANY_FRACTION)
    return "(?:" + "|".join(o for o in options if o) + ")"


# Fractions as digit strings D after the point (empty: no point), valued 0.D: (a regex of the non-empty ones, or None
# for none, and whether the empty one is among them).
Fraction = tuple[str | None, bool]
ANY_FRACTION = r"(?:\.[0-9]+)?"


def _split(value: Decimal) -> tuple[int, str]:
    """A non-negative decimal's integer part and its fraction's digits."""
    whole, _, digits = format(value, "f").partition(".")
    return int(whole), digits


def _with_fraction(whole: int, fraction: Fraction) -> str | None:
    digits, empty = fraction
    if digits is None:
        return str(whole) if empty else None
    return f"{whole}(?:\\.{digits})?" if empty else f"{whole}\\.{digits}"


def _fraction_at_least(f: str, strict: bool) -> Fraction:
    """0.D >= 0.f (> if strict)."""
    f = f.rstrip("0")
    if not f:
        return ("0*[1-9][0-9]*", False) if strict else ("[0-9]+", True)
    options = [f"{f[:i]}[{int(c) + 1}-9][0-9]*" for i, c in enumerate(f) if c != "9"]
    return "(?:" + "|".join(options + [f + ("0*[1-9][0-9]*" if strict else "[0-9]*")]) + ")", False


def _fraction_at_most(f: str, strict: bool) -> Fraction:
    """0.D <= 0.f (< if strict): a lower digit somewhere, or a beginning of f (the empty one too)."""
    f = f.rstrip("0")
    if not f:
        return (None, False) if strict else ("0+", True)
    options = [f"{f[:i]}[0-{int(c) - 1}][0-9]*" for i, c in enumerate(f) if c != "0"]
    options += [f[:i] for i in range(1, len(f))] + ([] if strict else [f + "0*"])
    return "(?:" + "|".join(options) + ")", True


def _fraction_between(low: str, high: str, low_strict: bool, high_strict: bool) -> Fraction:
    """0.low <= 0.D <= 0.high (either strict), for 0.low <= 0.high: after their shared digits, low's next digit and
    a rest at least low's, high's and a rest at most high's, or one between; or D ends within the shared digits,
    equal to low (whose later digits are zeros)."""
    width = max(len(low), len(high))
    low, high = low.ljust(width, "0"), high.ljust(width, "0")
    if low == high:
        return (None, False) if low_strict or high_strict else _equal(low)
    c = next(i for i, (a, b) in enumerate(zip(low, high)) if a != b)
    options = [option for digit, (rest, empty) in ((low[c], _fraction_at_least(low[c + 1:], low_strict)),
                                                   (high[c], _fraction_at_most(high[c + 1:], high_strict)))
               for option in _followed(low[:c] + digit, rest, empty)]
    if int(low[c]) + 1 < int(high[c]):
        options.append(f"{low[:c]}[{int(low[c]) + 1}-{int(high[c]) - 1}][0-9]*")
    ends = [j for j in range(c + 1) if not low_strict and not low[j:].strip("0")]
    options += [low[:j] for j in ends if j]
    return "(?:" + "|".join(options) + ")", 0 in ends


def _equal(f: str) -> Fraction:
    """0.D = 0.f."""
    f = f.rstrip("0")
    return ("0+", True) if not f else (f + "0*", False)


def _followed(head: str, rest: str | None, empty: bool) -> list[str]:
    """head, then a rest of the fraction (rest's language, and the empty one where it counts)."""
    if rest is None:
        return [head] if empty else []
    return [f"{head}(?:{rest})?" if empty else head + rest]


def _integer_range(lo: int | None, hi: int | None) -> str:
    """JSON integers (no leading zeros, no "-0") from lo to hi (None: unbounded)."""
    parts = []
    if lo is None or lo < 0:  # the negative ones, as "-" and their magnitudes
        parts.append("-" + _naturals(1 if hi is None or hi >= 0 else -hi, None if lo is None else -lo))
    if hi is None or hi >= 0:
        parts.append(_naturals(max(lo or 0, 0), hi))
    return "(?:" + "|".join(parts) + ")"


def _naturals(lo: int, hi: int | None) -> str:
    """Decimal numerals (no leading zeros) of the integers from lo >= 0 to hi (None: unbounded), a length at a time."""
    options = ["0"] if lo == 0 else []
    lo = max(lo, 1)
    length = len(str(lo))
    while hi is None or length <= len(str(hi)):
        first = max(lo, 10 ** (length - 1))
        if hi is None and first == 10 ** (length - 1):
            options.append(f"[1-9][0-9]{{{length - 1},}}")  # every longer numeral too
            break
        last = 10 ** length - 1 if hi is None or length < len(str(hi)) else hi
        if first <= last:
            options.append(_digit_range(str(first), str(last)))
        length += 1
    return "(?:" + "|".join(options) + ")"


def _digit_range(low: str, high: str) -> str:
    """The digit strings of one length from low to high (low <= high), as a regex: a shared prefix, then the rest of
    low's first digit, the digits between, and the start of high's."""
    common = next((i for i, (a, b) in enumerate(zip(low, high)) if a != b), len(low))
    prefix, low, high = low[:common], low[common:], high[common:]
    if not low:
        return prefix
    rest = len(low) - 1
    if low[1:] == "0" * rest and high[1:] == "9" * rest:
        return prefix + f"[{low[0]}-{high[0]}]" + (f"[0-9]{{{rest}}}" if rest else "")
    options = [low[0] + _digit_range(low[1:], "9" * rest)]
    if int(low[0]) + 1 < int(high[0]):
        options.append(f"[{int(low[0]) + 1}-{int(high[0]) - 1}][0-9]{{{rest}}}")
    options.append(high[0] + _digit_range("0" * rest, high[1:]))
    return prefix + "(?:" + "|".join(options) + ")"


def _literal_json(value: object) -> str:
    return escape(json.dumps(value, separators=(",", ":"), ensure_ascii=False))
