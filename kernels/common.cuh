// Included by every kernel file: the check that the kernel constants were given,
// fixed-width types, the block layouts, f16 decode, the 6-bit k-quant scale
// unpack, the cp.async wrappers and the int8 mma.
//
// No system headers: NVRTC (through CuPy) and nvcc must both compile this as is.
#pragma once

// Block formats, tile sizes and threads per block (QK_K, Q4K_BYTES, Q6K_PADDED,
// THREADS_1D, MMQ_*, MV_*, NORM_THREADS, ATT_*, FA_*, DEC_*, KV_BLOCK, ARGMAX_THREADS) are defined once, in
// minfer/backend/cuda/nvrtc.py (KERNEL_CONSTANTS), and arrive as -D defines, so
// the kernels and their Python wrappers cannot disagree.
#ifndef MINFER_CONSTANTS
#error "compile through minfer.backend.cuda.nvrtc, or pass its define_flags() to nvcc"
#endif

// Every kernel's first statement. A kernel launched as a programmatic dependent of
// the one before it (cuLaunchKernelEx with programmatic stream serialization; the
// captured graphs, minfer/backend/cuda/dependent.py) is scheduled while its
// predecessor still runs; here it waits until the predecessor has finished and
// its writes are visible, and then lets its own dependent be scheduled. Nothing
// but L2 prefetches of weights (block_prefetch_l2) runs before the wait, so each
// kernel sees memory exactly as in plain stream order (tests/test_cuda_layout.py
// reads every kernel for this). Launched the ordinary way, both return at once.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define GRID_DEPENDENCY() \
    asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define GRID_DEPENDENCY() do { } while (0)
#endif

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;

// The cache row of position p of one sequence. A paged cache (minfer/kv/) gives a
// sequence a block table tab: position p sits in block tab[p / KV_BLOCK], at row
// p % KV_BLOCK of it; a contiguous cache (tab null) holds position p at row p.
// KV_BLOCK is a multiple of the prefill flash attention's key tile and of the decode
// attention's split, so a tile or a split never straddles two blocks: its keys are
// consecutive rows from kv_row of its first key.
__device__ __forceinline__ long long kv_row(const int* __restrict__ tab, int p) {
    return tab ? (long long)tab[p / KV_BLOCK] * KV_BLOCK + p % KV_BLOCK : (long long)p;
}

// [p, p + bytes) pulled into L2, one bulk request issued by the block's thread 0.
// The one thing a kernel may do before its GRID_DEPENDENCY() (on memory no kernel in
// flight writes: weights, or KV rows of earlier positions; decode_attn.cu's
// decode_rows_prefetch_l2 issues one per thread): launched dependently, the block is resident
// while its predecessor finishes, and the copy from DRAM overlaps that. A prefetch
// changes no value anywhere. Outside a dependent launch it only starts the loads early.
__device__ __forceinline__ void block_prefetch_l2(const void* p, unsigned long long bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (threadIdx.x == 0 && threadIdx.y == 0 && bytes) {
        const unsigned long long a = (unsigned long long)p & ~15ull;
        const unsigned long long e = ((unsigned long long)p + bytes + 15) & ~15ull;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"((unsigned)(e - a))
                     : "memory");
    }
#endif
}

// ---- block layouts (ggml-common.h): byte offsets inside a block ------------
// block_q4_K (Q4K_BYTES): d (f16) | dmin (f16) | scales[12] | qs[128]
#define Q4K_QS 16                // byte offset of qs in the block
// block_q6_K (Q6K_BYTES, registered at a Q6K_PADDED stride so that every
// super-block starts 16-byte aligned): ql[128] | qh[64] | scales int8[16] | d (f16)
#define Q6K_QH 128
#define Q6K_SC 192
#define Q6K_D 208
// block_q8_0 (Q8_0_BYTES): d (f16) | qs int8[32]

// f16 bits -> f32 (exact conversion; avoids cuda_fp16.h, which NVRTC may not find)
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float load_f16(const u8* p) {
    return f16_to_f32((u16)(p[0] | (p[1] << 8)));
}

// byte k (0..3) of a 32-bit word
__device__ __forceinline__ u32 byte_of(u32 w, int k) { return (w >> (8 * k)) & 0xFF; }

// ggml get_scale_min_k4 on the 12 packed scale bytes of a q4_K block held in
// registers as words s0 = bytes 0..3, s1 = 4..7, s2 = 8..11: sub-block j (0..7) ->
// 6-bit (sc, m). The kernels that have the block's header in registers use this one;
// q4k_scale_min below is the same on the bytes in memory.
__device__ __forceinline__ void q4k_scale_min_words(u32 s0, u32 s1, u32 s2, int j, int& sc, int& m) {
    if (j < 4) {
        sc = byte_of(s0, j) & 63;
        m = byte_of(s1, j) & 63;
    } else {
        sc = (byte_of(s2, j - 4) & 0xF) | ((byte_of(s0, j - 4) >> 6) << 4);
        m = (byte_of(s2, j - 4) >> 4) | ((byte_of(s1, j - 4) >> 6) << 4);
    }
}

// ggml get_scale_min_k4: packed scales[12] of q4_K, sub-block j (0..7) -> 6-bit (sc, m)
__device__ __forceinline__ void q4k_scale_min(int j, const u8* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// ---- cp.async: these three wrappers are the whole PTX surface of the copies ----
// 16 bytes global -> shared, L2 only (.cg). full=false: src-size 0, the 16 bytes
// are zero-filled and nothing is read (rows past the end of a tile).
__device__ __forceinline__ void cp16(void* smem_dst, const void* gsrc, bool full) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(smem_dst);
    const int sz = full ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(gsrc), "r"(sz)
                 : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_wait1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }
__device__ __forceinline__ void cp_wait0() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// ---- int8 tensor-core mma --------------------------------------------------
// D (16x8 s32) = A (16x16 s8, row) * B (16x8 s8, col) + C. Fragments per lane
// (g = lane/4, t = lane%4), PTX ISA "mma.m16n8k16 .s8":
//   a[0] = A[g][4t..4t+3], a[1] = A[g+8][4t..4t+3]   (4 int8 packed per u32)
//   b    = B[4t..4t+3][g]  (= W row g, k 4t..4t+3: W rows are B's columns)
//   c[0..1] = C[g][2t, 2t+1], c[2..3] = C[g+8][2t, 2t+1]
__device__ __forceinline__ void mma_s8_16816(int c[4], const u32 a[2], u32 b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 "
        "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(b));
}

// ---- warp reductions and the q8_1 activation block ---------------------------
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One q8_1 block of 32 activations, lane i holding value v (ggml-cuda quantize_q8_1,
// except that the sum is s = d * sum(q) of the quantized values):
//   d = amax/127, q = roundf(v/d) (half away from zero; 0 when amax == 0)
// -> q[lane] = q, and lane 0 writes *d, *s. Every q8_1 producer (quantize.cu, the
// fused rmsnorm and SwiGLU) goes through this, so they agree bit for bit.
__device__ __forceinline__ void q8_1_block(float v, int lane, i8* __restrict__ q,
                                           float* __restrict__ d, float* __restrict__ s) {
    float amax = fabsf(v);
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float db = amax / 127.0f;
    const int qi = amax == 0.0f ? 0 : (int)roundf(v / db);
    int sum = qi;
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    q[lane] = (i8)qi;
    if (lane == 0) {
        *d = db;
        *s = db * (float)sum;
    }
}

// ---- SwiGLU ----------------------------------------------------------------------
// silu(g) * u = g / (1 + exp(-g)) * u (ggml_vec_swiglu_f32): every SwiGLU kernel
// (f32, to q8_1, f16, and the fused gate/up kernel's epilogue in gateup_sm90.cu)
// inlines this one expression, so the same inputs give the same bits everywhere.
// expf, not __expf: the fast intrinsic's error is visible in parity.
__device__ __forceinline__ float silu_mul(float g, float u) {
    return g / (1.0f + expf(-g)) * u;
}

// ---- RoPE ----------------------------------------------------------------------
// the pair (a, b) rotated by the angle with cosine c and sine s (rope.cu, and the
// fused RoPE + KV-cache store of decode_attn.cu). Every product and sum rounded
// on its own (the _rn intrinsics are never contracted into an FMA): the same bits
// in every kernel that inlines it, and the CPU reference's (NumPy's f32) bits.
__device__ __forceinline__ void rope_rotate(float a, float b, float c, float s, float* ya, float* yb) {
    *ya = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    *yb = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
}

// ---- f16 -----------------------------------------------------------------------
// f32 -> f16 bits, round to nearest even (= numpy's float32 -> float16; cast_f32_f16's
// rounding): a kernel that writes an f16 operand directly gives the bits of an f32
// write and a cast
__device__ __forceinline__ u32 f16_bits_rn(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// two f16 bits -> one u32, lo in the low half (the lower address in memory)
__device__ __forceinline__ u32 f32x2_to_f16x2(float lo, float hi) {
    return f16_bits_rn(lo) | (f16_bits_rn(hi) << 16);
}

// the f16 SwiGLU's step on two packed pairs: gate g and up u (f16 halves, lo first)
// -> the two f16 silu_mul values, packed the same way (swiglu_f16 in dequant_f16.cu
// and the f16 epilogues of gateup_sm90.cu)
__device__ __forceinline__ u32 swiglu_f16x2(u32 g, u32 u) {
    return f32x2_to_f16x2(silu_mul(f16_to_f32((u16)(g & 0xFFFF)), f16_to_f32((u16)(u & 0xFFFF))),
                          silu_mul(f16_to_f32((u16)(g >> 16)), f16_to_f32((u16)(u >> 16))));
}
