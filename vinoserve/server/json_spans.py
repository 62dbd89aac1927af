"""Where each value of a JSON text lies while the text is still arriving.

A constrained tool reply is valid JSON once whole, but it is streamed token by token; to send a
call's name as soon as it is written and its arguments as they grow, the server needs the raw
span of every value so far, open ones included. Fed piece by piece, each character is read once.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

Path = tuple  # keys and array indices from the root: ("tool_calls", 0, "arguments")


@dataclass
class _Frame:
    path: Path
    array: bool
    key: str | int = 0  # the member being read: a key, or an array index
    expect: str = "value"  # "key", "colon", "value" or "after" (a comma or the closing bracket)


@dataclass
class JsonSpans:
    text: str = ""
    spans: dict[Path, list] = field(default_factory=dict)  # path -> [start, end or None while open]
    _frames: list[_Frame] = field(default_factory=list)
    _string: tuple[int, bool] | None = None  # an open string: its start, and whether it is a key
    _escaped: bool = False
    _literal: Path | None = None  # an open number, true, false or null
    _started: bool = False

    def feed(self, piece: str) -> None:
        start = len(self.text)
        self.text += piece
        for i in range(start, len(self.text)):
            self._read(i, self.text[i])

    def raw(self, path: Path) -> str | None:
        """The value's text so far, or None if it has not begun."""
        span = self.spans.get(path)
        return None if span is None else self.text[span[0]:span[1]]

    def closed(self, path: Path) -> bool:
        span = self.spans.get(path)
        return span is not None and span[1] is not None

    def _read(self, i: int, c: str) -> None:
        if self._string is not None:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._end_string(i)
            return
        if self._literal is not None:
            if c not in ",}] \t\r\n":
                return
            self._close(self._literal, i)
            self._literal = None
        if c in " \t\r\n":
            return
        frame = self._frames[-1] if self._frames else None
        if frame is not None and frame.expect == "value" and c == "]":  # an empty array
            self._frames.pop()
            self._close(frame.path, i + 1)
        elif frame is None or frame.expect == "value":
            if frame is None and self._started:
                return  # text after the top-level value: not ours to place
            self._started = True
            self._begin(i, c, self._value_path(frame))
        elif frame.expect == "key" and c == '"':
            self._string = (i, True)
        elif frame.expect == "colon" and c == ":":
            frame.expect = "value"
        elif c == ",":
            if frame.array:
                frame.key += 1
                frame.expect = "value"
            else:
                frame.expect = "key"
        elif c in "}]":
            self._frames.pop()
            self._close(frame.path, i + 1)

    def _begin(self, i: int, c: str, path: Path) -> None:
        self.spans[path] = [i, None]
        if c == '"':
            self._string = (i, False)
        elif c in "{[":
            self._frames.append(_Frame(path, c == "[", expect="value" if c == "[" else "key"))
        else:
            self._literal = path

    def _end_string(self, i: int) -> None:
        start, is_key = self._string
        self._string = None
        frame = self._frames[-1] if self._frames else None
        if is_key:
            frame.key, frame.expect = json.loads(self.text[start:i + 1]), "colon"
        else:
            self._close(self._value_path(frame), i + 1)

    def _close(self, path: Path, end: int) -> None:
        self.spans[path][1] = end
        if self._frames:
            self._frames[-1].expect = "after"

    @staticmethod
    def _value_path(frame: _Frame | None) -> Path:
        return () if frame is None else frame.path + (frame.key,)


def partial_string(raw: str, closed: bool) -> str:
    """The decoded text of a JSON string's raw form (from its opening quote) that may be cut short,
    leaving out an escape or a surrogate pair not yet whole."""
    body = raw[1:-1] if closed else raw[1:]
    for cut in range(min(len(body), 6) + 1):  # the longest escape, \uXXXX, is 6 characters
        try:
            text = json.loads(f'"{body[:len(body) - cut]}"')
        except json.JSONDecodeError:
            continue
        return text[:-1] if text and "\ud800" <= text[-1] <= "\udbff" else text
    return ""
