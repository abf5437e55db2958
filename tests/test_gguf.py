"""GGUF loader: valid files read back exactly (against gguf.GGUFWriter/GGUFReader),
every kind of damage is a GGUFError naming the file and the problem."""
from __future__ import annotations

import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from gguf import (GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFReader, GGUFValueType,
                  GGUFWriter, Keys)
from gguf.quants import dequantize, quantize

from minfer.format.gguf import GGUFError, TensorInfo, open_gguf

Q = GGMLQuantizationType
V = GGUFValueType
ALIGN = 32


# --- a hand-built GGUF writer, so that the damage can be put anywhere ---------------
# (checked against gguf.GGUFReader in test_builder_output_is_valid_for_gguf_reader)

def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


_FMT = {V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i",
        V.FLOAT32: "f", V.BOOL: "?", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d"}


def _kv(key: str, vtype: V, value, item: V | None = None) -> bytes:
    out = _str(key) + struct.pack("<I", vtype)
    if vtype == V.STRING:
        return out + _str(value)
    if vtype == V.ARRAY:
        out += struct.pack("<IQ", item, len(value))
        if item == V.STRING:
            return out + b"".join(_str(s) for s in value)
        return out + struct.pack("<" + _FMT[item] * len(value), *value)
    return out + struct.pack("<" + _FMT[vtype], value)


def _tensor_info(name: str, ne: list[int], qtype: int, rel_offset: int) -> bytes:
    return (_str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
            + struct.pack("<IQ", qtype, rel_offset))


def build(kvs: list[bytes], tensors: list[tuple[bytes, bytes]], *, magic=GGUF_MAGIC, version=3,
          n_tensors=None, n_kv=None) -> bytes:
    """tensors: (info bytes, data bytes placed at its offset) -> complete GGUF bytes."""
    head = struct.pack("<IIQQ", magic, version,
                       len(tensors) if n_tensors is None else n_tensors,
                       len(kvs) if n_kv is None else n_kv)
    head += b"".join(kvs) + b"".join(info for info, _ in tensors)
    head += bytes(-len(head) % ALIGN)
    data = bytearray()
    for info, blob in tensors:
        if not blob:
            continue
        rel = struct.unpack_from("<Q", info, len(info) - 8)[0]
        data += bytes(max(0, rel - len(data)))
        data[rel:rel + len(blob)] = blob
    return head + bytes(data)


def _random_f32(rng, shape) -> np.ndarray:
    return (rng.standard_normal(shape) + 0.1).astype(np.float32)


def _parts(rng):
    """kvs and tensors of a small valid file: an F32 matrix, a Q8_0 matrix, an F32 vector."""
    a = _random_f32(rng, (5, 7))                            # (rows, ne0)
    b = quantize(_random_f32(rng, (3, 64)), Q.Q8_0)          # (3, 2*34)
    c = _random_f32(rng, (13,))
    kvs = [_kv(Keys.General.ARCHITECTURE, V.STRING, "llama"),
           _kv("test.count", V.UINT32, 7),
           _kv("test.tokens", V.ARRAY, ["a", "bc", "Ġd"], item=V.STRING),
           _kv("test.scores", V.ARRAY, [0.5, -1.25], item=V.FLOAT32)]
    offs = [0, 160, 384]   # a: 140 bytes, b: 204, c: 52
    tensors = [(_tensor_info("a", [7, 5], Q.F32, offs[0]), a.tobytes()),
               (_tensor_info("b", [64, 3], Q.Q8_0, offs[1]), b.tobytes()),
               (_tensor_info("c", [13], Q.F32, offs[2]), c.tobytes())]
    return kvs, tensors, (a, b, c)


def _write(tmp_path: Path, data: bytes, name="model.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _valid(tmp_path, rng=None):
    kvs, tensors, arrays = _parts(rng or np.random.default_rng(1))
    return _write(tmp_path, build(kvs, tensors)), kvs, tensors, arrays


def expect_error(path: Path, *words: str, header_only=False) -> str:
    with pytest.raises(GGUFError) as ei:
        open_gguf(path, header_only=header_only)
    msg = str(ei.value)
    assert path.name in msg, msg
    for w in words:
        assert w in msg.lower(), msg
    assert "\n" not in msg
    return msg


# --- valid files ----------------------------------------------------------------------

def test_builder_output_is_valid_for_gguf_reader(tmp_path):
    p, _, _, (a, b, c) = _valid(tmp_path)
    r = GGUFReader(p)
    assert [t.name for t in r.tensors] == ["a", "b", "c"]
    assert np.array_equal(r.tensors[0].data, a)
    assert np.array_equal(r.tensors[1].data.reshape(b.shape), b)
    assert r.fields["test.tokens"].contents() == ["a", "bc", "Ġd"]


def test_hand_built_file_reads_back(tmp_path):
    p, _, _, (a, b, c) = _valid(tmp_path)
    with open_gguf(p) as gf:
        assert gf.version == 3 and gf.alignment == ALIGN
        assert gf.metadata == {Keys.General.ARCHITECTURE: "llama", "test.count": 7,
                               "test.tokens": ["a", "bc", "Ġd"], "test.scores": [0.5, -1.25]}
        assert list(gf.tensors) == ["a", "b", "c"]
        assert gf.tensors["a"].shape == (5, 7) and gf.tensors["b"].shape == (3, 64)
        assert np.array_equal(gf.raw("a").view(np.float32), a)
        assert np.array_equal(gf.raw("b"), b)
        assert np.array_equal(gf.raw("c").view(np.float32).reshape(-1), c)
        assert gf.raw("c").shape == (1, 13 * 4)


def _writer_file(tmp_path, rng):
    """A file written by gguf.GGUFWriter with every metadata value type."""
    md = {
        "t.u8": (V.UINT8, 200), "t.i8": (V.INT8, -100), "t.u16": (V.UINT16, 60000),
        "t.i16": (V.INT16, -30000), "t.u32": (V.UINT32, 4_000_000_000), "t.i32": (V.INT32, -2**31),
        "t.u64": (V.UINT64, 2**64 - 3), "t.i64": (V.INT64, -2**63 + 5),
        "t.f32": (V.FLOAT32, float(np.float32(0.1))), "t.f64": (V.FLOAT64, 0.1),
        "t.bool": (V.BOOL, True), "t.str": (V.STRING, "héllo ✓"),
    }
    arrays = {
        "t.tokens": ["<s>", "Ġthe", "日本", "", "\n"],
        "t.ints": rng.integers(-1000, 1000, 37).tolist(),
        "t.floats": [float(x) for x in rng.standard_normal(19).astype(np.float32)],
    }
    tensors = {
        "blk.0.w": _random_f32(rng, (6, 11)),                                 # F32 (6, 11)
        "blk.0.q": quantize(_random_f32(rng, (9, 96)), Q.Q8_0),               # Q8_0 (9, 96)
        "norm": _random_f32(rng, (17,)),
        "cube": _random_f32(rng, (2, 3, 5)),
    }
    p = tmp_path / "written.gguf"
    w = GGUFWriter(p, "llama")
    for k, (vt, v) in md.items():
        w.add_key_value(k, v, vt)
    w.add_array("t.tokens", arrays["t.tokens"])
    w.add_key_value("t.ints", arrays["t.ints"], V.ARRAY, sub_type=V.INT32)
    w.add_key_value("t.floats", arrays["t.floats"], V.ARRAY, sub_type=V.FLOAT32)
    for name, t in tensors.items():
        w.add_tensor(name, t, raw_dtype=Q.Q8_0 if name == "blk.0.q" else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p, md, arrays, tensors


def test_writer_round_trip(tmp_path):
    rng = np.random.default_rng(7)
    p, md, arrays, tensors = _writer_file(tmp_path, rng)
    gf = open_gguf(p)
    for k, (_, v) in md.items():
        assert gf.get(k) == v and type(gf.get(k)) is type(v), k
    for k, v in arrays.items():
        assert gf.get(k) == v, k
    assert gf.get(Keys.General.ARCHITECTURE) == "llama"
    assert gf.get("missing", 3) == 3

    for name, t in tensors.items():
        info = gf.tensors[name]
        raw = gf.raw(name)
        assert raw.dtype == np.uint8 and raw.shape == (info.n_rows, info.row_bytes)
        if name == "blk.0.q":
            assert info.qtype == Q.Q8_0 and info.shape == (9, 96)
            assert np.array_equal(raw, t)
            assert np.allclose(dequantize(raw, Q.Q8_0), dequantize(t, Q.Q8_0))
        else:
            assert info.qtype == Q.F32 and info.shape == t.shape
            assert np.array_equal(raw.view(np.float32).reshape(t.shape), t)

    # the tensor table agrees with gguf's own reader
    r = GGUFReader(p)
    assert list(gf.tensors) == [t.name for t in r.tensors]
    for rt in r.tensors:
        info = gf.tensors[rt.name]
        assert info.offset == rt.data_offset and info.nbytes == rt.n_bytes
        assert info.n_elements == rt.n_elements
        assert info.shape == tuple(int(x) for x in reversed(rt.shape))
        assert np.array_equal(gf.raw(rt.name).reshape(-1), rt.data.view(np.uint8).reshape(-1))
    for k, f in r.fields.items():
        if not k.startswith("GGUF."):
            assert gf.get(k) == f.contents(), k
    gf.close()


def test_raw_after_close_and_views_survive_close(tmp_path):
    p, _, _, (a, _, _) = _valid(tmp_path)
    gf = open_gguf(p)
    view = gf.raw("a")
    assert gf.close() is False                         # not unmapped: a view remains
    assert np.array_equal(view.view(np.float32), a)   # the view keeps the mapping alive
    with pytest.raises(GGUFError, match="closed"):
        gf.raw("a")
    gf = open_gguf(p)
    assert np.array_equal(gf.raw("a").view(np.float32), a)                 # a view, gone again
    assert gf.close() is True                          # no view left: unmapped now


def test_unknown_tensor_name(tmp_path):
    p, *_ = _valid(tmp_path)
    with pytest.raises(GGUFError, match="nope"):
        open_gguf(p).raw("nope")


# --- damage -----------------------------------------------------------------------------

def test_missing_and_empty_file(tmp_path):
    expect_error(tmp_path / "absent.gguf", "cannot open")
    expect_error(_write(tmp_path, b""), "magic")


def test_bad_magic(tmp_path):
    kvs, tensors, _ = _parts(np.random.default_rng(2))
    expect_error(_write(tmp_path, build(kvs, tensors, magic=0x46554748)), "magic")


@pytest.mark.parametrize("version", [1, 4, 99])
def test_bad_version(tmp_path, version):
    kvs, tensors, _ = _parts(np.random.default_rng(3))
    expect_error(_write(tmp_path, build(kvs, tensors, version=version)), "version", str(version))


def test_big_endian_rejected(tmp_path):
    kvs, tensors, _ = _parts(np.random.default_rng(3))
    data = bytearray(build(kvs, tensors))
    data[4:8] = struct.pack(">I", 3)
    expect_error(_write(tmp_path, bytes(data)), "big-endian")


def test_truncated_header(tmp_path):
    p, kvs, tensors, _ = _valid(tmp_path)
    data = p.read_bytes()
    cut = 24 + len(kvs[0]) + 5      # inside the second metadata entry's key
    expect_error(_write(tmp_path, data[:cut], "cut.gguf"), "truncated")


def test_truncated_tensor_data(tmp_path):
    p, *_ = _valid(tmp_path)
    data = p.read_bytes()
    expect_error(_write(tmp_path, data[:-3], "cut.gguf"), "truncated")


def test_every_prefix_is_rejected(tmp_path):
    """A file cut anywhere is an error, never a crash (irregular cut points, all of them)."""
    p, *_ = _valid(tmp_path)
    data = p.read_bytes()
    for n in range(len(data)):
        q = _write(tmp_path, data[:n], "prefix.gguf")
        with pytest.raises(GGUFError, match="prefix.gguf"):
            open_gguf(q)


def test_tensor_data_outside_file(tmp_path):
    kvs, tensors, _ = _parts(np.random.default_rng(4))
    far = (_tensor_info("a", [7, 5], Q.F32, 2**40), b"")   # aligned, far past the end
    expect_error(_write(tmp_path, build(kvs, [far] + tensors[1:])), "outside", "'a'")


def test_misaligned_offset(tmp_path):
    kvs, tensors, _ = _parts(np.random.default_rng(5))
    tensors[1] = (_tensor_info("b", [64, 3], Q.Q8_0, 168), tensors[1][1])   # 168 % 32 != 0
    expect_error(_write(tmp_path, build(kvs, tensors)), "misaligned", "168")


def test_custom_alignment_respected(tmp_path):
    kvs, tensors, _ = _parts(np.random.default_rng(5))
    kvs.append(_kv(Keys.General.ALIGNMENT, V.UINT32, 64))
    tensors[1] = (_tensor_info("b", [64, 3], Q.Q8_0, 160), tensors[1][1])   # 160 % 64 != 0
    expect_error(_write(tmp_path, build(kvs, tensors)), "misaligned", "64")
    kvs[-1] = _kv(Keys.General.ALIGNMENT, V.UINT32, 24)
    expect_error(_write(tmp_path, build(kvs, tensors), "a24.gguf"), "alignment", "power of two")


def test_shape_not_whole_blocks(tmp_path):
    kvs, tensors, _ = _parts(np.random.default_rng(6))
    bs = GGML_QUANT_SIZES[Q.Q8_0][0]
    tensors[1] = (_tensor_info("b", [bs + 5, 3], Q.Q8_0, 160), tensors[1][1])
    expect_error(_write(tmp_path, build(kvs, tensors)), "block", "'b'")


@pytest.mark.parametrize("bad", [4, 5, 1000, 2**32 - 1])   # 4, 5: Q4_2/Q4_3, removed from ggml
def test_unknown_tensor_type(tmp_path, bad):
    kvs, tensors, _ = _parts(np.random.default_rng(7))
    tensors[2] = (_tensor_info("c", [13], bad, 384), tensors[2][1])
    expect_error(_write(tmp_path, build(kvs, tensors)), "unknown tensor type", str(bad))


def test_bad_dimensions(tmp_path):
    kvs, tensors, _ = _parts(np.random.default_rng(8))
    five = (_tensor_info("c", [13, 1, 1, 1, 1], Q.F32, 384), tensors[2][1])
    expect_error(_write(tmp_path, build(kvs, tensors[:2] + [five]), "d5.gguf"), "dimensions")
    zero = (_tensor_info("c", [13, 0], Q.F32, 384), tensors[2][1])
    expect_error(_write(tmp_path, build(kvs, tensors[:2] + [zero]), "d0.gguf"), "zero dimension")
    huge = (_tensor_info("c", [2**40, 2**40], Q.F32, 384), tensors[2][1])
    expect_error(_write(tmp_path, build(kvs, tensors[:2] + [huge]), "dh.gguf"), "absurd")
    # a huge but representable shape: caught by the file-size check
    big = (_tensor_info("c", [2**20, 2**20], Q.F32, 384), tensors[2][1])
    expect_error(_write(tmp_path, build(kvs, tensors[:2] + [big]), "db.gguf"), "outside")


def test_overlapping_tensors(tmp_path):
    kvs, tensors, _ = _parts(np.random.default_rng(9))
    b_over_a = (_tensor_info("b", [64, 3], Q.Q8_0, 128), b"")   # "a" spans [0, 140)
    expect_error(_write(tmp_path, build(kvs, [tensors[0], b_over_a, tensors[2]])), "overlap")


def test_duplicate_tensor_names(tmp_path):
    kvs, tensors, _ = _parts(np.random.default_rng(10))
    tensors[2] = (_tensor_info("a", [13], Q.F32, 384), tensors[2][1])
    expect_error(_write(tmp_path, build(kvs, tensors)), "duplicate tensor", "'a'")


def test_duplicate_metadata_key(tmp_path):
    kvs, tensors, _ = _parts(np.random.default_rng(11))
    kvs.append(_kv("test.count", V.UINT32, 8))
    expect_error(_write(tmp_path, build(kvs, tensors)), "duplicate metadata key", "test.count")


def _with_raw_kv(kv_bytes: bytes, rng_seed=12) -> bytes:
    kvs, tensors, _ = _parts(np.random.default_rng(rng_seed))
    return build(kvs + [kv_bytes], tensors)


@pytest.mark.parametrize("item", [V.UINT32, V.UINT8, V.STRING, V.ARRAY, V.FLOAT64])
@pytest.mark.parametrize("count", [2**60, 2**64 - 1, 10**6])
def test_absurd_array_length(tmp_path, item, count):
    kv = _str("test.big") + struct.pack("<IIQ", V.ARRAY, item, count) + b"\x01" * 40
    expect_error(_write(tmp_path, _with_raw_kv(kv)), "array length", str(count))


@pytest.mark.parametrize("size", [2**62, 2**64 - 1, 5000])
def test_absurd_string_size(tmp_path, size):
    kv = _str("test.s") + struct.pack("<IQ", V.STRING, size) + b"abc"
    expect_error(_write(tmp_path, _with_raw_kv(kv)), "string size", str(size))
    key = struct.pack("<Q", size) + b"k"          # the key itself lies
    expect_error(_write(tmp_path, _with_raw_kv(key), "key.gguf"), "string size", str(size))
    # a string inside a string array
    arr = (_str("test.toks") + struct.pack("<IIQ", V.ARRAY, V.STRING, 2) + _str("ok")
           + struct.pack("<Q", size) + b"xyz")
    expect_error(_write(tmp_path, _with_raw_kv(arr), "arr.gguf"), "string size", "test.toks[1]")


@pytest.mark.parametrize("n_tensors,n_kv", [(2**63, 4), (3, 2**62), (2**64 - 1, 2**64 - 1)])
def test_absurd_counts(tmp_path, n_tensors, n_kv):
    kvs, tensors, _ = _parts(np.random.default_rng(13))
    expect_error(_write(tmp_path, build(kvs, tensors, n_tensors=n_tensors, n_kv=n_kv)),
                 "cannot fit")


def test_unknown_value_type(tmp_path):
    kv = _str("test.x") + struct.pack("<I", 13) + b"\0" * 8
    expect_error(_write(tmp_path, _with_raw_kv(kv)), "unknown value type", "13")
    arr = _str("test.y") + struct.pack("<IIQ", V.ARRAY, 77, 1) + b"\0" * 8
    expect_error(_write(tmp_path, _with_raw_kv(arr), "arr.gguf"), "unknown value type", "77")


def test_invalid_utf8_token(tmp_path):
    arr = (_str("tokenizer.ggml.tokens") + struct.pack("<IIQ", V.ARRAY, V.STRING, 3)
           + _str("a") + _str(b"\xc3\x28") + _str("c"))
    expect_error(_write(tmp_path, _with_raw_kv(arr)), "utf-8", "tokenizer.ggml.tokens[1]")


def test_deeply_nested_arrays(tmp_path):
    depth = 500
    kv = _str("test.n") + struct.pack("<I", V.ARRAY) + struct.pack("<IQ", V.ARRAY, 1) * depth
    kv += struct.pack("<IQ", V.UINT8, 1) + b"\x05"
    expect_error(_write(tmp_path, _with_raw_kv(kv)), "nested")


def test_shallow_nested_arrays_read(tmp_path):
    kv = (_str("test.n") + struct.pack("<I", V.ARRAY) + struct.pack("<IQ", V.ARRAY, 2)
          + struct.pack("<IQ", V.INT16, 2) + struct.pack("<hh", -3, 9)
          + struct.pack("<IQ", V.STRING, 1) + _str("z"))
    gf = open_gguf(_write(tmp_path, _with_raw_kv(kv)))
    assert gf.get("test.n") == [[-3, 9], ["z"]]


# --- the 7B header and the real model --------------------------------------------------

def test_7b_header_only(header_7b):
    gf = open_gguf(header_7b, header_only=True)
    assert len(gf.tensors) == 339
    assert Counter(t.qtype for t in gf.tensors.values()) == {Q.Q4_K: 169, Q.Q6_K: 29, Q.F32: 141}
    # the header file is the 7B file's first bytes, up to where tensor data starts
    assert gf.data_offset == header_7b.stat().st_size
    assert gf.tensors["output.weight"].shape == (152064, 3584)
    assert gf.tensors["output.weight"].qtype == Q.Q6_K
    assert gf.tensors["blk.3.attn_v.weight"].shape == (512, 3584)
    assert gf.tensors["blk.27.ffn_down.weight"].shape == (3584, 18944)
    assert all(isinstance(t, TensorInfo) for t in gf.tensors.values())
    # 4,683,073,248 bytes in the complete file (models/README.md): the last tensor ends there
    assert max(t.offset + t.nbytes for t in gf.tensors.values()) == 4_683_073_248
    assert len(gf.get(Keys.Tokenizer.LIST)) == 152064
    assert len(gf.get(Keys.Tokenizer.TOKEN_TYPE)) == 152064
    assert all(isinstance(s, str) for s in gf.get(Keys.Tokenizer.MERGES))
    assert isinstance(gf.get(Keys.Tokenizer.CHAT_TEMPLATE), str)
    with pytest.raises(GGUFError, match="header_only"):
        gf.raw("output.weight")
    # without header_only the missing data is an error
    expect_error(header_7b, "outside")


@pytest.mark.model
def test_real_model_matches_gguf_reader(real_model_path):
    gf = open_gguf(real_model_path)
    r = GGUFReader(real_model_path)
    assert list(gf.tensors) == [t.name for t in r.tensors]
    for rt in r.tensors:
        info = gf.tensors[rt.name]
        assert info.qtype == rt.tensor_type
        assert info.shape == tuple(int(x) for x in reversed(rt.shape))
        assert (info.offset, info.nbytes, info.n_elements) == (rt.data_offset, rt.n_bytes,
                                                               rt.n_elements)
    for name in ("blk.0.attn_q.bias", "blk.5.ffn_down.weight", "output_norm.weight"):
        rt = next(t for t in r.tensors if t.name == name)
        assert np.array_equal(gf.raw(name).reshape(-1), rt.data.view(np.uint8).reshape(-1))
    for k in (Keys.General.ARCHITECTURE, Keys.Tokenizer.LIST, Keys.Tokenizer.MERGES,
              Keys.Tokenizer.TOKEN_TYPE, "qwen2.attention.layer_norm_rms_epsilon"):
        assert gf.get(k) == r.fields[k].contents(), k
