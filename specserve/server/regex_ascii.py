"""ASCII digit and word classes in the regular expressions of structured outputs.

llguidance reads a regex as Rust's regex crate does, where ``\\d`` is every Unicode decimal digit
and ``\\w`` every Unicode letter and digit. vLLM's default backend (xgrammar) reads ``\\d`` as
``[0-9]`` and ``\\w`` as ``[0-9A-Za-z_]``, as JavaScript and JSON Schema's patterns do, and that is
what a user writing ``\\d{4}-\\d{2}-\\d{2}`` means. The difference shows: a small model under
``\\d{4}`` chose the first bytes of an emoji, which a Unicode digit (U+1FBF8, a segmented digit)
could complete, and wrote ``🯸🯸🯸🯸``. So ``\\d``, ``\\D``, ``\\w`` and ``\\W`` are spelled out as
ASCII classes before compiling: in a ``regex`` constraint, and in the ``/.../`` terminals of a Lark
grammar. ``\\s`` keeps its meaning (JSON Schema's ``\\s`` is Unicode whitespace too).
"""

from __future__ import annotations

OUTSIDE = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]"}
INSIDE = {"d": "0-9", "D": "[:^digit:]", "w": "0-9A-Za-z_", "W": "[:^word:]"}  # within [...]


def ascii_classes(regex: str) -> str:
    """``regex`` with \\d \\D \\w \\W as ASCII classes (outside and inside brackets); every other
    escape, bracket and character as it was."""
    out, i, depth = [], 0, 0  # depth: nesting of [...] (a POSIX class [:name:] inside one is not a level)
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            table = INSIDE if depth else OUTSIDE
            out.append(table.get(nxt, c + nxt))
            i += 2
            continue
        if c == "[":
            if depth and regex.startswith("[:", i):  # [:alpha:] inside a class
                end = regex.find(":]", i + 2)
                if end != -1:
                    out.append(regex[i:end + 2])
                    i = end + 2
                    continue
            depth += 1
            out.append(c)
            i += 1
            if regex.startswith("^", i):
                out.append("^")
                i += 1
            if regex.startswith("]", i):  # a literal ] first in a class
                out.append("]")
                i += 1
            continue
        if c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)


def lark_ascii(grammar: str) -> str:
    """A Lark grammar with ascii_classes applied to the body of each ``/regex/flags`` terminal;
    strings, ``//`` comments and the rest untouched. A GBNF grammar has no ``/.../`` terminals and
    comes back as it was."""
    out, i, n = [], 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c == '"':  # a string literal, escapes included
            j = i + 1
            while j < n and grammar[j] != '"':
                j += 2 if grammar[j] == "\\" else 1
            out.append(grammar[i:j + 1])
            i = j + 1
        elif grammar.startswith("//", i) or c == "#":  # a comment (Lark's, GBNF's) to the end of the line
            j = grammar.find("\n", i)
            j = n if j == -1 else j
            out.append(grammar[i:j])
            i = j
        elif c == "/":  # a regex terminal: up to the next unescaped /
            j = i + 1
            while j < n and grammar[j] not in "/\n":
                j += 2 if grammar[j] == "\\" else 1
            if j < n and grammar[j] == "/":
                out.append("/" + ascii_classes(grammar[i + 1:j]) + "/")
            else:
                out.append(grammar[i:j])
            i = j + 1 if j < n and grammar[j] == "/" else j
        else:
            out.append(c)
            i += 1
    return "".join(out)
