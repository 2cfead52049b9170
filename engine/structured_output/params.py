"""StructuredOutputsParams: what a guided request's output must match (vLLM's names: json, regex, choice, grammar,
json_object, disable_any_whitespace). Exactly one of the constraints is set."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None  # a JSON schema (a dict, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # an EBNF (GBNF-style) grammar, as xgrammar reads it
    json_object: bool = False  # any JSON object (response_format {"type": "json_object"})
    disable_any_whitespace: bool = True  # compact JSON: no free whitespace between tokens (kvgate's default)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, regex, choice, grammar, json_object; got "
                             + (", ".join(given) if given else "none"))
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """A hashable identity for the compile cache: (kind, spec text, whitespace mode). A JSON schema is keyed by
        its canonical text, whether it came as a dict or as JSON text (text that does not parse stays as it is)."""
        kind = self.kind
        spec: Any = getattr(self, kind)
        if kind == "json" and isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError:
                pass
        if kind == "json" and not isinstance(spec, str):
            spec = json.dumps(spec, sort_keys=True)
        elif kind == "choice":
            spec = json.dumps(spec)
        elif kind == "json_object":
            spec = ""
        return kind, spec, self.disable_any_whitespace
