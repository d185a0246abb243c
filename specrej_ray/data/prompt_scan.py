"""Whether a JSON Lines prompt file could hold a usable row anywhere, told by searching it in
blocks, not by reading it row by row.

Reading a file row by row to learn that no row is usable costs seconds a million rows (100 MB
of rows without a prompt, or in another encoding than UTF-8, took minutes here). A row can be
a prompt only if its line is UTF-8 throughout, at most MAX_LINE_BYTES long, and holds the
prompt field's name: as UTF-8, or with an escape of one of its characters (`\\u0070`, or `\\"`
for a quote). Blocks of the file are searched for such lines with byte and string searches;
where no line anywhere is one, the file holds no prompt and is refused at once. Where one
is, only reading the rows can tell.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from specrej_ray.data.prompts import MAX_LINE_BYTES

BLOCK = 1 << 20  # bytes searched at a time: its numpy temporaries stay in the CPU cache
_SHORT = {'"': '"', "\\": "\\", "/": "/", "\b": "b", "\f": "f", "\n": "n", "\r": "r",
          "\t": "t"}


def may_hold(path: Path, field: str) -> bool:
    """False only when no line of the JSON Lines file `path` can be a row with the key
    `field`. A block where the name, as written, is in a line with no byte that cannot be
    UTF-8 says True; so does one with an escape of the name's characters anywhere."""
    name = json.dumps(field, ensure_ascii=False).encode()
    escape = _escape_of(field)
    with open(path, "rb") as f:
        for block in _blocks(f):
            if escape.search(block):
                return True
            if block.find(name) < 0:
                continue
            if block.isascii() or _in_a_utf8_line(np.frombuffer(block, np.uint8), name):
                return True
    return False


def _in_a_utf8_line(data: np.ndarray, name: bytes) -> bool:
    """Whether `name` is in a line of `data` (whole lines) with no byte that cannot be
    UTF-8 where it stands: only such bytes are looked for (never a valid line's), so a
    line in another encoding may pass, and then its row says what is wrong with it."""
    high = data >= 0x80
    follow = high & (data < 0xC0)  # a continuation byte
    bad = (data >= 0xF5) | ((data & 0xFE) == 0xC0)  # never in UTF-8
    bad[1:] |= follow[1:] & ~high[:-1]  # a continuation after an ASCII byte
    bad[:-1] |= (data[:-1] >= 0xC2) & ~follow[1:]  # a lead byte with no continuation
    ends = np.flatnonzero(data == 10)  # line i ends at ends[i]; the last may have none
    starts = np.concatenate(([0], ends[:-1] + 1, ends[-1:] + 1))
    spoilt = np.logical_or.reduceat(bad, starts[starts < len(data)])  # a line each
    if spoilt.all():
        return False  # a file in another encoding: no line is UTF-8
    at = np.flatnonzero(data[:len(data) - len(name) + 1] == name[1]) - 1  # after the quote
    at = at[at >= 0]
    for i, byte in enumerate(name):
        at = at[data[at + i] == byte]
    return bool((~spoilt[np.searchsorted(ends, at)]).any())


def _blocks(f) -> Iterator[bytes]:
    """The file in blocks of whole lines; a line over MAX_LINE_BYTES that spans blocks is
    left out (it is a row problem whatever it holds)."""
    rest, skipping = b"", False
    while chunk := f.read(BLOCK):
        if skipping:
            end = chunk.find(b"\n")
            if end < 0:
                continue
            chunk, skipping = chunk[end + 1:], False
        chunk = rest + chunk
        cut = chunk.rfind(b"\n") + 1
        yield chunk[:cut]
        rest = chunk[cut:]
        if len(rest) > MAX_LINE_BYTES:
            rest, skipping = b"", True
    yield rest


def _escape_of(field: str) -> re.Pattern[bytes]:
    r"""An escape of any character of `field`: \uXXXX (either case; for one past the BMP,
    its surrogate pair's first half) or its short escape."""
    codes, short = set(), set()
    for char in field:
        point = ord(char)
        if point > 0xFFFF:
            point = 0xD800 + ((point - 0x10000) >> 10)
        codes.add(f"{point:04x}")
        if char in _SHORT:
            short.add(re.escape(_SHORT[char]))
    alternatives = ["u(?i:" + "|".join(sorted(codes)) + ")", *sorted(short)]
    return re.compile(("\\\\(?:" + "|".join(alternatives) + ")").encode())
