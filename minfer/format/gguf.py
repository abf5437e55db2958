"""GGUF file access: mmap once, validate everything, expose metadata and a tensor table.

Knows the file format only (no model knowledge). The layout, magic, versions,
value types and quantization sizes all come from the `gguf` package's
constants; the header is walked here rather than by `gguf.GGUFReader` because
that reader has no bounds checks (a lying array length makes it loop for ever,
other damage surfaces as a bare KeyError/IndexError) and cannot open a file
that stops where tensor data starts. Every problem is a `GGUFError` naming the
file; every length read from the file is checked against the bytes that
remain before anything is allocated or decoded.

INTERFACE (implemented by the loader work; other modules rely on exactly this):

    gf = open_gguf(path, header_only=False)   # -> GGUFFile; raises GGUFError
    gf.path: str
    gf.version: int
    gf.alignment: int
    gf.data_offset: int                       # absolute offset of the tensor data section
    gf.file_size: int; gf.header_only: bool
    gf.metadata: dict[str, object]            # key -> str | int | float | bool | list, in file
                                              #   order. Every array is a Python list (token
                                              #   lists list[str], scores list[float], token
                                              #   types list[int]); float32 values are widened
                                              #   exactly to Python floats.
    gf.get(key, default=None)
    gf.tensors: dict[str, TensorInfo]         # in file order
    gf.raw(name) -> np.ndarray                # uint8 read-only view of the mmap, shape
                                              #   (rows, row_bytes) for any type (row = last
                                              #   numpy dim = ggml ne[0]); header_only files
                                              #   raise GGUFError here
    gf.close() -> bool                        # True: unmapped now; False: raw() views remain
                                              # also: `with open_gguf(...) as gf:`

    TensorInfo(name, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...] in numpy order
               (e.g. (n_out, n_in) for a linear weight; ggml's ne reversed),
               offset: int absolute file offset, nbytes: int, n_elements: int,
               row_bytes: int, n_rows: int)

`header_only=True` is for files that stop where tensor data starts (the 7B header
in models/): the tensor table is still validated (shapes, types, alignment,
overlap), but not against the end of the file.

Only little-endian files are accepted (a big-endian file is rejected by name):
the dequantizers read tensor bytes as little-endian.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, replace

import numpy as np
from gguf import (GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, READER_SUPPORTED_VERSIONS,
                  GGMLQuantizationType, GGUFValueType, Keys)

from ..errors import MinferError

GGML_MAX_DIMS = 4  # ggml.h; a GGUF tensor has 1..GGML_MAX_DIMS dimensions
# ggml counts elements in int64_t; anything larger is a lying header.
_MAX_ELEMENTS = 2**63 - 1
# Arrays of arrays are legal GGUF but unused by any model; a bound keeps a crafted
# file from exhausting the Python stack.
_MAX_NESTING = 8

V = GGUFValueType
# Little-endian numpy dtype of each fixed-size value type (STRING and ARRAY are variable).
_DTYPE = {
    V.UINT8: np.dtype("<u1"), V.INT8: np.dtype("<i1"),
    V.UINT16: np.dtype("<u2"), V.INT16: np.dtype("<i2"),
    V.UINT32: np.dtype("<u4"), V.INT32: np.dtype("<i4"),
    V.UINT64: np.dtype("<u8"), V.INT64: np.dtype("<i8"),
    V.FLOAT32: np.dtype("<f4"), V.FLOAT64: np.dtype("<f8"),
    V.BOOL: np.dtype("<u1"),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# Fewest bytes one value of each type can occupy: an array of N items must have
# N * this many bytes left, which is what keeps a lying length from allocating
# or looping.
_MIN_SIZE = {**{t: d.itemsize for t, d in _DTYPE.items()},
             V.STRING: _U64.size,                       # length, then the bytes
             V.ARRAY: _U32.size + _U64.size}            # item type, count
# Fewest bytes of one metadata entry (key length, value type, smallest value) and
# of one tensor-table entry (name length, n_dims, one dim, type, offset).
_MIN_KV = _U64.size + _U32.size + 1
_MIN_TENSOR = _U64.size + _U32.size + _U64.size + _U32.size + _U64.size


class GGUFError(MinferError):
    """A malformed or unsupported GGUF file; the message names the file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]   # numpy order: ggml ne reversed, shape[-1] = ne[0]
    offset: int              # absolute file offset of the first byte
    nbytes: int
    n_elements: int
    row_bytes: int           # bytes of one row of shape[-1] elements
    n_rows: int              # product of shape[:-1] (1 for a vector)


class _Cursor:
    """Bounds-checked little-endian reads over the mapped header."""

    def __init__(self, buf, end: int, path: str):
        self.buf, self.pos, self.end, self.path = buf, 0, end, path

    def fail(self, msg: str) -> GGUFError:
        return GGUFError(f"{self.path}: {msg}")

    def need(self, n: int, what: str) -> None:
        if n > self.end - self.pos:
            raise self.fail(f"truncated: {what} needs {n} bytes at offset {self.pos}, "
                            f"only {self.end - self.pos} remain")

    def u32(self, what: str) -> int:
        self.need(4, what)
        v = _U32.unpack_from(self.buf, self.pos)[0]
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        v = _U64.unpack_from(self.buf, self.pos)[0]
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        if n > self.end - self.pos:
            raise self.fail(f"string size {n} of {what} at offset {self.pos - 8} exceeds the "
                            f"{self.end - self.pos} bytes left in the file")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None

    def strings(self, n: int, what: str) -> list[str]:
        """n length-prefixed strings; `string` inlined, as vocabularies hold ~150k of them."""
        buf, pos, end, unpack = self.buf, self.pos, self.end, _U64.unpack_from
        out = []
        for i in range(n):
            if end - pos < 8:
                self.pos = pos
                self.need(8, f"length of {what}[{i}]")
            k = unpack(buf, pos)[0]
            pos += 8
            if k > end - pos:
                raise self.fail(f"string size {k} of {what}[{i}] at offset {pos - 8} exceeds "
                                f"the {end - pos} bytes left in the file")
            try:
                out.append(buf[pos:pos + k].decode("utf-8"))
            except UnicodeDecodeError as e:
                raise self.fail(f"{what}[{i}] is not valid UTF-8 "
                                f"({e.reason} at byte {e.start})") from None
            pos += k
        self.pos = pos
        return out

    def value_type(self, what: str) -> GGUFValueType:
        t = self.u32(f"type of {what}")
        try:
            return GGUFValueType(t)
        except ValueError:
            raise self.fail(f"unknown value type {t} for {what}") from None

    def array_count(self, item: GGUFValueType, what: str) -> int:
        n = self.u64(f"length of {what}")
        if n * _MIN_SIZE[item] > self.end - self.pos:
            raise self.fail(f"array length {n} of {what} ({item.name}) exceeds the "
                            f"{self.end - self.pos} bytes left in the file")
        return n

    def value(self, vtype: GGUFValueType, what: str, depth: int = 0):
        if vtype == V.STRING:
            return self.string(what)
        if vtype == V.ARRAY:
            item = self.value_type(f"items of {what}")
            n = self.array_count(item, what)
            if item == V.STRING:
                return self.strings(n, what)
            if item == V.ARRAY:
                if depth >= _MAX_NESTING:
                    raise self.fail(f"{what}: arrays nested deeper than {_MAX_NESTING}")
                return [self.value(V.ARRAY, f"{what}[{i}]", depth + 1) for i in range(n)]
            a = self.scalars(item, n, what)
            return [bool(x) for x in a] if item == V.BOOL else a.tolist()
        a = self.scalars(vtype, 1, what)
        return bool(a[0]) if vtype == V.BOOL else a[0].item()

    def scalars(self, vtype: GGUFValueType, n: int, what: str) -> np.ndarray:
        dt = _DTYPE[vtype]
        self.need(n * dt.itemsize, what)
        a = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)
        self.pos += n * dt.itemsize
        if vtype == V.BOOL and (a > 1).any():
            raise self.fail(f"{what}: bool value other than 0 or 1")
        return a


class GGUFFile:
    """An open, validated GGUF file. Build it with `open_gguf`."""

    def __init__(self, path: str, header_only: bool = False):
        self.path = path
        self.header_only = header_only
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                # mmap cannot map an empty file; the header check below reports it
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except OSError as e:
            raise GGUFError(f"{path}: cannot open ({e.strerror or e})") from None
        self.file_size = size
        try:
            self._parse()
        except GGUFError:
            self.close()  # a rejected file keeps no mapping open
            raise

    # --- the header walk ------------------------------------------------
    def _parse(self) -> None:
        c = _Cursor(self._mm, self.file_size, self.path)
        if self.file_size < 4 or c.u32("magic") != GGUF_MAGIC:
            raise c.fail("bad magic: not a GGUF file")
        self.version = c.u32("version")
        if self.version not in READER_SUPPORTED_VERSIONS:
            if int.from_bytes(self.version.to_bytes(4, "little"), "big") in READER_SUPPORTED_VERSIONS:
                raise c.fail("big-endian GGUF files are not supported")
            raise c.fail(f"unsupported GGUF version {self.version} "
                         f"(supported: {', '.join(map(str, READER_SUPPORTED_VERSIONS))})")
        n_tensors = c.u64("tensor count")
        n_kv = c.u64("metadata count")
        if n_kv * _MIN_KV + n_tensors * _MIN_TENSOR > c.end - c.pos:
            raise c.fail(f"truncated or corrupt header: {n_kv} metadata entries and "
                         f"{n_tensors} tensors cannot fit in the {c.end - c.pos} bytes left")

        self.metadata: dict[str, object] = {}
        for i in range(n_kv):
            key = c.string(f"metadata key #{i}")
            if key in self.metadata:
                raise c.fail(f"duplicate metadata key {key!r}")
            self.metadata[key] = c.value(c.value_type(f"metadata {key}"), key)

        self.alignment = GGUF_DEFAULT_ALIGNMENT
        if Keys.General.ALIGNMENT in self.metadata:
            a = self.metadata[Keys.General.ALIGNMENT]
            if type(a) is not int or a <= 0 or a & (a - 1):
                raise c.fail(f"{Keys.General.ALIGNMENT} must be a positive power of two, got {a!r}")
            self.alignment = a

        table = [self._tensor_entry(c, i) for i in range(n_tensors)]
        self.data_offset = -(-c.pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorInfo] = {}
        for t in table:
            if t.name in self.tensors:
                raise c.fail(f"duplicate tensor name {t.name!r}")
            self.tensors[t.name] = t
        self._check_layout()

    def _tensor_entry(self, c: _Cursor, i: int) -> TensorInfo:
        name = c.string(f"tensor name #{i}")
        what = f"tensor {name!r}"
        n_dims = c.u32(f"dimension count of {what}")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise c.fail(f"{what} has {n_dims} dimensions (1..{GGML_MAX_DIMS} allowed)")
        ne = [c.u64(f"dimensions of {what}") for _ in range(n_dims)]  # ggml order, ne[0] first
        t = c.u32(f"type of {what}")
        try:
            qtype = GGMLQuantizationType(t)
        except ValueError:
            raise c.fail(f"{what} has unknown tensor type {t}") from None
        if qtype not in GGML_QUANT_SIZES:
            raise c.fail(f"{what} has tensor type {qtype.name} with no known block size")
        rel = c.u64(f"data offset of {what}")

        if any(d == 0 for d in ne):
            raise c.fail(f"{what} has a zero dimension {tuple(ne)}")
        n_elements = int(np.prod(ne, dtype=object))
        if n_elements > _MAX_ELEMENTS:
            raise c.fail(f"{what} has an absurd shape {tuple(ne)}")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if ne[0] % block:
            raise c.fail(f"{what}: row length {ne[0]} is not a whole number of "
                         f"{qtype.name} blocks of {block}")
        if rel % self.alignment:
            raise c.fail(f"{what}: data offset {rel} is misaligned "
                         f"(not a multiple of the alignment {self.alignment})")
        row_bytes = ne[0] // block * type_size
        n_rows = n_elements // ne[0]
        # offset is made absolute in _check_layout, once the data section start is known
        return TensorInfo(name=name, qtype=qtype, shape=tuple(reversed(ne)), offset=rel,
                          nbytes=n_rows * row_bytes, n_elements=n_elements,
                          row_bytes=row_bytes, n_rows=n_rows)

    def _check_layout(self) -> None:
        """Make offsets absolute; tensor data must not overlap and (unless
        header_only) must lie inside the file."""
        self.tensors = {n: replace(t, offset=self.data_offset + t.offset)
                        for n, t in self.tensors.items()}
        if not self.header_only and self.data_offset > self.file_size and self.tensors:
            raise GGUFError(f"{self.path}: truncated: tensor data section starts at "
                            f"{self.data_offset}, file has {self.file_size} bytes")
        prev = None
        for t in sorted(self.tensors.values(), key=lambda t: t.offset):
            if prev is not None and t.offset < prev.offset + prev.nbytes:
                raise GGUFError(f"{self.path}: tensors {prev.name!r} and {t.name!r} overlap "
                                f"in the data section")
            if not self.header_only and t.offset + t.nbytes > self.file_size:
                raise GGUFError(
                    f"{self.path}: tensor {t.name!r} data [{t.offset}, {t.offset + t.nbytes}) "
                    f"lies outside the file ({self.file_size} bytes; truncated?)")
            prev = t

    # --- access -----------------------------------------------------------
    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """Tensor bytes as a read-only uint8 view of the mapping, (n_rows, row_bytes)."""
        if self.header_only:
            raise GGUFError(f"{self.path}: opened header_only, it holds no tensor data ({name})")
        if self._mm is None:
            raise GGUFError(f"{self.path}: file is closed")
        t = self.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.path}: no tensor named {name!r}")
        a = np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return a.reshape(t.n_rows, t.row_bytes)  # (rows, row_bytes)

    def close(self) -> bool:
        """Drop the mapping -> True if it is unmapped now; False while views handed
        out by raw() still exist (the map is released with the last of them)."""
        mm, self._mm = self._mm, None
        if isinstance(mm, mmap.mmap):
            try:
                mm.close()
            except BufferError:
                return False
        return True

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GGUFFile({self.path!r}, v{self.version}, {len(self.metadata)} keys, "
                f"{len(self.tensors)} tensors{', header only' if self.header_only else ''})")


def open_gguf(path, header_only: bool = False) -> GGUFFile:
    """Map and validate a GGUF file; raises GGUFError (naming the file) on any defect."""
    return GGUFFile(os.fspath(path), header_only=header_only)
