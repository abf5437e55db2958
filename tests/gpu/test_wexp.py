"""The W_exp plane (seed/000 §4): byte-exact three ways, keyed by the padded
pointer, geometry-encoded names, the opt-out and the forced miss.

Three-way reconciliation: an independent scalar mirror (plain Python loops written
from ggml's dequantize_row_q6_K description) vs the host expander
quants.expand_q6k_dense vs the DEVICE plane read back after QuantState.register.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from minfer import quants
from minfer.gguf import TensorInfo

pytestmark = pytest.mark.gpu

SHAPES = ((64, 256), (40, 512), (24, 768))     # (od, id): several super-blocks and rows


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


@pytest.fixture()
def cq(monkeypatch):
    from minfer.backend import cuda_quant
    for k in ("MINFER_MMQ_Q6K_EXP", "MINFER_TEST_FORCE_EXP_MISS", "MINFER_MMQ_RAW_NB_DEBUG"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(cuda_quant, "_exp_miss_warned", False)
    return cuda_quant


def _raw_q6k(od: int, id_: int, seed: int = 0) -> np.ndarray:
    """Random q6_K rows from irregular Gaussian data (row scales, outliers)."""
    rng = np.random.default_rng([zlib.crc32(f"{od},{id_},{seed}".encode()), 53])
    w = rng.standard_normal((od, id_)).astype(np.float32)
    w *= rng.uniform(0.003, 0.08, (od, 1)).astype(np.float32)
    w[rng.random((od, id_)) < 0.01] *= 7.0
    return quants.quantize(w, QT.Q6_K)


def _info(name: str, od: int, id_: int) -> TensorInfo:
    rb = quants.row_bytes(QT.Q6_K, id_)
    return TensorInfo(name=name, qtype=QT.Q6_K, shape=(od, id_), offset=0, nbytes=od * rb,
                      n_elements=od * id_, row_bytes=rb, n_rows=od)


def _mirror(raw: np.ndarray, od: int, id_: int) -> np.ndarray:
    """Scalar mirror from the format: per super-block (ql[128], qh[64] of the 210-byte
    raw block), two halves of 128; for l in 0..31 of a half:
      y[l]    = (ql[l]    & 15) | ((qh[l] >> 0) & 3) << 4
      y[l+32] = (ql[l+32] & 15) | ((qh[l] >> 2) & 3) << 4
      y[l+64] = (ql[l]    >> 4) | ((qh[l] >> 4) & 3) << 4
      y[l+96] = (ql[l+32] >> 4) | ((qh[l] >> 6) & 3) << 4,   each minus 32."""
    nb = id_ // 256
    out = np.zeros((od, id_), np.int8)
    for j in range(od):
        row = raw[j].tolist()
        for sb in range(nb):
            blk = row[sb * 210:(sb + 1) * 210]
            for half in range(2):
                ql, qh = blk[64 * half:64 * half + 64], blk[128 + 32 * half:128 + 32 * half + 32]
                base = sb * 256 + 128 * half
                for l in range(32):
                    vals = ((ql[l] & 15) | ((qh[l] >> 0) & 3) << 4,
                            (ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4,
                            (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4,
                            (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4)
                    for k, v in enumerate(vals):
                        out[j, base + 32 * k + l] = v - 32
    return out


@pytest.mark.parametrize("od,id_", SHAPES)
def test_wexp_byte_exact_three_ways(cp, cq, od, id_):
    raw = _raw_q6k(od, id_)
    want = _mirror(raw, od, id_)
    host = quants.expand_q6k_dense(quants.pad_q6k(raw), od, id_)
    assert host.dtype == np.int8 and host.shape == (od, id_)
    assert int((host != want).sum()) == 0, f"expand_q6k_dense vs mirror ({od}x{id_})"
    st = cq.QuantState()
    name = "blk.0.ffn_down.weight"
    w = st.register(name, _info(name, od, id_), raw)
    plane = st.planes[f"{name}__exp{od}x{id_}"]
    got = cp.asnumpy(plane)
    assert got.dtype == np.int8 and got.shape == (od, id_)
    assert int((got != want).sum()) == 0, f"device W_exp vs mirror ({od}x{id_})"
    # the weight itself is uploaded padded: 224-byte stride, raw bytes first
    padded = cp.asnumpy(w.data)
    assert padded.shape == (od, id_ // 256 * 224)
    assert np.array_equal(padded.reshape(od, -1, 224)[:, :, :210], raw.reshape(od, -1, 210))
    assert st.plane_bytes == od * id_ == st.plane_sum_odid


def test_map_keyed_by_padded_pointer(cp, cq):
    """Seed pitfall #1: the map key is the padded weight's pointer, not the plane's."""
    st = cq.QuantState()
    name = "blk.5.attn_v.weight"
    w = st.register(name, _info(name, 40, 512), _raw_q6k(40, 512))
    plane = st.planes[f"{name}__exp40x512"]
    assert w.ptr == int(w.data.data.ptr)
    assert list(st.q6k_exp) == [w.ptr]
    assert st.q6k_exp[w.ptr] is plane
    assert int(plane.data.ptr) not in st.q6k_exp


def test_planes_only_for_the_bundle_tensors(cp, cq):
    st = cq.QuantState()
    names = ("blk.0.attn_v.weight", "blk.12.ffn_down.weight", "output.weight",
             "token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight.bias")
    ws = [st.register(n, _info(n, 24, 256), _raw_q6k(24, 256, seed=len(n))) for n in names]
    assert sorted(st.planes) == sorted(f"{n}__exp24x256" for n in
                                       ("blk.0.attn_v.weight", "blk.12.ffn_down.weight",
                                        "output.weight"))
    assert st.memory_report()["W_exp planes"] == 3 * 24 * 256 == st.plane_sum_odid
    assert st.memory_report()["q6_K padded"] == 6 * 24 * 224
    del ws                     # a plane lives as long as its weight
    assert st.planes == {} and st.q6k_exp == {} and st.plane_bytes == 0
    assert st.memory_report()["q6_K padded"] == 0


def test_geometry_encoded_names(cp, cq):
    """Same name, different shape: a new plane under its own name, never the stale one."""
    st = cq.QuantState()
    name = "blk.1.ffn_down.weight"
    raw_a, raw_b = _raw_q6k(64, 256, seed=1), _raw_q6k(32, 512, seed=2)   # same byte count
    wa = st.register(name, _info(name, 64, 256), raw_a)
    wb = st.register(name, _info(name, 32, 512), raw_b)
    assert {f"{name}__exp64x256", f"{name}__exp32x512"} <= set(st.planes)
    assert st.q6k_exp[wb.ptr] is st.planes[f"{name}__exp32x512"]
    assert st.q6k_exp[wa.ptr] is st.planes[f"{name}__exp64x256"]
    assert np.array_equal(cp.asnumpy(st.q6k_exp[wb.ptr]), _mirror(raw_b, 32, 512))


def test_opt_out_registers_no_plane(cp, cq, monkeypatch):
    monkeypatch.setenv("MINFER_MMQ_Q6K_EXP", "0")
    st = cq.QuantState()
    name = "output.weight"
    w = st.register(name, _info(name, 40, 512), _raw_q6k(40, 512))
    assert st.planes == {} and st.q6k_exp == {}
    assert st.plane_bytes == 0 and st.plane_sum_odid == 0
    assert st.memory_report()["W_exp planes"] == 0
    x = cp.asarray(np.random.default_rng(9).standard_normal((5, 512)).astype(np.float32))
    st.linear(x, w)
    c = st.counters()
    assert c["q6k exp=off"] == 1 and c["q6k exp"] == 0 and c["q6k fallback!"] == 0


def test_forced_miss_counts_fallback_and_warns_once(cp, cq, monkeypatch, capsys):
    monkeypatch.setenv("MINFER_TEST_FORCE_EXP_MISS", "1")
    st = cq.QuantState()
    ws = [st.register(n, _info(n, 24, 768), _raw_q6k(24, 768, seed=i))
          for i, n in enumerate(("blk.0.attn_v.weight", "blk.0.ffn_down.weight"))]
    assert st.planes == {} and st.q6k_exp == {} and st.plane_bytes == 0
    x = cp.asarray(np.random.default_rng(10).standard_normal((9, 768)).astype(np.float32))
    for w in ws:
        y = st.linear(x, w)
        assert bool(cp.isfinite(y).all())
    c = st.counters()
    assert c["q6k fallback!"] == 2 and c["q6k exp"] == 0 and c["q6k exp=off"] == 0
    assert capsys.readouterr().err.count("WARNING: W_exp plane registration failed") == 1
