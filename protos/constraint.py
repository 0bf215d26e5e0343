"""A request's structured-output constraint (`StructuredOutput`), checked at both boundaries.

`protos.validation.check_structured_output` does what needs no tokenizer: exactly one kind,
bounded sizes, a schema that is a JSON object, a non-empty list of distinct choices. Whether
the constraint compiles is the grammar engine's to say (engine/grammar.py), with its own
message. A `Constraint` is the checked, hashable form both nodes compile and cache by.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from protos import pdspec_pb2

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_CONSTRAINT_BYTES = 64 * 1024  # a schema, regex or grammar; the choices together
MAX_CHOICES = 256
# The engine both nodes compile constraints with and its major version (in the contract
# fingerprint: the prefill node's first token and the decode node's masks must agree).
GRAMMAR_ENGINE = "llguidance/1"


@dataclass(frozen=True)
class Constraint:
    """kind: one of KINDS; value: the schema's JSON text (json_schema), "" (json_object), the
    regex, the grammar's text, or the choices as a JSON list (choice)."""

    kind: str
    value: str

    def to_proto(self, out: pdspec_pb2.StructuredOutput) -> None:
        if self.kind == "json_object":
            out.json_object = True
        elif self.kind == "choice":
            out.choice.values.extend(json.loads(self.value))
        else:
            setattr(out, self.kind, self.value)

    @property
    def choices(self) -> list[str]:
        return json.loads(self.value) if self.kind == "choice" else []
