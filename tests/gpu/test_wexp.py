"""The W_exp plane: byte-exact three ways, keyed by the padded pointer,
geometry-encoded names, the plane-bytes check against the tensor table, the
opt-out and the forced miss.

Three-way reconciliation: an independent scalar mirror (plain Python loops written
from ggml's dequantize_row_q6_K description) vs the host expander
q6k_layout.expand_q6k_dense vs the DEVICE plane read back after WeightStore.register.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from minfer.format import quants
from minfer.backend.cuda.q6k_layout import expand_q6k_dense, pad_q6k
from minfer.format.gguf import TensorInfo
from minfer.format.quantize import quantize

pytestmark = pytest.mark.gpu

SHAPES = ((64, 256), (40, 512), (24, 768))     # (od, id): several super-blocks and rows


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


def _raw_q6k(od: int, id_: int, seed: int = 0) -> np.ndarray:
    """Random q6_K rows from irregular Gaussian data (row scales, outliers)."""
    rng = np.random.default_rng([zlib.crc32(f"{od},{id_},{seed}".encode()), 53])
    w = rng.standard_normal((od, id_)).astype(np.float32)
    w *= rng.uniform(0.003, 0.08, (od, 1)).astype(np.float32)
    w[rng.random((od, id_)) < 0.01] *= 7.0
    return quantize(w, QT.Q6_K)


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
def test_wexp_byte_exact_three_ways(cp, cuda_linears, od, id_):
    raw = _raw_q6k(od, id_)
    want = _mirror(raw, od, id_)
    host = expand_q6k_dense(pad_q6k(raw), od, id_)
    assert host.dtype == np.int8 and host.shape == (od, id_)
    assert int((host != want).sum()) == 0, f"expand_q6k_dense vs mirror ({od}x{id_})"
    st, _ = cuda_linears()
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
    assert st.plane_bytes == od * id_


def test_map_keyed_by_padded_pointer(cp, cuda_linears):
    """The map key is the padded weight's pointer (what a launch holds), not the plane's."""
    st, _ = cuda_linears()
    name = "blk.5.attn_v.weight"
    w = st.register(name, _info(name, 40, 512), _raw_q6k(40, 512))
    plane = st.planes[f"{name}__exp40x512"]
    assert w.ptr == int(w.data.data.ptr)
    assert list(st.by_ptr) == [w.ptr]
    assert st.by_ptr[w.ptr] is plane and st.plane_of(w) is plane
    assert int(plane.data.ptr) not in st.by_ptr


def test_planes_only_for_the_bundle_tensors(cp, cuda_linears):
    from minfer.backend.cuda.weights import expected_plane_bytes, plane_check
    st, _ = cuda_linears()
    names = ("blk.0.attn_v.weight", "blk.12.ffn_down.weight", "output.weight",
             "token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight.bias")
    table = {n: _info(n, 24, 256) for n in names}
    ws = [st.register(n, table[n], _raw_q6k(24, 256, seed=len(n))) for n in names]
    assert sorted(st.planes) == sorted(f"{n}__exp24x256" for n in
                                       ("blk.0.attn_v.weight", "blk.12.ffn_down.weight",
                                        "output.weight"))
    assert expected_plane_bytes(table, st.settings()) == 3 * 24 * 256 == st.plane_bytes
    assert plane_check(3 * 24 * 256, st.planes) is None
    assert st.bytes["q6_K padded"] == 6 * 24 * 224
    del ws                     # a plane lives as long as its weight
    assert st.planes == {} and st.by_ptr == {} and st.plane_bytes == 0
    assert st.bytes["q6_K padded"] == 0


def test_plane_check_fails_when_a_plane_is_missing(cuda_linears, synth_dir):
    """The backend's memory check sums od x id over the GGUF tensor table: with one
    registered plane dropped it must report the difference."""
    from minfer.engine import Engine
    from minfer.tools.synth import synth_model
    eng = Engine.load(synth_model(synth_dir), backend="cuda", n_ctx=16, progress=False)
    be = eng.backend
    check = be.memory_check(eng.gf.tensors)
    expected = check["W_exp planes expected"]
    assert check["problem"] is None and expected == be.store.plane_bytes > 0
    name, plane = next(iter(be.store.planes.items()))
    del be.store.planes[name]
    problem = be.memory_check(eng.gf.tensors)["problem"]
    assert problem is not None
    assert f"hold {expected - plane.nbytes:,} bytes" in problem and f"needs {expected:,}" in problem


def test_geometry_encoded_names(cp, cuda_linears):
    """Same name, different shape: a new plane under its own name, never the stale one."""
    st, _ = cuda_linears()
    name = "blk.1.ffn_down.weight"
    raw_a, raw_b = _raw_q6k(64, 256, seed=1), _raw_q6k(32, 512, seed=2)   # same byte count
    wa = st.register(name, _info(name, 64, 256), raw_a)
    wb = st.register(name, _info(name, 32, 512), raw_b)
    assert {f"{name}__exp64x256", f"{name}__exp32x512"} <= set(st.planes)
    assert st.plane_of(wb) is st.planes[f"{name}__exp32x512"]
    assert st.plane_of(wa) is st.planes[f"{name}__exp64x256"]
    assert np.array_equal(cp.asnumpy(st.plane_of(wb)), _mirror(raw_b, 32, 512))


def test_opt_out_registers_no_plane(cp, cuda_linears):
    from minfer.backend.cuda.weights import expected_plane_bytes
    st, parts = cuda_linears(exp_planes=False)         # what MINFER_MMQ_Q6K_EXP=0 sets
    name = "output.weight"
    info = _info(name, 40, 512)
    w = st.register(name, info, _raw_q6k(40, 512))
    assert st.planes == {} and st.by_ptr == {} and st.plane_bytes == 0
    assert expected_plane_bytes({name: info}, st.settings()) == 0
    x = cp.asarray(np.random.default_rng(9).standard_normal((5, 512)).astype(np.float32))
    parts.lin.linear(x, w)
    c = parts.counters.counts
    assert c["q6k exp=off"] == 1 and c["q6k exp"] == 0 and c["q6k fallback!"] == 0


def test_forced_miss_counts_fallback_and_warns_once(cp, cuda_linears, capsys):
    st, parts = cuda_linears(force_exp_miss=True)      # every plane registration fails
    ws = [st.register(n, _info(n, 24, 768), _raw_q6k(24, 768, seed=i))
          for i, n in enumerate(("blk.0.attn_v.weight", "blk.0.ffn_down.weight"))]
    assert st.planes == {} and st.by_ptr == {} and st.plane_bytes == 0
    x = cp.asarray(np.random.default_rng(10).standard_normal((9, 768)).astype(np.float32))
    for w in ws:
        y = parts.lin.linear(x, w)
        assert bool(cp.isfinite(y).all())
    c = parts.counters.counts
    assert c["q6k fallback!"] == 2 and c["q6k exp"] == 0 and c["q6k exp=off"] == 0
    assert capsys.readouterr().err.count("WARNING: W_exp plane registration failed") == 1


@pytest.mark.parametrize("plane", ["blk.0.ffn_down.weight", "blk.0.attn_q.weight"])
def test_kept_f16_weights_give_the_dequantized_gemm_bit_for_bit(cp, cuda_linears, plane):
    """MINFER_F16_WEIGHTS=1: the copy made at load (from the W_exp plane where the
    bundle covers the tensor, else from the padded blocks) is what the per-GEMM
    dequantization gives, so every product is the same; the GEMMs count `q6k f16
    kept` and dequantize nothing; the copies are in the memory accounting."""
    od, id_ = 48, 768
    info = _info(plane, od, id_)
    x = cp.asarray(np.random.default_rng(11).standard_normal((6, id_)).astype(np.float32))
    st0, g0 = cuda_linears()
    want = cp.asnumpy(g0.lin.linear(x, st0.register(plane, info, _raw_q6k(od, id_, seed=3))))
    st, parts = cuda_linears(f16_weights=True)
    w = st.register(plane, info, _raw_q6k(od, id_, seed=3))
    assert st.f16_of(w) is not None and st.bytes["f16 weights"] == od * id_ * 2
    got = cp.asnumpy(parts.lin.linear(x, w))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    c = parts.counters.counts
    assert c["q6k f16 kept"] == 1 and c["q6k_f16"] == 1
    assert c["q6k exp"] == c["q6k raw"] == c["q6k fallback!"] == 0
    assert all(w is None for w in parts.state._w16)      # the weight scratch was never needed
    parts.lin.linear(x[:1], w)                          # a decode row still reads the q6_K blocks
    assert parts.counters.counts["q6k_mv"] == 1
    del w
    import gc
    gc.collect()
    assert st.f16 == {} and st.bytes["f16 weights"] == 0
