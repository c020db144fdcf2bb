"""Compare two fingerprints field by field, and decide which drifts are allowed.

A field is the dotted path of a leaf value: ``packages.numpy``,
``model.files.<name>.sha256``, ``serve.max_num_seqs``, ``chat_template.sha256``.
Lists (such as ``device.cpu.flags``) are single fields.

An allow rule (``--lock-allow``) matches a field when it equals it, is a
dotted prefix of it (``packages`` allows every package) or matches it as a
glob (``packages.*``, ``model.files.*.sha256``). Package names in rules are
PEP 503 normalized (``packages.Fake_Pkg`` is ``packages.fake-pkg``) and
dashes in ``serve.`` rules become underscores (``serve.max-num-seqs``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any


class _Absent:
    """The value of a field that one side does not have."""

    def __repr__(self) -> str:
        return "<absent>"


ABSENT: Any = _Absent()
ERROR = "<error: "  # how a value that could not be collected is recorded (fingerprint.Collector.problem)


@dataclass(frozen=True)
class Drift:
    """One field whose value differs between the lock (``old``) and now (``new``)."""

    field: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.field}: {format_value(self.old, self.new)} -> {format_value(self.new, self.old)}"


class DriftList(list):
    """The drifts that block, with ``checked`` (fields compared) and ``allowed`` (drifts let through)."""

    def __init__(self, drifts: list[Drift] = (), checked: int = 0, allowed: list[Drift] | None = None):
        super().__init__(drifts)
        self.checked = checked
        self.allowed = list(allowed or [])


def format_value(value: Any, other: Any = ABSENT) -> str:
    """A leaf for display: strings as is, lists as what they lack compared with ``other``."""
    if value is ABSENT:
        return "<absent>"
    if isinstance(value, str):
        return value
    if isinstance(value, list) and isinstance(other, list):
        only = [v for v in value if v not in other]
        return f"[{len(value)} items{', only here: ' + ' '.join(map(str, only)) if only else ''}]"
    return json.dumps(value, sort_keys=True)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists, scalars and None are leaves."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def diff(old: dict[str, Any], new: dict[str, Any]) -> DriftList:
    """Every field whose value differs, in field order; ``checked`` is the number of fields compared."""
    a, b = flatten(old), flatten(new)
    fields = sorted(a.keys() | b.keys())
    drifts = [Drift(f, a.get(f, ABSENT), b.get(f, ABSENT)) for f in fields if a.get(f, ABSENT) != b.get(f, ABSENT)]
    return DriftList(drifts, checked=len(fields))


def normalize_rule(rule: str) -> str:
    """Canonical spelling of an allow rule (package names, serve flag dashes)."""
    rule = rule.strip()
    if rule.startswith("packages."):
        return "packages." + re.sub(r"[-_.]+", "-", rule[len("packages."):]).lower()
    if rule.startswith("serve."):
        return rule.replace("-", "_")
    return rule


def is_allowed(field: str, rules: list[str]) -> bool:
    """Whether some rule lets ``field`` drift (exact, dotted prefix or glob)."""
    for rule in map(normalize_rule, rules):
        if rule and (field == rule or field.startswith(rule + ".") or fnmatchcase(field, rule)):
            return True
    return False


def apply_allow(drifts: DriftList, rules: list[str]) -> DriftList:
    """Split ``drifts`` into the blocking ones and ``allowed``."""
    blocking = [d for d in drifts if not is_allowed(d.field, rules)]
    allowed = [d for d in drifts if is_allowed(d.field, rules)]
    return DriftList(blocking, checked=drifts.checked, allowed=allowed)


def format_drifts(drifts: list[Drift], lock_path: str | None = None) -> str:
    """``lock OK (N fields checked)``, or a header and one ``field: old -> new`` line per drift."""
    checked = getattr(drifts, "checked", None)
    allowed = getattr(drifts, "allowed", [])
    note = f", {len(allowed)} allowed to drift" if allowed else ""
    if not drifts:
        return f"lock OK ({checked} fields checked{note})" if checked is not None else f"lock OK{note}"
    where = f" from {lock_path}" if lock_path else ""
    lines = [f"deployment drifted{where}: {len(drifts)} field(s) changed{note}"]
    errors = [d.new[len(ERROR):-1] for d in drifts if isinstance(d.new, str) and d.new.startswith(ERROR)]
    if errors:  # e.g. a model that is not there: the fields that follow from it drift too
        lines[0] += f"; {len(errors)} could not be checked:"
        lines += [f"  {e}" for e in errors]
    lines += [str(d) for d in drifts]
    return "\n".join(lines)
