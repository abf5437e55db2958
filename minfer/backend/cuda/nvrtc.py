"""Compiling kernels/*.cu with NVRTC through cupy.RawModule, once per process.

Every constant that both the kernels and their Python wrappers depend on (block
formats, tile sizes, threads per block) is defined once, in KERNEL_CONSTANTS,
and reaches every compilation as a -D define; the .cu files refuse to compile
without them (kernels/common.cuh), so the two sides cannot drift apart. Only
launch.py calls this module; nothing else touches RawModule objects. Importing
it needs no cupy (scripts/check/sass_check.py reads the defines for nvcc).
"""
from __future__ import annotations

import functools
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

from ...errors import MinferError
from ...kv.blocks import BLOCK_TOKENS
from ...package_data import package_data_dir

KERNEL_CONSTANTS: dict[str, int] = {
    # block formats (ggml-common.h), from gguf's table
    "QK_K": GGML_QUANT_SIZES[QT.Q4_K][0],              # 256 elements per k-quant super-block
    "QK8_1": 32,                                       # q8_1 activation block
    "Q4K_BYTES": GGML_QUANT_SIZES[QT.Q4_K][1],         # 144
    "Q6K_BYTES": GGML_QUANT_SIZES[QT.Q6_K][1],         # 210
    "Q6K_PADDED": 224,                                 # registered q6_K stride: 16-byte aligned
    "Q8_0_BYTES": GGML_QUANT_SIZES[QT.Q8_0][1],        # 34
    # one-dimensional kernels (element-wise, casts, dequantization, q8_1 quantization)
    "THREADS_1D": 256,
    # f16 dequantization (dequant_f16.cu): up to DQ_SEGMENTS weights a launch, each of
    # one type: q4_K as stored, q6_K padded, q6_K through its W_exp plane
    "DQ_SEGMENTS": 3,
    "DQ_Q4K": 0,
    "DQ_Q6K": 1,
    "DQ_Q6K_EXP": 2,
    # int8 MMQ GEMMs (mmq.cu): an MMQ_BM tokens x MMQ_BN rows output tile per CTA,
    # K walked in tiles of MMQ_KDR 32-element chunks through MMQ_NST smem stages
    "MMQ_BM": 64,
    "MMQ_BN": 64,
    "MMQ_KDR": 2,
    "MMQ_NST": 3,
    "MMQ_THREADS": 256,
    # matvec (matvec.cu): up to MV_RPW output rows per warp (sharing the loads of x),
    # MV_WARPS warps per block, at least MV_MIN_BLOCKS blocks resident per SM
    "MV_RPW": 4,
    "MV_WARPS": 4,
    "MV_MIN_BLOCKS": 6,
    # ... and for several rows of x (a decode step of B sequences: R*NB accumulators)
    "MV_MIN_BLOCKS_NB": 3,
    # tensor-core products of few rows (mmq_rows.cu): MR_WARPS warps a block split K
    # over its 8 or 16 weight rows
    "MR_WARPS": 8,
    # bytes of its weight rows a decode matvec block pulls into L2 before it waits for
    # its predecessor (a dependent launch: the copy overlaps the predecessor's tail)
    "MV_PREFETCH": 2048,
    # rmsnorm (norm.cu): one block per row; a decode step's norms are one row, whose
    # time is the latency of the per-thread loops: 1024 threads make them short
    "NORM_THREADS": 1024,
    # rmsnorm_f16 (a prompt's rows, the f16 GEMMs' operand): a quarter of the threads,
    # each standing in for NORM_THREADS / NORM_F16_THREADS of the others' layout
    "NORM_F16_THREADS": 256,
    # f32 attention (attention.cu): ATT_BQ query rows per block, keys in tiles of ATT_BK
    "ATT_BQ": 16,
    "ATT_BK": 32,
    "ATT_WARPS": 4,
    # f16 flash attention (flash_attn.cu): head dim; FA_BQ flattened (token, query
    # head) rows of one KV head per block, FA_WARPS warps of 32 rows, keys in tiles
    # of FA_BK; FA_SMEM bytes of dynamic shared memory: Q and two stages of K and V,
    # (FA_BQ + 4 * FA_BK) rows of FA_HD + 8 halves
    "FA_HD": 128,
    "FA_BQ": 128,
    "FA_BK": 64,
    "FA_WARPS": 4,
    "FA_SMEM": (128 + 4 * 64) * (128 + 8) * 2,
    # the Hopper flash attention (flash_attn_sm90.cu, wgmma): the same FA_BQ rows and
    # FA_BK keys, FA90_WG warpgroups of 64 rows; FA90_SMEM bytes: Q and two stages
    # of K and V in 128-byte swizzled rows (FA_HD halves = 256 bytes each), and 1 KB
    # to align them to the swizzle's 1024-byte atoms
    "FA90_WG": 2,
    "FA90_SMEM": (128 + 4 * 64) * 128 * 2 + 1024,
    # gate/up + SwiGLU from q4_K in one Hopper kernel (gateup_sm90.cu): a block takes
    # GU_FEATURES features of both weights and GU_TOKENS tokens (one wgmma m64n256
    # chain a consumer warpgroup), k-tiles of 64 through GU_STAGES stages of X (256 x
    # 128 bytes) + headers (128 x 16) + nibbles (128 x 32); GU_SMEM adds two 8-byte
    # mbarriers a stage and 1 KB to align the ring to the swizzle's 1024-byte atoms
    "GU_THREADS": 384,                                 # two consumer warpgroups + the producer's
    "GU_TOKENS": 256,
    "GU_FEATURES": 64,
    "GU_STAGES": 5,
    "GU_SMEM": 5 * (256 * 128 + 128 * 16 + 128 * 32) + 16 * 5 + 1024,
    # its f16-weight form (gateup_swiglu_f16, persistent): GU16_STAGES stages of X (256 x
    # 128 bytes) + gate's and up's f16 rows (2 x 64 x 128), an epilogue buffer of two
    # f16 tiles (2 x 256 x 64 x 2), two buffers of GU16_AHEAD_SB q4_K super-blocks of
    # the next layer's gate/up (144 bytes each), two mbarriers a stage and four more
    "GU16_STAGES": 3,
    "GU16_AHEAD_SB": 56,
    "GU16_SMEM": 3 * (256 * 128 + 2 * 64 * 128) + 2 * 256 * 64 * 2 + 2 * 56 * 144 + 8 * (2 * 3 + 4) + 1024,
    # one-query (decode) attention (decode_attn.cu): the keys split into chunks of
    # DEC_CHUNK per KV head, DEC_WARPS warps per chunk (DEC_WARPS * 32 == FA_HD), up
    # to DEC_MAX_G query heads per KV head
    "DEC_CHUNK": 64,
    "DEC_WARPS": 4,
    "DEC_MAX_G": 8,
    # positions below DEC_SHORT_SPLITS * DEC_CHUNK attend in one launch
    # (attn_decode_short: the splits as sub-blocks of one block per KV head)
    "DEC_SHORT_SPLITS": 4,
    # positions per block of a paged KV cache (minfer/kv/blocks.py, which owns the
    # number): a multiple of FA_BK and DEC_CHUNK, so no key tile or split straddles blocks
    "KV_BLOCK": BLOCK_TOKENS,
    # greedy selection (argmax.cu): one block
    "ARGMAX_THREADS": 1024,
}
K = KERNEL_CONSTANTS

NVRTC_OPTIONS = ("-std=c++17",)
# Files that use instructions of one GPU only, and the target they compile for:
# wgmma exists on compute capability 9.0 alone, through its "a" target
ARCH_SPECIFIC = {"flash_attn_sm90.cu": ("sm_90a", (9, 0)), "gateup_sm90.cu": ("sm_90a", (9, 0))}


def define_flags() -> tuple[str, ...]:
    """-DNAME=VALUE for every kernel constant (NVRTC and nvcc take the same flags)."""
    return ("-DMINFER_CONSTANTS=1",) + tuple(f"-D{k}={v}" for k, v in KERNEL_CONSTANTS.items())


@functools.lru_cache(maxsize=1)
def kernel_dir() -> Path:
    """Where the .cu sources are: the installed package `minfer.kernels`, else the
    repository checkout (minfer.package_data)."""
    d = package_data_dir("minfer.kernels", "*.cu")
    if d is None:
        raise MinferError("CUDA kernel sources (kernels/*.cu) not found; reinstall minfer")
    return d


@functools.lru_cache(maxsize=None)
def module(filename: str, name_expressions: tuple[str, ...] = ()):
    """Compile kernels/<filename> (NVRTC, for the current device) -> cupy.RawModule.

    name_expressions: C++ template instantiations to export, e.g.
    ("mmq_q6k_bt<2, true>",). Cached per (file, instantiations), so each compiles
    once per process (and cupy's on-disk cache makes later processes fast).
    """
    import cupy

    opts = NVRTC_OPTIONS + (f"-I{kernel_dir()}",) + define_flags()
    if filename in ARCH_SPECIFIC:
        opts += (f"-arch={ARCH_SPECIFIC[filename][0]}",)
    return cupy.RawModule(code=(kernel_dir() / filename).read_text(), options=opts,
                          name_expressions=name_expressions or None)
