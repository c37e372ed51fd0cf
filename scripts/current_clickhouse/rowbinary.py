"""Decodes RowBinary result bodies, given the column types (as
RowBinaryWithNamesAndTypes names them), into lists of Python values, so that two
servers' answers can be compared value by value. Only the types clickagg reads
are needed; any other type is an error, never a silent guess."""

import re
import struct

_FIXED = {
    "UInt8": "<B", "UInt16": "<H", "UInt32": "<I", "UInt64": "<Q",
    "Int8": "<b", "Int16": "<h", "Int32": "<i", "Int64": "<q",
    "Float32": "<f", "Float64": "<d", "Date": "<H", "Date32": "<i", "Bool": "<B",
}


class DecodeError(Exception):
    pass


class Reader:
    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise DecodeError(f"{n} bytes wanted at {self.pos}, {len(self.data) - self.pos} left")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def leb128(self) -> int:
        shift = result = 0
        while True:
            b = self.take(1)[0]
            result |= (b & 0x7F) << shift
            if b < 0x80:
                return result
            shift += 7

    def string(self) -> bytes:
        return self.take(self.leb128())

    def at_end(self) -> bool:
        return self.pos == len(self.data)


def _inner(t: str, name: str) -> str:
    return t[len(name) + 1:-1]


def read_value(r: Reader, t: str):
    t = t.strip()
    if t in _FIXED:
        fmt = _FIXED[t]
        return struct.unpack(fmt, r.take(struct.calcsize(fmt)))[0]
    if t == "String":
        return r.string()
    if t == "UInt128":
        return int.from_bytes(r.take(16), "little")
    if t == "DateTime" or re.fullmatch(r"DateTime\('[^']*'\)", t):
        return struct.unpack("<I", r.take(4))[0]
    m = re.fullmatch(r"FixedString\((\d+)\)", t)
    if m:
        return r.take(int(m.group(1)))
    if t.startswith("LowCardinality("):
        return read_value(r, _inner(t, "LowCardinality"))
    if t.startswith("Nullable("):
        return None if r.take(1)[0] else read_value(r, _inner(t, "Nullable"))
    if t.startswith("Array("):
        return [read_value(r, _inner(t, "Array")) for _ in range(r.leb128())]
    raise DecodeError(f"type {t} is not decoded here")


def header(body: bytes):
    """Names, types and the offset of the first row of a RowBinaryWithNamesAndTypes body."""
    r = Reader(body)
    n = r.leb128()
    names = [r.string().decode() for _ in range(n)]
    types = [r.string().decode() for _ in range(n)]
    return names, types, r.pos


def rows(body: bytes, types):
    r = Reader(body)
    out = []
    while not r.at_end():
        out.append(tuple(read_value(r, t) for t in types))
    return out
