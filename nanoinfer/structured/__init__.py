"""Structured outputs: a request's output constrained to a regex, a JSON schema, any JSON object or a choice of
strings, by masking the tokens that cannot continue a match (see grammar.py)."""
from nanoinfer.structured.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "StructuredOutputsParams"]
