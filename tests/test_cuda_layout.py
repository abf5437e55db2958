"""The CUDA backend's host-side decisions, without a GPU: the settings read from the
environment, the GEMM path table, the W_exp plane inventory of the 7B header
(the sum of od x id over its tensor table, checked against the allocated planes),
the f16 GEMMs' preload grid and operand alignment (cublas.py), and what the
dependent launches rely on: every kernel waits first, and the driver structs'
layout (dependent.py)."""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from minfer.backend.cuda import cublas, dependent
from minfer.backend.cuda.paths import GATEUP_KERNELS, gateup_kernel, gemm_path
from minfer.backend.cuda.settings import F16_GEMM_MIN_T, CudaSettings
from minfer.backend.cuda.weights import GpuWeight, expected_plane_bytes, is_plane_tensor, plane_check

# od x id of the 7B's plane tensors: 28 layers alternate q6_K attn_v / ffn_down with
# q4_K ones (14 each), plus the q6_K output head (the header's tensor table)
PLANES_7B = 14 * 512 * 3584 + 14 * 3584 * 18944 + 152064 * 3584


def test_settings_from_env():
    """The environment sets the user's four switches and nothing else: the A/B and
    test fields keep their defaults whatever the environment says."""
    assert CudaSettings.from_env({}) == CudaSettings()
    s = CudaSettings.from_env({"MINFER_MMQ_Q6K_EXP": "0", "MINFER_CUDA_GRAPHS": "0",
                               "MINFER_PRINT_LAUNCH_COUNTS": "1", "MINFER_F16_WEIGHTS": "1",
                               "MINFER_FFN_F16": "0", "MINFER_TEST_FORCE_EXP_MISS": "1",
                               "MINFER_PDL": "0", "MINFER_FLASH_WGMMA": "0", "MINFER_GATEUP_FUSED": "0"})
    assert (s.exp_planes, s.graphs, s.print_launch_counts, s.f16_weights) == (False, False, True, True)
    assert s.replace(exp_planes=True, graphs=True, print_launch_counts=False, f16_weights=False) == CudaSettings()
    assert CudaSettings().dependent_launches and CudaSettings().flash_wgmma and CudaSettings().gateup_fused
    assert not CudaSettings().f16_weights
    assert not s.use_planes and CudaSettings().use_planes
    assert not CudaSettings().replace(exp_enabled=False).use_planes
    hash(s)                                   # frozen: usable as a CUDA-graph cache key
    with pytest.raises(Exception):
        s.graphs = True


def test_settings_replace_checks_names_and_types():
    from minfer.errors import MinferError
    assert CudaSettings().replace(f16_min_t=7, gateup_fused=False).f16_min_t == 7
    with pytest.raises(MinferError, match="unknown CUDA setting 'gate_up'"):
        CudaSettings().replace(gate_up=False)
    with pytest.raises(MinferError, match="expected bool"):
        CudaSettings().replace(graphs=0)
    with pytest.raises(MinferError, match="expected int"):
        CudaSettings().replace(f16_min_t=True)


def _w(name, qtype, n_out=512, n_in=3584):
    """A weight record (no device data: gemm_path reads only type, name and shape)."""
    return GpuWeight(name, qtype, n_out, n_in, data=None,
                     plane_tensor=is_plane_tensor(name, qtype, (n_out, n_in)))


@pytest.mark.parametrize("T,name,qtype,has_plane,settings,want", [
    (1, "blk.0.attn_q.weight", QT.Q4_K, False, {}, ("matvec", "q4k_mv", None)),
    (1, "blk.0.attn_v.weight", QT.Q6_K, True, {}, ("matvec", "q6k_mv", None)),
    (F16_GEMM_MIN_T, "blk.0.attn_q.weight", QT.Q4_K, False, {}, ("f16", "q4k_f16", None)),
    (512, "blk.0.attn_v.weight", QT.Q6_K, True, {}, ("f16", "q6k_f16", "q6k exp")),
    (512, "blk.0.attn_v.weight", QT.Q6_K, False, {}, ("f16", "q6k_f16", "q6k fallback!")),
    (512, "blk.0.attn_v.weight", QT.Q6_K, True, {"exp_enabled": False}, ("f16", "q6k_f16", "q6k exp=off")),
    (512, "blk.0.attn_v.weight", QT.Q6_K, False, {"exp_planes": False}, ("f16", "q6k_f16", "q6k exp=off")),
    (512, "blk.0.attn_q.weight", QT.Q6_K, False, {}, ("f16", "q6k_f16", "q6k raw")),
    (512, "output.weight", QT.Q6_K, True, {}, ("mmq", "q6k_mmq", "q6k exp")),        # a table
    (512, "blk.0.ffn_up.weight", QT.Q4_K, False, {"f16_min_t": 1 << 30}, ("mmq", "q4k_mmq", None)),
    (7, "blk.0.attn_q_norm.weight", QT.F32, False, {}, ("f32", "f32_gemm", None)),
    # the types the MMQ lacks: the f16 engine from T = 2, pinned or not, tables too
    (2, "blk.0.ffn_up.weight", QT.Q4_1, False, {"f16_min_t": 1 << 30}, ("f16", "q4_1_f16", None)),
    (512, "output.weight", QT.Q8_0, False, {}, ("f16", "q8_0_f16", None)),
    (1, "output.weight", QT.Q8_0, False, {}, ("matvec", "q8_0_mv", None)),
    (9, "blk.0.ffn_down.weight", QT.Q5_K, False, {}, ("f16", "q5k_f16", None)),
])
def test_gemm_path_table(T, name, qtype, has_plane, settings, want):
    p = gemm_path(T, _w(name, qtype), CudaSettings(**settings), has_plane)
    assert (p.engine, p.counter, p.b_source) == want
    assert p.reads_plane == (want[2] == "q6k exp")


def test_gemm_path_in_the_deterministic_mode():
    """What a row is decides its engine, never how many rows there are: decode rows
    (a step's, or a plain forward's one row) and the LM head the matvec at every
    count, prompt rows the f16 engine at every count, one included."""
    s = CudaSettings(deterministic=True)
    q4, q6 = _w("blk.0.ffn_up.weight", QT.Q4_K), _w("blk.0.ffn_down.weight", QT.Q6_K)
    head, q5 = _w("output.weight", QT.Q6_K), _w("blk.0.ffn_up.weight", QT.Q5_K)
    for T in (1, 2, 8, 16, 33, 200):
        for w, p in ((q4, "q4k"), (q5, "q5k"), (q6, "q6k")):
            assert gemm_path(T, w, s, True, decode_rows=True).counter == f"{p}_mv"
            assert gemm_path(T, w, s, True, prompt_rows=True).counter == f"{p}_f16"
        assert gemm_path(T, head, s, True, decode_rows=True).counter == "q6k_mv"
        assert gemm_path(T, head, s, True, prompt_rows=True).counter == "q6k_mv"
        assert gemm_path(T, head, s, True).counter == "q6k_mv"
    assert gemm_path(1, q4, s, False).counter == "q4k_mv"                   # a plain decode step
    assert gemm_path(3, q4, s, False).counter == "q4k_f16"                  # a plain prompt
    assert gemm_path(1, q6, s, True, prompt_rows=True).labels == ("q6k_f16", "q6k exp")


def test_gemm_path_of_a_decode_step_of_several_sequences():
    """A decode step of 2 to decode_mma_rows sequences takes mmq_rows for q4_K / q6_K;
    one sequence, and other types up to decode_matvec_rows, the matvec of B rows; a
    longer step the f16 engine, or the int8 MMQ with decode_mmq (types the MMQ lacks
    stay on the f16 engine); a prompt of B rows the f16 engine."""
    s = CudaSettings()
    q4, q6 = _w("blk.0.ffn_up.weight", QT.Q4_K), _w("blk.0.ffn_down.weight", QT.Q6_K)
    q5 = _w("blk.0.ffn_up.weight", QT.Q5_K)
    n, m = s.decode_matvec_rows, s.decode_mma_rows
    assert n >= 8 and m >= 8
    for T in (2, 8, m):
        assert gemm_path(T, q4, s, False, decode_rows=True).counter == "q4k_mvt"
        assert gemm_path(T, q6, s, True, decode_rows=True).labels == ("q6k_mvt",)
    assert gemm_path(1, q4, s, False).counter == "q4k_mv"
    assert gemm_path(1, q4, s, False, decode_rows=True).counter == "q4k_mv"
    assert gemm_path(8, q5, s, False, decode_rows=True).counter == "q5k_mv"
    assert gemm_path(n + 1, q5, s, False, decode_rows=True).counter == "q5k_f16"
    assert gemm_path(8, q4, s, False).counter == "q4k_f16"                     # a prompt
    assert gemm_path(m + 1, q4, s, False, decode_rows=True).counter == "q4k_f16"
    mv = s.replace(decode_mma_rows=0)
    assert gemm_path(8, q4, mv, False, decode_rows=True).counter == "q4k_mv"
    assert gemm_path(n + 1, q4, mv, False, decode_rows=True).counter == "q4k_f16"
    mmq = mv.replace(decode_mmq=True)
    assert gemm_path(n + 1, q4, mmq, False, decode_rows=True).counter == "q4k_mmq"
    assert gemm_path(n + 1, q5, mmq, False, decode_rows=True).counter == "q5k_f16"
    assert gemm_path(8, q4, mmq.replace(decode_matvec_rows=0), False, decode_rows=True).counter == "q4k_mmq"
    assert all(gemm_path(8, w, s, False, decode_rows=True).q8_rows for w in (q4, q5))


@pytest.mark.parametrize("T,qtypes,d_ff,n_in,settings,has_f16,cc,want", [
    (256, (QT.Q4_K, QT.Q4_K), 18944, 3584, {}, False, (9, 0), "q4k"),          # the 7B
    (512, (QT.Q4_K, QT.Q4_K), 18944, 3584, {}, False, (9, 0), "q4k"),
    (384, (QT.Q4_K, QT.Q4_K), 18944, 3584, {}, False, (9, 0), None),
    (513, (QT.Q4_K, QT.Q4_K), 18944, 3584, {}, False, (9, 0), None),
    (1024, (QT.Q4_K, QT.Q4_K), 18944, 3584, {}, False, (9, 0), "f16"),
    (3325, (QT.Q4_K, QT.Q4_K), 18944, 3584, {}, False, (9, 0), "f16"),
    (200, (QT.Q4_K, QT.Q4_K), 8960, 1536, {}, False, (9, 0), "q4k"),           # the 1.5B
    (2, (QT.Q4_K, QT.Q4_K), 18944, 3584, {}, False, (9, 0), None),
    (200, (QT.Q4_K, QT.Q4_K), 18944, 3584, {"gateup_fused": False}, False, (9, 0), None),
    (3325, (QT.Q4_K, QT.Q4_K), 18944, 3584, {"gateup_fused": False}, False, (9, 0), None),
    (200, (QT.Q4_K, QT.Q4_K), 18944, 3584, {}, True, (9, 0), None),             # f16 copies kept
    (3325, (QT.Q4_K, QT.Q4_K), 18944, 3584, {}, True, (9, 0), None),
    (200, (QT.Q4_K, QT.Q4_K), 18944, 3584, {}, False, (8, 9), None),            # no sm_90a
    (3325, (QT.Q4_K, QT.Q4_K), 18944, 3584, {}, False, (10, 0), None),
    (200, (QT.Q4_K, QT.Q6_K), 18944, 3584, {}, False, (9, 0), None),
    (3325, (QT.Q4_K, QT.Q4_K), 18944 + 32, 3584, {}, False, (9, 0), None),      # not 64 features a block
    (200, (QT.Q4_1, QT.Q4_1), 18944, 3584, {}, False, (9, 0), None),
])
def test_gateup_kernel_decision(T, qtypes, d_ff, n_in, settings, has_f16, cc, want):
    gate = GpuWeight("blk.0.ffn_gate.weight", qtypes[0], d_ff, n_in, data=None)
    up = GpuWeight("blk.0.ffn_up.weight", qtypes[1], d_ff, n_in, data=None)
    assert gateup_kernel(T, gate, up, CudaSettings(**settings), has_f16, cc) == want


@pytest.mark.parametrize("T,d_ff,n_sm,want", [
    (512, 18944, 132, (528, 656)),      # the 7B: 592 tiles, a last wave of 64 -> 128 half tiles
    (256, 18944, 132, (264, 328)),      # 296 tiles, 32 -> 64
    (3325, 18944, 132, (3828, 3868)),   # 3,848 tiles, 20 -> 40
    (700, 4480, 132, (210, 210)),       # 210 tiles: a last wave of 78, more than half
    (512, 64 * 132, 132, (264, 264)),   # whole waves
    (100, 320, 132, (0, 10)),           # 5 tiles, all halved
    (200, 8960, 114, (114, 166)),       # 140 tiles on 114 SMs: 26 -> 52
])
def test_gateup_tiling(T, d_ff, n_sm, want):
    from minfer.backend.cuda.kernels.gateup_sm90 import tiling
    assert tiling(T, d_ff, n_sm) == want


def test_gateup_kernels_take_exactly_their_lengths():
    """GATEUP_KERNELS's ranges in order and apart; each kind from a range's first length
    to its last, none just outside, on the 7B's shapes."""
    gate, up = (GpuWeight(f"blk.0.ffn_{n}.weight", QT.Q4_K, 18944, 3584, data=None) for n in ("gate", "up"))
    ends = [(lo, hi) for (lo, hi), _ in GATEUP_KERNELS]
    assert all(hi is not None and hi < lo2 for (lo, hi), (lo2, _) in zip(ends, ends[1:]))
    assert {kind for _, kind in GATEUP_KERNELS} <= {"q4k", "f16"}
    for (lo, hi), kind in GATEUP_KERNELS:
        inside = (lo, lo + 1, 4 * lo) if hi is None else (lo, (lo + hi) // 2, hi)
        for T in inside:
            assert gateup_kernel(T, gate, up, CudaSettings(), False, (9, 0)) == kind, T
        for T in (lo - 1,) + (() if hi is None else (hi + 1,)):
            assert gateup_kernel(T, gate, up, CudaSettings(), False, (9, 0)) != kind, T


def test_gemm_path_rejects_unsupported_types():
    from minfer.errors import MinferError
    with pytest.raises(MinferError, match="not supported"):
        gemm_path(4, _w("blk.0.attn_q.weight", QT.Q2_K), CudaSettings(), False)


def test_plane_inventory_of_the_7b_header(header_7b):
    from minfer.format.gguf import open_gguf
    tensors = open_gguf(str(header_7b), header_only=True).tensors
    assert expected_plane_bytes(tensors, CudaSettings()) == PLANES_7B == 1_521_221_632
    assert expected_plane_bytes(tensors, CudaSettings(exp_planes=False)) == 0
    covered = [n for n, t in tensors.items() if is_plane_tensor(n, t.qtype, t.shape)]
    assert len(covered) == 29 and "output.weight" in covered


def test_plane_check_fails_when_a_plane_is_missing(header_7b):
    """Planes standing in for the 7B's (host arrays of the same shapes): all of them
    pass the check, one fewer fails it, naming both byte counts."""
    from minfer.format.gguf import open_gguf
    tensors = open_gguf(str(header_7b), header_only=True).tensors
    shapes = {n: tuple(t.shape) for n, t in tensors.items() if is_plane_tensor(n, t.qtype, t.shape)}
    planes = {f"{n}__exp{od}x{id_}": np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), (od, id_), (0, 0))
              for n, (od, id_) in shapes.items()}
    expected = expected_plane_bytes(tensors, CudaSettings())
    assert plane_check(expected, planes) is None
    dropped = planes.pop(next(iter(planes)))
    problem = plane_check(expected, planes)
    assert problem is not None
    assert f"{expected - dropped.nbytes:,}" in problem and f"{expected:,}" in problem


def test_gemm_path_of_a_kept_f16_weight():
    """With an f16 copy kept (MINFER_F16_WEIGHTS=1) a q6_K prompt GEMM counts `q6k f16
    kept`, whatever its plane; a decode row and the MMQ paths are unchanged."""
    s = CudaSettings(f16_weights=True)
    w = GpuWeight("blk.0.ffn_down.weight", QT.Q6_K, 3584, 18944, None, plane_tensor=True)
    p = gemm_path(512, w, s, has_plane=True, has_f16=True)
    assert (p.engine, p.counter, p.b_source, p.reads_plane) == ("f16", "q6k_f16", "q6k f16 kept", False)
    assert gemm_path(512, w, s, has_plane=True, has_f16=False).b_source == "q6k exp"
    assert gemm_path(1, w, s, has_plane=True, has_f16=True).engine == "matvec"
    head = GpuWeight("output.weight", QT.Q6_K, 152064, 3584, None, plane_tensor=True)
    assert gemm_path(512, head, s, has_plane=True, has_f16=False).b_source == "q6k exp"   # MMQ


def test_rows_per_warp():
    """2 rows a warp only for split q6_K launches (the measured win), 4 otherwise."""
    from minfer.backend.cuda.kernels.matvec import rows_per_warp
    assert rows_per_warp(QT.Q6_K, QT.Q6_K, 4) == 2
    assert rows_per_warp(QT.Q6_K, QT.Q6_K, 1) == 4                 # the LM head
    assert rows_per_warp(QT.Q4_K, QT.Q6_K, 4) == 4                 # q/k/v with a q6_K attn_v
    assert rows_per_warp(QT.Q4_K, QT.Q4_K, 4) == rows_per_warp(QT.Q5_0, QT.Q5_0, 4) == 4


def test_gemm_preload_grid_and_alignment():
    """The lengths whose first-choice kernels a GEMM shape preloads: the small powers of
    two, then every 64 up to 4,096 (a prompt's first use then finds its neighbours'
    kernels loaded); the alignment the heuristic is told is what every operand has."""
    grid = cublas.preload_grid()
    assert grid[:6] == [2, 4, 8, 16, 32, 64] and grid[-1] == 4096
    assert all(b - a == 64 for a, b in zip(grid[5:], grid[6:])) and len(grid) == 5 + 64
    assert cublas._alignment(0x10000, 0x20000) == 256
    assert cublas._alignment(0x10000, 0x10080) == 128
    assert cublas._alignment(0x10000 + 48, 0x20000) == 16


KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def test_every_kernel_waits_for_its_predecessor_first():
    """A kernel launched as a programmatic dependent (dependent.py) runs alongside
    its predecessor until GRID_DEPENDENCY(): in every kernel definition of
    kernels/*.cu it comes first, after nothing but L2 prefetches of weights (calls
    of *_prefetch_l2 functions, which read and write no memory). The one exception
    is the form of the f16 dequantization (dequant_f16.cu): a kernel with an
    `int early` parameter may wait `if (!early)` first, and then waits `if (early)`
    as its last statement (the launch sets early only where dependent.early())."""
    found = early = 0
    for path in sorted(KERNELS.glob("*.cu")):
        src = path.read_text()
        for m in re.finditer(r"__global__", src):
            line = src[src.rfind("\n", 0, m.start()) + 1:m.start()]
            if line.strip().startswith("template"):          # an explicit instantiation
                continue
            brace = src.index("{", m.end())
            body = src[brace + 1:]
            before = re.sub(r"//[^\n]*", "", body[:body.index("GRID_DEPENDENCY();")])
            if before.strip() == "if (!early)":
                assert "int early)" in src[m.end():brace], f"{path.name}: `early` is not a parameter"
                end = body.index("\n}")
                assert re.sub(r"\s+", " ", body[:end]).rstrip().endswith("if (early) GRID_DEPENDENCY();"), \
                    f"{path.name}: a kernel that may start early does not wait last"
                early += 1
                before = ""
            stmts = [t.strip() for t in before.split(";") if t.strip()]
            assert all(re.fullmatch(r"\w*prefetch_l2\s*(<[^>]*>)?\s*\(.*\)", t, re.S) for t in stmts), \
                f"{path.name}: a kernel does {stmts} before GRID_DEPENDENCY()"
            assert body.index("GRID_DEPENDENCY();") < body.index("}"), f"{path.name}: no wait in a kernel"
            found += 1
    assert found >= 30 and early == 1


def test_early_start_only_right_after_a_kernel_of_ours():
    """dependent.early(): a kernel may start before its wait only while dependent
    launches are on and the last launch was neither a library's (cuBLAS may release
    its dependents before its own wait) nor one of ours that uses the weight scratch
    (the f16 gate/up kernel: its blocks may still read it); a dependent launch of ours
    clears both."""
    from minfer.backend.cuda import dependent
    st = dependent.STATE
    saved = (st.on, st.after_library, st.after_scratch)
    try:
        st.on, st.after_library, st.after_scratch = False, False, False
        assert not dependent.early()                     # ordinary launches: never
        st.on = True
        assert dependent.early()
        dependent.library_launch()
        assert not dependent.early()
        st.after_library = False
        dependent.scratch_launch()
        assert not dependent.early()
    finally:
        st.on, st.after_library, st.after_scratch = saved


def test_driver_struct_layout():
    """CUlaunchAttribute and CUlaunchConfig as cuda.h lays them out (x86-64)."""
    A, C = dependent._LaunchAttribute, dependent._LaunchConfig
    assert ctypes.sizeof(A) == 72 and A.value.offset == 8
    assert ctypes.sizeof(C) == 56 and C.hStream.offset == 32 and C.attrs.offset == 40 \
        and C.numAttrs.offset == 48


def test_dependent_argument_packing():
    """Arguments packed as CuPy packs them: a NumPy scalar's bytes, Python ints as
    int64 and floats as float64 (no cupy array here: that is a pointer)."""
    raw = lambda h: bytes(memoryview(h).cast("B"))                     # noqa: E731
    assert raw(dependent._arg(np.int32(-3), None)) == np.int32(-3).tobytes()
    assert raw(dependent._arg(np.float32(0.5), None)) == np.float32(0.5).tobytes()
    assert raw(dependent._arg(np.uint64(0), None)) == bytes(8)
    assert dependent._arg(7, None).value == 7 and isinstance(dependent._arg(7, None), ctypes.c_int64)
    assert isinstance(dependent._arg(1.5, None), ctypes.c_double)
    with pytest.raises(TypeError):
        dependent._arg("x", None)


def test_decode_short_limit_and_its_shared_memory():
    """A decode step attends in one launch below DEC_SHORT_KEYS positions (its splits
    as sub-blocks of one block); the shared memory that launch asks for is the
    kernel's layout (per split: its warps' maxima, sums and accumulators, and its
    partial) and fits the H200's 227 KB a block."""
    from minfer.backend.cuda.kernels import decode_attn
    from minfer.backend.cuda.nvrtc import K
    assert decode_attn.DEC_SHORT_KEYS == K["DEC_SHORT_SPLITS"] * K["DEC_CHUNK"] == 256
    assert decode_attn.decode_short(0) and decode_attn.decode_short(255)
    assert not decode_attn.decode_short(256) and not decode_attn.decode_short(9000)
    S, W, G, hd = K["DEC_SHORT_SPLITS"], K["DEC_WARPS"], K["DEC_MAX_G"], K["FA_HD"]
    floats = S * W * G * hd + S * W * G * 2 + S * G * (hd + 2)       # s_acc, s_ml, s_part
    assert decode_attn._DEC_SHORT_SMEM == 4 * floats <= 227 * 1024
    assert W * 32 == hd                                               # a sub-block's thread per dim


def test_launcher_counts_by_kernel_name_and_replays_add_the_capture():
    """The launcher counts every launch under its kernel's name; a backend's counters
    report launches since its reset beside its path labels (zeros included); a
    capture's counts are taken back and a replay adds them again (graphs.py)."""
    from minfer.backend.cuda import dependent
    from minfer.backend.cuda.counters import LABELS, Counters
    from minfer.backend.cuda.launch import LAUNCHES, Kernel
    calls = []
    k = Kernel(lambda grid, block, args, shared_mem=0: calls.append(grid), "probe_kernel<3>")
    assert not dependent.STATE.on                 # outside a capture: the ordinary launch
    c = Counters()
    assert c.counts == dict.fromkeys(LABELS, 0)
    before = c.counts
    k((1,), (32,), ())
    k((2,), (32,), ())
    c.label("q6k exp")
    assert calls == [(1,), (2,)] and c.counts["probe_kernel<3>"] == 2 and c.counts["q6k exp"] == 1
    delta = c.since(before)
    assert delta == {"probe_kernel<3>": 2, "q6k exp": 1}
    c.add(delta, -1)                              # a capture launched nothing
    assert c.counts == before and "probe_kernel<3>" not in c.counts
    c.add(delta)                                  # a replay of it
    c.add(delta)
    assert c.counts["probe_kernel<3>"] == 4 and c.counts["q6k exp"] == 2
    other = Counters()                            # another backend's baseline: from now on
    assert "probe_kernel<3>" not in other.counts
    c.reset()
    assert c.counts == dict.fromkeys(LABELS, 0) and LAUNCHES["probe_kernel<3>"] >= 4


def test_parts_read_one_settings_object():
    """The parts a CUDA backend composes (parts.py) are built without a device, and
    every one reads the one settings object: replacing it is what they all see."""
    from minfer.backend.cuda.parts import Parts
    p = Parts(CudaSettings(), eps=1e-6)
    readers = (p.store.settings, p.lin._settings, p.ffn._settings, p.get)
    assert all(r() is p.settings for r in readers)
    p.settings = p.settings.replace(gateup_fused=False)
    assert all(r() is p.settings and not r().gateup_fused for r in readers)
    assert p.lin.counters is p.ffn.counters is p.counters and p.lin.state is p.ffn.state is p.state
