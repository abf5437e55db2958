"""The CUDA backend's pure decisions: which path each matrix product takes, and which
gate/up + SwiGLU kernel a prompt's FFN runs. Same arguments, same answer; no
device work, no state. Every other file asks these functions, none decides again.

Each rule says why in one line and names the script that re-measures it
(docs/DESIGN.md section 5 has the table with the figures behind it).

    f32 weight                 -> cupy matmul in f32                     counter f32_gemm
    a decode step of 2 <= B <= settings.decode_mma_rows sequences, q4_K / q6_K weights
                               -> x to q8_1, then tensor-core products   q4k_mvt / q6k_mvt
                                  of few rows (mmq_rows)
    T == 1 (decode), or a decode step of B <= settings.decode_matvec_rows sequences
                               -> x to q8_1, then the matvec of B rows   q4k_mv / q6k_mv ...
    a longer decode step, with settings.decode_mmq (off: measured slower)
                               -> int8 MMQ on q8_1 activations           q4k_mmq / q6k_mmq
    q4_K / q6_K, and T < f16_min_t or a table (the LM head over many positions)
                               -> int8 MMQ on q8_1 activations           q4k_mmq / q6k_mmq
    otherwise                  -> the f16 engine: W dequantized into an   q4k_f16 / q6k_f16 /
                                  f16 scratch (q6_K: from its W_exp plane  q4_0_f16 ...
                                  when it has one), one cuBLAS GEMM, f32
                                  accumulation; with settings.f16_weights
                                  the f16 copy kept since load instead

In the deterministic mode (settings.deterministic) the rule is what the row is:
decode rows and the LM head the matvec (of B rows), prompt rows the f16 engine at
every count (_deterministic_path).

A q6_K product on the f16 or MMQ engine also names where its B operand comes from
(GemmPath.b_source, the W_exp bundle's liveness labels): `q6k exp` (the plane: the
fast path), `q6k exp=off` (planes deliberately off), `q6k fallback!` (a plane was
expected and is missing), `q6k raw` (a q6_K tensor the bundle does not cover),
`q6k f16 kept` (the f16 copy of settings.f16_weights).
"""
from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as QT

from ...errors import MinferError
from .kernels import gateup_sm90
from .kernels.mmq import MMQ_TYPES
from .kernels.mmq_rows import MR_TYPES
from .settings import CudaSettings
from .weights import GpuWeight

# the counter prefix of each weight type the CUDA backend multiplies
PREFIX = {QT.Q4_K: "q4k", QT.Q6_K: "q6k", QT.Q4_0: "q4_0", QT.Q4_1: "q4_1", QT.Q5_0: "q5_0",
          QT.Q5_1: "q5_1", QT.Q8_0: "q8_0", QT.Q5_K: "q5k"}
B_SOURCES = ("q6k exp", "q6k exp=off", "q6k fallback!", "q6k raw", "q6k f16 kept")
# every path label gemm_path can give, for the counters' table
PATH_LABELS = (tuple(f"{p}_{e}" for t, p in PREFIX.items()
                     for e in ("mmq",) * (t in MMQ_TYPES) + ("f16", "mv") + ("mvt",) * (t in MR_TYPES))
               + ("f32_gemm",) + B_SOURCES)


@dataclass(frozen=True)
class GemmPath:
    engine: str                 # "f32", "matvec", "mvt" (mmq_rows), "f16" or "mmq"
    counter: str                # the path's label: prefix_engine
    b_source: str | None        # q6_K on f16/mmq: one of B_SOURCES

    @property
    def reads_plane(self) -> bool:
        return self.b_source == "q6k exp"

    @property
    def q8_rows(self) -> bool:
        """Does the product take x as q8_1 rows and no GEMM (a decode row's engines)?"""
        return self.engine in ("matvec", "mvt")

    @property
    def labels(self) -> tuple[str, ...]:
        return (self.counter,) if self.b_source is None else (self.counter, self.b_source)


def gemm_path(T: int, w: GpuWeight, settings: CudaSettings, has_plane: bool,
              has_f16: bool = False, decode_rows: bool = False, prompt_rows: bool = False) -> GemmPath:
    """The path of x (T, n_in) @ w^T, from the token count, the weight (type, table or
    not, covered by the W_exp bundle or not), the settings, whether a plane is
    registered for it, whether an f16 copy is kept, and whether the rows are a
    decode step's (one row per sequence) or prompts' (a Batch of prefill rows)."""
    if w.qtype == QT.F32:
        return GemmPath("f32", "f32_gemm", None)
    if w.qtype not in PREFIX:
        raise MinferError(f"linear {w.name}: {w.qtype.name} weights are not supported by "
                          f"the CUDA backend ({', '.join(t.name for t in PREFIX)}, F32)")
    prefix = PREFIX[w.qtype]
    if settings.deterministic:
        return _deterministic_path(T, w, prefix, settings, has_plane, has_f16, decode_rows, prompt_rows)
    # a decode step of a few sequences: tensor-core products that read each weight
    # once per 32 rows, a row's sums one sequence whatever B; measured faster than
    # the dp4a matvec of B rows from a few rows on, slower at one (settings.py)
    if decode_rows and 2 <= T <= settings.decode_mma_rows and w.qtype in MR_TYPES:
        return GemmPath("mvt", f"{prefix}_mvt", None)
    # one row: the matvec streams the weight once at the copy bandwidth, no GEMM wins;
    # a decode step's B rows: the same kernel reads each weight once per 8 rows, and
    # gives each row the bits it has alone (the step's output does not depend on B)
    if T == 1 or (decode_rows and T <= settings.decode_matvec_rows):
        return GemmPath("matvec", f"{prefix}_mv", None)
    # short prompts and the LM head over many positions (a table): the int8 MMQ reads
    # the blocks as stored, where a dequantization would cost more than the GEMM saves
    # (settings.F16_GEMM_MIN_T; scripts/bench/gemm_paths.py re-measures it)
    # a decode step of more sequences than the matvec takes: the MMQ reads each weight
    # once for all rows, where the f16 engine dequantizes every weight for those rows.
    # Off by default: on the 7B the MMQ at 8 rows measured 1.44x slower a step than
    # the f16 engine (interleaved, separated; 1.17x at 32, not separated).
    # scripts/bench/ab.py --batch B --a decode_mmq=1 --b decode_mmq=0 re-measures it.
    mmq = w.qtype in MMQ_TYPES and (T < settings.f16_min_t or w.table
                                    or (decode_rows and settings.decode_mmq and not has_f16))
    return _gemm(w, prefix, "mmq" if mmq else "f16", settings, has_plane, has_f16)


def _deterministic_path(T: int, w: GpuWeight, prefix: str, settings: CudaSettings, has_plane: bool,
                        has_f16: bool, decode_rows: bool, prompt_rows: bool) -> GemmPath:
    """The deterministic mode: a row's engine follows from what the row is, never from
    how many rows share the forward. Decode rows (a step's, or the one row of a plain
    forward, which is a decode step's) and the LM head take the matvec, whose rows of
    B give each row its one-row bits; prompt rows take the f16 engine at every count,
    one row included (its GEMMs take no split-K, so a row's sums should not depend
    on the others: tests/gpu/test_deterministic.py is the check)."""
    if w.table or decode_rows or (T == 1 and not prompt_rows):
        return GemmPath("matvec", f"{prefix}_mv", None)
    return _gemm(w, prefix, "f16", settings, has_plane, has_f16)


def _gemm(w: GpuWeight, prefix: str, engine: str, settings: CudaSettings, has_plane: bool,
          has_f16: bool) -> GemmPath:
    """A GEMM engine's path, with the B source of a q6_K weight."""
    source = None
    if w.qtype == QT.Q6_K:
        if engine == "f16" and has_f16:
            source = "q6k f16 kept"
        elif not w.plane_tensor:
            source = "q6k raw"
        elif not settings.use_planes:
            source = "q6k exp=off"
        else:
            source = "q6k exp" if has_plane else "q6k fallback!"
    return GemmPath(engine, f"{prefix}_{engine}", source)


# Which gate/up + SwiGLU kernel a prompt's FFN runs, by its length: inclusive token
# ranges (hi None: no end) -> "q4k" (gateup_swiglu_q4k: reads the q4_K blocks and
# converts them in registers) or "f16" (gateup_swiglu_f16: reads them dequantized to
# f16, and dequantizes the next layer's pair meanwhile). Lengths outside every range
# run the chain (dequantization, cuBLAS, swiglu_f16): the same bits each way.
# Re-measured on the 7B twin by scripts/bench/ab.py (--a gateup_fused=1 --b
# gateup_fused=0 at each length; the H200's figures are in docs/DESIGN.md section 5).
GATEUP_KERNELS = (
    # the q4_K kernel's blocks take 256 tokens and convert their weight rows once a
    # block, so its cost steps with ceil(T / 256): it wins where the last block row
    # is nearly full and there are few rows (+8-12% at 192-256 tokens, level at 128)
    ((128, 256), "q4k"),
    # the same step rule: +2-5% at 448-512 tokens, -9% at 384 (a half-empty row)
    ((448, 512), "q4k"),
    # from ~1k tokens on the next pair's dequantization hides under the products
    # (+3-8% from 1,280 to 3,325; level at 1,024, where it is a large share)
    ((1024, None), "f16"),
)


def gateup_kernel(T: int, gate: GpuWeight, up: GpuWeight, settings: CudaSettings, has_f16: bool,
                  cc: tuple[int, int]) -> str | None:
    """The gate/up + SwiGLU kernel of the f16-engine FFN of T tokens ("q4k", "f16"), or
    None for the chain: None when the kernels are turned off, outside GATEUP_KERNELS,
    with kept f16 copies (nothing to dequantize), or for weights or a GPU the kernels
    do not fit."""
    if not (settings.gateup_fused and not has_f16 and gate.n_out == up.n_out and gate.n_in == up.n_in
            and gateup_sm90.fits((gate.qtype, up.qtype), gate.n_out, gate.n_in, cc)):
        return None
    return next((kind for (lo, hi), kind in GATEUP_KERNELS if lo <= T and (hi is None or T <= hi)), None)
