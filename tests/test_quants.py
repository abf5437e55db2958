"""minfer.format.quants and minfer.format.quantize against independent truth:
gguf.quants.dequantize (random blocks and the real model's tensors), error bounds
of the quantizers, and the host half of the W_exp byte-exactness check: an
independent scalar mirror written from the q6_K format vs
expand_q6k_dense(pad_q6k(raw)) of minfer/backend/cuda/q6k_layout.py (the GPU
tests compare the device plane with both)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from minfer.format import quants
from minfer.backend.cuda.q6k_layout import Q6K_PADDED, expand_q6k_dense, pad_q6k
from minfer.errors import MinferError
from minfer.format.quantize import quantize

ALL = sorted(quants.SUPPORTED, key=lambda t: t.name)


def bits(a) -> np.ndarray:
    """float32 array -> its uint32 bit patterns (exact, NaN-safe comparison)."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def small_f16(rng, n: int) -> np.ndarray:
    """(n, 2) uint8: finite random f16 scales of either sign, some subnormal-ish."""
    v = rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 0, n)
    return v.astype(np.float16).reshape(n, 1).view(np.uint8)


# byte offsets of the f16 fields of each block format (ggml block structs); every
# other byte (quants, packed scales, high-bit masks) takes every bit pattern
F16_FIELDS = {QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2], QT.Q8_0: [0],
              QT.Q2_K: [80, 82], QT.Q3_K: [108], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208]}


def random_rows(rng, qtype, n_rows: int, blocks_per_row: int) -> np.ndarray:
    """(n_rows, row_bytes) uint8 of random blocks whose f16 scale fields are finite."""
    bsz, tsz = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n_rows * blocks_per_row, tsz), dtype=np.uint8)
    for off in F16_FIELDS.get(qtype, []):
        blocks[:, off:off + 2] = small_f16(rng, blocks.shape[0])
    if qtype == QT.F16:
        blocks[:] = small_f16(rng, blocks.shape[0])
    if qtype == QT.BF16:                 # keep exponents finite: clear the top exponent bit
        blocks[:, 1] &= 0xBF
    if qtype == QT.F32:
        blocks[:, 3] &= 0xBF
    return blocks.reshape(n_rows, blocks_per_row * tsz)


# --------------------------------------------------------------------------- #
# (1) dequantizers vs gguf on random blocks                                    #
# --------------------------------------------------------------------------- #

def test_every_supported_block_type_has_its_f16_fields_listed():
    # random_rows draws finite scales only where F16_FIELDS says the f16 fields are
    assert {t for t in quants.SUPPORTED if GGML_QUANT_SIZES[t][0] > 1} == set(F16_FIELDS)


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_dequantize_random_blocks_bit_exact(qtype):
    rng = np.random.default_rng(1000 + int(qtype))
    bsz = GGML_QUANT_SIZES[qtype][0]
    for n_rows, bpr in [(1, 1), (7, 3), (13, 5), (3, 17)]:
        bpr = bpr * (64 if bsz == 1 else 1)            # scalar types: longer rows
        raw = random_rows(rng, qtype, n_rows, bpr)
        want = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(n_rows, -1)
        got = quants.dequantize_rows(raw, qtype, bpr * bsz)
        assert got.dtype == np.float32 and got.shape == (n_rows, bpr * bsz)
        assert np.isfinite(got).all()
        assert np.array_equal(bits(got), bits(want)), f"{qtype.name} ({n_rows}x{bpr} blocks)"


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.F32], ids=lambda t: t.name)
def test_dequantize_shape_and_flat_input(qtype):
    rng = np.random.default_rng(7)
    bsz = GGML_QUANT_SIZES[qtype][0]
    n_cols = bsz * (3 if bsz > 1 else 96)
    raw = random_rows(rng, qtype, 2 * 5, n_cols // bsz)               # 10 rows
    want = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(2, 5, n_cols)
    got = quants.dequantize(raw.reshape(-1), qtype, (2, 5, n_cols))
    assert got.shape == (2, 5, n_cols) and np.array_equal(bits(got), bits(want))
    assert got.flags.writeable and got.flags.c_contiguous


def test_dequantize_many_rows_crosses_chunks():
    # more rows than one chunk (the row loop and the thread pool must cover all of them)
    rng = np.random.default_rng(3)
    n_rows = quants._CHUNK_ELEMS // 512 * 2 + 37
    raw = random_rows(rng, QT.Q6_K, n_rows, 2)
    want = np.asarray(gguf.quants.dequantize(raw, QT.Q6_K), np.float32).reshape(n_rows, 512)
    assert np.array_equal(bits(quants.dequantize_rows(raw, QT.Q6_K, 512)), bits(want))


def test_bad_input_is_a_minfer_error():
    raw = np.zeros((4, 144), np.uint8)
    with pytest.raises(MinferError, match="not a positive multiple"):
        quants.dequantize_rows(raw, QT.Q4_K, 300)
    with pytest.raises(MinferError, match="does not hold rows"):
        quants.dequantize_rows(raw, QT.Q4_K, 512)
    with pytest.raises(MinferError, match="bytes do not hold"):
        quants.dequantize(raw, QT.Q4_K, (5, 256))
    with pytest.raises(MinferError, match="unsupported tensor type IQ2_XXS"):
        quants.dequantize_rows(raw, QT.IQ2_XXS, 256)
    with pytest.raises(MinferError, match="no quantizer for Q5_K"):
        quantize(np.ones((1, 256), np.float32), QT.Q5_K)
    with pytest.raises(MinferError, match="NaN or Inf"):
        quantize(np.full((1, 256), np.nan, np.float32), QT.Q4_K)
    with pytest.raises(MinferError, match="exceeds the f16 range"):
        quantize(np.full((2, 3), 1e5, np.float32), QT.F16)
    with pytest.raises(MinferError, match="multiple of 256"):
        expand_q6k_dense(np.zeros(224, np.uint8), 1, 200)


# --------------------------------------------------------------------------- #
# (2) the real model: every type present, several tensors or row slices        #
# --------------------------------------------------------------------------- #

@pytest.fixture(scope="module")
def real_gguf(real_model_path):
    # the project's loader (gguf.GGUFReader takes ~11 s on this file's vocabulary)
    from minfer.format.gguf import open_gguf
    gf = open_gguf(real_model_path)
    yield gf
    gf.close()


@pytest.mark.model
def test_dequantize_real_model_bit_exact(real_gguf):
    by_type: dict[QT, list] = {}
    for t in real_gguf.tensors.values():
        by_type.setdefault(QT(t.qtype), []).append(t)
    assert {QT.Q4_K, QT.Q6_K, QT.F32} <= set(by_type)
    checked = 0
    for qtype, tensors in by_type.items():
        # first, middle and last tensor of each type; the last 512 rows of each
        for t in {id(x): x for x in (tensors[0], tensors[len(tensors) // 2], tensors[-1])}.values():
            n_cols = t.shape[-1]
            raw = real_gguf.raw(t.name)                               # (rows, row_bytes)
            assert raw.shape[1] == quants.row_bytes(qtype, n_cols)
            rows = np.ascontiguousarray(raw[-512:])
            want = np.asarray(gguf.quants.dequantize(rows, qtype), np.float32).reshape(rows.shape[0], n_cols)
            got = quants.dequantize_rows(rows, qtype, n_cols)
            assert np.array_equal(bits(got), bits(want)), t.name
            checked += 1
    assert checked >= 7


@pytest.mark.model
def test_dequantize_smollm2_bit_exact(smollm2_path):
    # the llama model's types: Q4_1 layer weights, the Q8_0 embedding (also its LM head)
    from minfer.format.gguf import open_gguf
    with open_gguf(smollm2_path) as gf:
        names = ["token_embd.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight",
                 "blk.29.ffn_gate.weight", "blk.29.attn_output.weight"]
        assert {QT(gf.tensors[n].qtype) for n in names} == {QT.Q8_0, QT.Q4_1}
        for name in names:
            t = gf.tensors[name]
            rows = np.ascontiguousarray(gf.raw(name)[-512:])
            want = np.asarray(gguf.quants.dequantize(rows, t.qtype), np.float32).reshape(rows.shape[0], -1)
            got = quants.dequantize_rows(rows, t.qtype, t.shape[-1])
            assert np.array_equal(bits(got), bits(want)), name


# --------------------------------------------------------------------------- #
# (3) quantizers                                                               #
# --------------------------------------------------------------------------- #

# relative RMS error bounds on N(0, s^2) data; measured here ~0.072 (Q4_K search),
# ~0.079 (Q4_K fast), ~0.018/0.019 (Q6_K), ~0.0053 (Q8_0)
BOUNDS = {QT.Q4_K: 0.09, QT.Q6_K: 0.025, QT.Q8_0: 0.008}


@pytest.mark.parametrize("search", [True, False], ids=["search", "fast"])
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0], ids=lambda t: t.name)
def test_quantize_error_bound_and_round_trip(qtype, search):
    rng = np.random.default_rng(50 + int(qtype) + search)
    bsz, tsz = GGML_QUANT_SIZES[qtype]
    for n_rows, n_blocks in [(1, 1), (11, 3), (29, 2)]:
        n_cols = bsz * n_blocks * (8 if bsz == 32 else 1)
        x = (rng.standard_normal((n_rows, n_cols)) * rng.uniform(0.01, 3.0)).astype(np.float32)
        q = quantize(x, qtype, search=search)
        assert q.dtype == np.uint8 and q.shape == (n_rows, n_cols // bsz * tsz)
        ref = np.asarray(gguf.quants.dequantize(q, qtype), np.float32).reshape(n_rows, n_cols)
        assert np.array_equal(bits(ref), bits(quants.dequantize_rows(q, qtype, n_cols)))
        rel = np.sqrt(np.mean((ref - x) ** 2) / np.mean(x ** 2))
        assert rel < BOUNDS[qtype], f"{qtype.name} search={search}: relative RMS error {rel:.4f}"


def test_quantize_search_not_worse_than_fast():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((64, 1024)).astype(np.float32)
    for qtype in (QT.Q4_K, QT.Q6_K):
        err = {}
        for search in (True, False):
            y = gguf.quants.dequantize(quantize(x, qtype, search=search), qtype).reshape(x.shape)
            err[search] = np.mean((y - x) ** 2)
        assert err[True] <= err[False], qtype.name


def test_quantize_irregular_data():
    # all-equal, all-zero and one-sign sub-blocks, huge dynamic range across blocks
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, 512)).astype(np.float32)
    x[0] = 0.0
    x[1, :256] = 0.75
    x[2] = np.abs(x[2]) + 1.0
    x[3] = -np.abs(x[3]) - 1.0
    x[4, :32] = 0.0
    x[5] *= np.repeat(10.0 ** rng.uniform(-4, 2, 16), 32).astype(np.float32)
    # max |error| / max |x| per row (measured: Q4_K ~0.06, Q6_K ~0.016, Q8_0 ~0.004)
    bound = {QT.Q4_K: 0.1, QT.Q6_K: 0.03, QT.Q8_0: 0.008, QT.F16: 0.001, QT.F32: 0.0}
    row_max = np.maximum(np.abs(x).max(axis=1, keepdims=True), np.float32(1e-30))
    for qtype, search in [(t, s) for t in bound for s in (True, False)]:
        q = quantize(x, qtype, search=search)
        y = np.asarray(gguf.quants.dequantize(q, qtype), np.float32).reshape(x.shape)
        assert np.array_equal(bits(y), bits(quants.dequantize_rows(q, qtype, 512)))
        assert np.isfinite(y).all()
        assert not y[0].any(), qtype.name                       # zeros stay zeros
        assert np.max(np.abs(y - x) / row_max) <= bound[qtype], (qtype.name, search)
    assert np.array_equal(quantize(x, QT.F32).view(np.float32), x)


# --------------------------------------------------------------------------- #
# (4) W_exp, host half of the three-way byte-exactness check                  #
# --------------------------------------------------------------------------- #

def scalar_mirror(raw: bytes, od: int, id: int) -> list[int]:
    """W_exp from the q6_K format description, one element at a time (plain Python).

    block_q6_K = ql[128] qh[64] scales[16] d[2]. Element e of a super-block:
    half = e // 128 uses ql[64*half ...] and qh[32*half ...]; inside the half,
    r = e % 128, quarter t = r // 32, lane l = r % 32: the low 4 bits are
    nibble (t // 2) of ql[64*half + 32*(t % 2) + l], the high 2 bits are
    bits 2t..2t+1 of qh[32*half + l]; the value is that 6-bit number - 32.
    Rows are dense: element (j, c) lands at j*id + c.
    """
    nbe = id // 256
    want = [0] * (od * id)
    for j in range(od):
        for sb in range(nbe):
            base = (j * nbe + sb) * 210
            for e in range(256):
                half, r = divmod(e, 128)
                t, l = divmod(r, 32)
                qlb = raw[base + 64 * half + 32 * (t % 2) + l]
                qhb = raw[base + 128 + 32 * half + l]
                lo = (qlb >> (4 * (t // 2))) & 0xF
                hi = (qhb >> (2 * t)) & 0x3
                want[j * id + sb * 256 + e] = (lo | (hi << 4)) - 32
    return want


def check_w_exp(raw: np.ndarray, od: int, id: int) -> None:
    padded = pad_q6k(raw)
    nb = id // 256
    assert padded.shape == (od, nb * Q6K_PADDED)
    pb = padded.reshape(od, nb, Q6K_PADDED)
    assert np.array_equal(pb[:, :, :quants.Q6K_BLOCK], raw.reshape(od, nb, quants.Q6K_BLOCK))
    assert not pb[:, :, quants.Q6K_BLOCK:].any(), "padding bytes must be zero"
    host = expand_q6k_dense(padded, od, id)
    assert host.dtype == np.int8 and host.shape == (od, id)
    want = np.array(scalar_mirror(raw.tobytes(), od, id), dtype=np.int8).reshape(od, id)
    mismatches = int(np.count_nonzero(host != want))
    assert mismatches == 0, f"expand_q6k_dense vs mirror ({od}x{id}): {mismatches} mismatches"
    # flat input is the same plane
    assert np.array_equal(expand_q6k_dense(padded.reshape(-1), od, id), host)


@pytest.mark.parametrize("od,id", [(64, 256), (40, 512), (24, 768)])
def test_w_exp_byte_exact_random(od, id):
    rng = np.random.default_rng(od * 1000 + id)
    raw = random_rows(rng, QT.Q6_K, od, id // 256)
    check_w_exp(raw, od, id)


@pytest.mark.model
def test_w_exp_byte_exact_real_tensor(real_gguf):
    t = real_gguf.tensors["blk.0.ffn_down.weight"]
    assert QT(t.qtype) == QT.Q6_K
    od_full, id = t.shape                                           # (n_out, n_in)
    raw = real_gguf.raw(t.name)
    assert raw.shape == (od_full, id // 256 * quants.Q6K_BLOCK)
    rows = np.ascontiguousarray(raw[[0, 1, 777, raw.shape[0] - 1]])  # a few rows incl. the last
    check_w_exp(rows, rows.shape[0], id)


@pytest.mark.parametrize("od,id", [(9, 256), (5, 1280)])
def test_w_exp_times_scales_is_gguf_dequant(od, id):
    # second, independent relation: W_exp * d * scale[e // 16] == gguf's dequantization
    rng = np.random.default_rng(od + id)
    raw = random_rows(rng, QT.Q6_K, od, id // 256)
    w_exp = expand_q6k_dense(pad_q6k(raw), od, id).reshape(-1, 16, 16)
    blocks = raw.reshape(-1, 210)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)            # (nb, 1)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)                     # (nb, 16)
    got = ((d * sc)[:, :, None] * w_exp.astype(np.float32)).reshape(od, id)
    want = np.asarray(gguf.quants.dequantize(raw, QT.Q6_K), np.float32).reshape(od, id)
    assert np.array_equal(bits(got), bits(want))
    assert w_exp.min() >= -32 and w_exp.max() <= 31
