"""Minimal edits of a call's keyword arguments, located on a concrete syntax tree (libcst).

A fix that sets, changes or drops a keyword argument changes only the tokens it must: the value it
replaces, the argument it drops (with its comma), or the argument it adds after the last one.
Every other byte of the file stays as the user wrote it: the call's other arguments, its line
breaks and indentation, trailing commas and comments. An argument added to a call laid out one
argument per line goes on a line of its own at the arguments' indentation (with a trailing comma
when the call has one); to a call written on one line, it is appended there.

libcst only locates the tokens (byte spans of the call, its arguments, their values and commas);
the edit splices the file's bytes, so nothing is re-printed. fixes.py turns the edited text into
an `Edit` of the lines that differ.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterable

import libcst as cst
from libcst.metadata import ByteSpanPositionProvider, MetadataWrapper, PositionProvider


@dataclass(frozen=True)
class ArgSpan:
    """One argument of a call, as byte offsets into the file's UTF-8 text."""

    start: int  # its first byte (`*`, `**`, its keyword or its value)
    end: int  # just past its value (and the value's parentheses); its comma is not part of it
    value_start: int  # the value's own tokens, inside any parentheses around it
    value_end: int
    comma_end: int | None  # just past its comma, if one follows it
    keyword: str | None
    star: str  # "", "*" or "**"


@dataclass(frozen=True)
class CallSite:
    """A call found in the file: where it starts (1-based line), its `(` and its arguments."""

    name: str  # what it calls: `f` of `f(...)`, `to` of `x.to(...)`
    line: int
    end_line: int
    open_end: int  # just past its `(`
    start: int  # its first byte, and its length in bytes
    size: int
    args: tuple[ArgSpan, ...]
    unpacked: tuple[str, ...] = ()  # the source of its `*seq` and `**mapping` arguments

    def keywords(self) -> set[str]:
        return {a.keyword for a in self.args if a.keyword}


def _name(func: cst.BaseExpression) -> str | None:
    if isinstance(func, cst.Attribute):
        return func.attr.value
    return func.value if isinstance(func, cst.Name) else None


def find_call(text: str, line: int, names: Iterable[str]) -> CallSite | None:
    """The outermost call to one of `names` (`f(...)` or `obj.f(...)`) spanning `line` (None when the
    text does not parse or no such call spans it)."""
    calls = find_calls(text, line, names)
    return max(calls, key=lambda c: c.size) if calls else None


def find_calls(text: str, line: int, names: Iterable[str]) -> list[CallSite]:
    """Every call to one of `names` spanning `line`, in the order they start in the text (none when
    the text does not parse)."""
    parsed = _parsed(text)
    if parsed is None:
        return []
    calls, spans, lines = parsed
    wanted = set(names)
    data = text.encode("utf-8")
    found = [call for call, name, first, last in calls if name in wanted and first <= line <= last]
    return sorted((_site(call, data, spans, lines) for call in found), key=lambda c: c.start)


@functools.lru_cache(maxsize=8)
def _parsed(text: str) -> tuple[list[tuple[cst.Call, str | None, int, int]], Any, Any] | None:
    """The text's calls (node, name, first and last line) and its byte spans and line positions,
    once per text: the rules ask about one file many times (every DataLoader and copy line), and
    a parse with its positions takes ~0.1 s; an edited text is another key."""
    try:
        wrapper = MetadataWrapper(cst.parse_module(text), unsafe_skip_copy=True)
        spans = wrapper.resolve(ByteSpanPositionProvider)
        lines = wrapper.resolve(PositionProvider)
    except (cst.ParserSyntaxError, RecursionError, ValueError):
        return None
    calls = [(node, _name(node.func), where.start.line, where.end.line)
             for node, where in lines.items() if isinstance(node, cst.Call)]
    return calls, spans, lines


def _site(call: cst.Call, data: bytes, spans: Any, lines: Any) -> CallSite:
    func = spans[call.func]
    open_end = data.index(b"(", func.start + func.length) + 1
    args = []
    for a in call.args:
        s, v = spans[a], spans[a.value]
        comma = spans[a.comma] if isinstance(a.comma, cst.Comma) else None
        args.append(ArgSpan(start=s.start, end=s.start + s.length, value_start=v.start,
                            value_end=v.start + v.length, comma_end=comma.start + comma.length if comma else None,
                            keyword=a.keyword.value if a.keyword else None, star=a.star or ""))
    return CallSite(name=_name(call.func) or "", line=lines[call].start.line, end_line=lines[call].end.line, open_end=open_end,
                    start=spans[call].start, size=spans[call].length, args=tuple(args), unpacked=tuple(data[a.start:a.end].decode("utf-8") for a in args if a.star))


def _line_start(data: bytes, pos: int) -> int:
    return data.rfind(b"\n", 0, pos) + 1


def _line_end(data: bytes, pos: int) -> int:
    """The offset of the newline ending the line holding `pos` (len(data) on the last line)."""
    end = data.find(b"\n", pos)
    return len(data) if end < 0 else end


def _first_on_line(data: bytes, pos: int) -> bool:
    return not data[_line_start(data, pos):pos].strip()


def _rest_is_comment(data: bytes, pos: int) -> bool:
    """Whether nothing but whitespace or a comment follows `pos` on its line."""
    rest = data[pos:_line_end(data, pos)].strip()
    return not rest or rest.startswith(b"#")


def _newline(data: bytes) -> bytes:
    return b"\r\n" if b"\r\n" in data else b"\n"


def _replace_value(data: bytes, arg: ArgSpan, value: str) -> bytes:
    return data[:arg.value_start] + value.encode("utf-8") + data[arg.value_end:]


def _drop(data: bytes, call: CallSite, i: int) -> bytes:
    """`data` without argument `i` of `call` and the comma that separated it."""
    args = call.args
    a = args[i]
    after = a.comma_end or a.end
    if _first_on_line(data, a.start) and _rest_is_comment(data, after):
        # The argument has its line(s) to itself: those lines go, comment and all. Dropping the last
        # argument that way leaves the one before it with its comma: a trailing comma, as valid.
        start = _line_start(data, a.start)
        return data[:start] + data[min(len(data), _line_end(data, after) + 1):]
    if i < len(args) - 1:
        return data[:a.start] + data[args[i + 1].start:]
    if i > 0 and b"#" not in data[args[i - 1].end:a.start]:
        # the last argument: the comma before it goes with it (its own trailing comma, if any, stays)
        return data[:args[i - 1].end] + data[a.end:]
    return data[:a.start] + data[after:]


def _add(data: bytes, call: CallSite, items: list[str]) -> bytes:
    """`data` with the arguments `items` (source text, `k=v`) added after the call's last one."""
    new = [s.encode("utf-8") for s in items]
    if not call.args:
        return data[:call.open_end] + b", ".join(new) + data[call.open_end:]
    last = call.args[-1]
    if not _first_on_line(data, last.start):  # arguments written along a line: continue it
        return data[:last.end] + b"".join(b", " + s for s in new) + data[last.end:]
    # one argument per line: each new one gets its own line at the last one's indentation, and a
    # trailing comma when the last argument has one
    nl = _newline(data)
    indent = data[_line_start(data, last.start):last.start]
    trailing = b"," if last.comma_end else b""
    body = nl.join([indent + s + b"," for s in new[:-1]] + [indent + new[-1] + trailing])
    if last.comma_end:
        pos = last.comma_end
    else:
        data = data[:last.end] + b"," + data[last.end:]
        pos = last.end + 1
    if _rest_is_comment(data, pos):  # (the closing parenthesis is on a later line)
        at = _line_end(data, pos) + 1
        return data[:at] + body + nl + data[at:]
    return data[:pos] + nl + body + data[pos:]


def _merge(data: bytes, mapping: ArgSpan, items: list[str]) -> bytes:
    """`data` with the `**mapping` argument's value wrapped as `dict(mapping, k=v, ...)`."""
    value = data[mapping.value_start:mapping.value_end]
    merged = b"dict(" + value + b"".join(b", " + s.encode("utf-8") for s in items) + b")"
    return data[:mapping.value_start] + merged + data[mapping.value_end:]


def _again(data: bytes, call: CallSite, names: tuple[str, ...]) -> CallSite | None:
    """`call` found again in `data` after an edit inside it (its first byte has not moved)."""
    return next((c for c in find_calls(data.decode("utf-8"), call.line, names) if c.start == call.start), None)


def edit_call_text(text: str, line: int, names: Iterable[str], set_kwargs: dict[str, str] | None = None,
                   drop: Iterable[str] = (), nth: int | None = None) -> str | None:
    """`text` with the call to one of `names` spanning `line` (the outermost, or the `nth` in the
    order of find_calls) given the keyword arguments `set_kwargs` (values as source text: changed
    in place where the call passes them, added after its last argument where it does not) and
    without those in `drop`. None when no such call is found, the text does not parse, or nothing
    would change."""
    names = tuple(names)
    if nth is None:
        call = find_call(text, line, names)
    else:
        calls = find_calls(text, line, names)
        call = calls[nth] if nth < len(calls) else None
    if call is None:
        return None
    data = text.encode("utf-8")
    todo = dict(set_kwargs or {})
    # Edits from the last argument back, so the offsets of those before stay valid.
    for arg in reversed(call.args):
        if arg.keyword in todo:
            value = todo.pop(arg.keyword)
            if data[arg.value_start:arg.value_end].decode("utf-8") != value:
                data = _replace_value(data, arg, value)
    if data != text.encode("utf-8"):  # the spans after the changed values moved: read them again
        call = _again(data, call, names)
        if call is None:
            return None
    dropped = set(drop)
    for i in reversed(range(len(call.args))):
        if call.args[i].keyword in dropped:
            data = _drop(data, call, i)
            # the spans are of the text before the drop: read them again for the next one
            call = _again(data, call, names)
            if call is None:
                return None
    if todo:
        items = [f"{k}={v}" for k, v in todo.items()]
        mapping = next((a for a in reversed(call.args) if a.star == "**"), None)
        # beside `**mapping`, a keyword of its own would make the call raise "got multiple values"
        # in a configuration where the mapping gives that key too: merged into the mapping instead,
        # `**dict(mapping, k=v)`, the call gets the key once in every configuration (these values)
        data = _merge(data, mapping, items) if mapping is not None else _add(data, call, items)
    out = data.decode("utf-8")
    return None if out == text else out
