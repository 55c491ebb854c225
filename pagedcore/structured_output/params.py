"""StructuredOutputsParams: what output a request constrains itself to, checked at admission.

vLLM's names (`SamplingParams(structured_outputs={"json": schema})`), so Triton users' existing
`sampling_parameters` carry over. Exactly one of the fields is set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (object or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF-style, xgrammar's dialect)
    json_object: bool | None = None  # any JSON object

    def __post_init__(self) -> None:
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}, got "
                             f"{', '.join(set_) if set_ else 'none'}")
        check = getattr(self, f"_check_{set_[0]}")
        check()

    @classmethod
    def from_value(cls, value: Any) -> "StructuredOutputsParams":
        """From a request's JSON object; unknown keys are named in the error."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object with one of {', '.join(KINDS)}, "
                             f"got {type(value).__name__}")
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"structured_outputs: unknown key(s) {', '.join(unknown)}; supported: {', '.join(KINDS)}")
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def schema(self) -> dict:
        """The JSON schema as an object (json only)."""
        return json.loads(self.json) if isinstance(self.json, str) else self.json

    @property
    def key(self) -> tuple[str, str]:
        """Hashable and canonical: the compile cache's key."""
        kind = self.kind
        if kind == "json":
            return kind, json.dumps(self.schema, sort_keys=True)
        if kind == "choice":
            return kind, json.dumps(self.choice)
        return kind, str(getattr(self, kind))

    def _check_json(self) -> None:
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from e
        if not isinstance(schema, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}")
        check_json_schema(schema)

    def _check_regex(self) -> None:
        if not isinstance(self.regex, str) or not self.regex:
            raise ValueError("structured_outputs.regex must be a non-empty string")

    def _check_choice(self) -> None:
        if not isinstance(self.choice, (list, tuple)) or not self.choice \
                or not all(isinstance(c, str) and c for c in self.choice):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")

    def _check_grammar(self) -> None:
        if not isinstance(self.grammar, str) or not self.grammar.strip():
            raise ValueError("structured_outputs.grammar must be a non-empty EBNF string")

    def _check_json_object(self) -> None:
        if self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true")


# Keywords the grammar backends cannot enforce: refused by name rather than silently ignored.
UNSUPPORTED_KEYWORDS = ("patternProperties", "if", "then", "else", "dependentSchemas", "dependentRequired",
                        "unevaluatedItems", "contains", "not", "propertyNames")


def check_json_schema(schema: dict) -> None:
    """A valid schema (by its meta-schema) using only what constrained decoding enforces."""
    try:
        from jsonschema import exceptions, validators
    except ImportError:  # the optional checker: the backend still refuses what it cannot compile
        _check_supported(schema, "#")
        return
    try:
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise ValueError(f"structured_outputs.json is not a valid JSON schema at {where}: {e.message}") from e
    _check_supported(schema, "#")


def _check_supported(node: Any, path: str) -> None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_supported(item, f"{path}/{i}")
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in UNSUPPORTED_KEYWORDS and not (path.endswith("/properties") or path.endswith("/$defs")
                                                or path.endswith("/definitions")):
            raise ValueError(f"structured_outputs.json: the keyword {key!r} at {path} is not supported by constrained "
                             f"decoding (unsupported: {', '.join(UNSUPPORTED_KEYWORDS)})")
        if key == "$ref" and isinstance(value, str) and not value.startswith("#") \
                and not path.endswith("/properties"):
            raise ValueError(f"structured_outputs.json: $ref {value!r} at {path} is not supported "
                             "(only local references, '#/...')")
        _check_supported(value, f"{path}/{key}")
