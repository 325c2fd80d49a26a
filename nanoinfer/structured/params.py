"""StructuredOutputsParams (vLLM's name and fields): what a request's output must match, and the regex that says so."""
import json
from dataclasses import dataclass

from nanoinfer.structured.json_schema import json_object, schema_to_regex
from nanoinfer.structured.regex import escape

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (a dict, or its JSON text)
    regex: str | None = None  # the output fullmatches it (Python re semantics, a subset: see structured/regex.py)
    choice: list[str] | None = None  # the output is one of these strings
    grammar: str | None = None  # EBNF / Lark: not supported (refused)
    json_object: bool | None = None  # any JSON object

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Exactly one constraint, of the right type (TypeError/ValueError naming it); what it holds is checked when
        it is compiled (pattern())."""
        given = self._given()
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(_KINDS)}, got "
                             f"{', '.join(given) or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "grammar":
            raise ValueError(f"structured_outputs.grammar={value!r}: EBNF/Lark grammars are not supported; use "
                             "regex, json, json_object or choice")
        expected, wanted = {"json": ((str, dict, bool), "a JSON schema (dict or str)"), "regex": (str, "a str"),
                            "choice": ((list, tuple), "a list of str"), "json_object": (bool, "a bool")}[kind]
        if not isinstance(value, expected):
            raise TypeError(f"structured_outputs.{kind} must be {wanted}, got {type(value).__name__}")
        if kind == "choice" and (not value or not all(isinstance(c, str) for c in value)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {value!r}")

    def _given(self) -> list[str]:
        return [k for k in _KINDS if getattr(self, k) is not None and (k != "json_object" or self.json_object)]

    @property
    def kind(self) -> str:
        return self._given()[0]

    def pattern(self) -> str:
        """The regex the whole output must match; ValueError naming the argument and its value if it cannot be
        built."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "regex":
            return value
        if kind == "choice":
            return "|".join(f"(?:{escape(c)})" for c in value)
        if kind == "json_object":
            return json_object()
        try:
            return schema_to_regex(value)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json={_short(value)}: {e}") from None

    def describe(self) -> str:
        """`structured_outputs.<kind>=<value>`, for error messages."""
        return f"structured_outputs.{self.kind}={_short(getattr(self, self.kind))}"


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


def _short(value: object, limit: int = 200) -> str:
    text = json.dumps(value) if isinstance(value, dict) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
