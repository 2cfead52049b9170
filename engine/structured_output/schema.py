"""JSON schemas as xgrammar should see them: rewrites for what xgrammar 0.2 gets wrong, so that a guided document
validates against the schema the user gave.

- A string with minLength/maxLength and no pattern: xgrammar's length-bounded string rule lets raw control
  characters (U+0000-U+001F) through, which JSON forbids inside strings (json.loads refuses the document). It is
  rewritten as the equivalent pattern over the characters a JSON string may hold unescaped.
- A string with a pattern AND minLength/maxLength: xgrammar ignores the lengths. A pattern that is one repeated atom
  (`^[a-z]+$`, `\\d{2,}`, `.*`) takes the lengths into its repetition; any other combination is kept as it is, with a
  warning (the lengths are then not enforced).
"""
from __future__ import annotations

import copy
import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

# characters a JSON string holds without an escape: no quote, no backslash, no control character
JSON_STRING_CHAR = r'[^"\\\x00-\x1f]'
_SIMPLE_PATTERN = re.compile(r"^\^?(\[(?:\\.|[^\]\\])+\]|\\[wdsWDS]|\.)(\+|\*|\?|\{(\d+)(,(\d*))?\})?\$?$")
_NOT_SCHEMAS = ("enum", "const", "default", "examples")  # values, not schemas: never rewritten


def normalize_json_schema(schema: Any) -> Any:
    """A copy of `schema` with the rewrites above (the original is not changed)."""
    schema = copy.deepcopy(schema)
    _walk(schema)
    return schema


def _walk(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _walk(item)
        return
    if not isinstance(node, dict):
        return
    if node.get("type") == "string" and ("minLength" in node or "maxLength" in node):
        _fix_string(node)
    for key, value in node.items():
        if key not in _NOT_SCHEMAS:
            _walk(value)


def _fix_string(node: dict[str, Any]) -> None:
    lo, hi = node.get("minLength", 0), node.get("maxLength")
    if not isinstance(lo, int) or (hi is not None and not isinstance(hi, int)):
        return  # not a valid schema: xgrammar reports it
    pattern = node.get("pattern")
    if pattern is None:
        if "format" in node:
            return
        node["pattern"] = f"^{JSON_STRING_CHAR}{{{lo},{'' if hi is None else hi}}}$"
    else:
        combined = _with_lengths(pattern, lo, hi) if isinstance(pattern, str) else None
        if combined is None:
            logger.warning("guided decoding: a string's pattern %r with minLength/maxLength: the lengths are not "
                           "enforced (xgrammar ignores them next to a pattern)", pattern)
            return
        node["pattern"] = combined
    node.pop("minLength", None)
    node.pop("maxLength", None)


def _with_lengths(pattern: str, lo: int, hi: int | None) -> str | None:
    """`pattern` (one atom, repeated) with its repetition narrowed to [lo, hi] characters; None when it is not of
    that shape or nothing is left."""
    m = _SIMPLE_PATTERN.match(pattern)
    if m is None:
        return None
    atom, quant = m.group(1), m.group(2)
    if quant is None:
        p_lo, p_hi = 1, 1
    elif quant == "+":
        p_lo, p_hi = 1, None
    elif quant == "*":
        p_lo, p_hi = 0, None
    elif quant == "?":
        p_lo, p_hi = 0, 1
    else:
        p_lo = int(m.group(3))
        p_hi = p_lo if m.group(4) is None else (int(m.group(5)) if m.group(5) else None)
    new_lo = max(lo, p_lo)
    new_hi = hi if p_hi is None else p_hi if hi is None else min(hi, p_hi)
    if new_hi is not None and new_hi < new_lo:
        return None
    if atom == ".":
        atom = JSON_STRING_CHAR
    return f"^{atom}{{{new_lo},{'' if new_hi is None else new_hi}}}$"
