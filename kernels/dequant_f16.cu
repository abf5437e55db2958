// Whole-weight dequantization to fp16 for the cuBLAS prefill path (backend/cuda/kernels/dequant_f16.py):
// W (n_out, n_in) quantized -> W16 (n_out, n_in) f16, then x16 @ W16^T on tensor
// cores. Each output is the f32 value of the NumPy reference (gguf.quants /
// minfer.format.quants, ggml's dequantize_row_q4_K / _q6_K) rounded to f16 (RNE):
//   q4_K: y = (d*sc) * q - (dmin*m)      q in 0..15,  sc/m 6-bit per 32 elements
//   q6_K: y = (d*sc) * q                 q in -32..31, sc int8 per 16 elements
// Every product and the difference is rounded separately (__fmul_rn/__fsub_rn)
// so the compiler cannot contract them into an FMA: NumPy rounds each step.
//
// Memory-bound: super-blocks of a row are contiguous and rows are contiguous, so
// block b of the flattened weight covers outputs b*256 .. b*256+255 whatever the
// row length. 16-byte stores, 8-byte loads of the quants (both lane-contiguous
// across a warp); indices in 64 bits (the 7B output weight has 545M elements,
// 1.09 GB as f16).
//
// Bytes moved per 256 outputs (read + write): q4_K 144 + 512, q6_K padded 224 + 512
// (only the ql/qh/scale sectors each thread needs), q6_K from W_exp 256 + 32 + 512.

#include "common.cuh"
#include "q4k_f16.cuh"

// Thread layout shared by the three types: one thread per 16 outputs, 16 threads
// per super-block b. Thread c (0..15) writes the 8-element chunks c and c + 16, i.e.
// elements 8c..8c+7 and 128+8c..128+8c+7 of the super-block: in each of its two
// 16-byte stores the lanes of a warp cover 2 x 256 contiguous bytes (full sectors),
// and the two chunks share their scale lookups' structure (below).

// The kernel takes `early`: set by the launch (f16.dequant_f16_many) when it is a
// programmatic dependent of a kernel of ours, which has waited for everything before
// it before letting this one start. Then everything that read the weight scratch
// (the GEMM before) has completed, and this kernel, which reads only the quantized
// weights and writes only the scratch, does its work first and waits after it,
// before it exits: the GEMM after it (an ordinary launch) still follows everything
// before, and the dequantization overlaps the tail of the kernel before it. Not
// early after a library kernel (cuBLAS may release its dependents before it has
// waited for its own predecessors): the usual wait first.

// q4_K: q4k_group_f16 (q4k_f16.cuh), shared with gateup_sm90.cu.

// q6_K element e (0..255) of a super-block (ggml dequantize_row_q6_K):
//   half n = e/128, c4 = (e%128)/32, l = e%32
//   q = (ql[64n + 32*(c4&1) + l] >> 4*(c4>>1)) & 0xF | ((qh[32n + l] >> 2*c4) & 3) << 4
//   value d * scales[e/16] * (q - 32)
// Chunk c (elements 8c..8c+7, half 0): c4 = c/4, l = 8*(c%4) + 0..7, scale c/2.
// Chunk c+16 (half 1): the same with ql + 64, qh + 32, scale 8 + c/2.

// q6_K padded (224 B stride) -> f16, thread i < n_grp
__device__ __forceinline__ void q6k_group_f16(const u8* __restrict__ w, u16* __restrict__ y, long long i) {
    const long long b = i >> 4;
    const int c = (int)(i & 15);
    const int c4 = c >> 2, l0 = 8 * (c & 3);
    const u8* blk = w + b * Q6K_PADDED;                      // 224 = 14*16: aligned
    const int ql_off = 32 * (c4 & 1) + l0;
    const uint2 ql_a = *(const uint2*)(blk + ql_off);        // half 0
    const uint2 ql_b = *(const uint2*)(blk + ql_off + 64);   // half 1
    const uint2 qh_a = *(const uint2*)(blk + Q6K_QH + l0);
    const uint2 qh_b = *(const uint2*)(blk + Q6K_QH + l0 + 32);
    const float d = load_f16(blk + Q6K_D);
    const float ds_a = __fmul_rn(d, (float)(i8)blk[Q6K_SC + (c >> 1)]);
    const float ds_b = __fmul_rn(d, (float)(i8)blk[Q6K_SC + 8 + (c >> 1)]);
    const int sl = 4 * (c4 >> 1), shh = 2 * c4;

    float va[8], vb[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int bit = 8 * (k & 3);
        const int qa = ((((k < 4 ? ql_a.x : ql_a.y) >> (bit + sl)) & 0xF) |
                        ((((k < 4 ? qh_a.x : qh_a.y) >> (bit + shh)) & 3) << 4)) - 32;
        const int qb = ((((k < 4 ? ql_b.x : ql_b.y) >> (bit + sl)) & 0xF) |
                        ((((k < 4 ? qh_b.x : qh_b.y) >> (bit + shh)) & 3) << 4)) - 32;
        va[k] = __fmul_rn(ds_a, (float)qa);
        vb[k] = __fmul_rn(ds_b, (float)qb);
    }
    u16* dst = y + b * QK_K + 8 * c;
    store8_f16(dst, va);
    store8_f16(dst + 128, vb);
}

// q6_K from the W_exp plane (dense centered int8 (ql|qh<<4)-32, row
// stride n_in, super-block stride 256) with d and the scales from the padded
// blocks -> f16. Flattened, plane element b*256 + e is super-block b's element e.
// Thread i < n_grp.
__device__ __forceinline__ void q6k_exp_group_f16(const u8* __restrict__ w, const i8* __restrict__ wexp,
                                                  u16* __restrict__ y, long long i) {
    const long long b = i >> 4;
    const int c = (int)(i & 15);
    const u8* blk = w + b * Q6K_PADDED;
    const i8* pe = wexp + b * QK_K + 8 * c;
    const uint2 pa = *(const uint2*)pe;                      // elements 8c..8c+7
    const uint2 pb = *(const uint2*)(pe + 128);              // elements 128+8c..
    const float d = load_f16(blk + Q6K_D);
    const float ds_a = __fmul_rn(d, (float)(i8)blk[Q6K_SC + (c >> 1)]);
    const float ds_b = __fmul_rn(d, (float)(i8)blk[Q6K_SC + 8 + (c >> 1)]);

    float va[8], vb[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int bit = 8 * (k & 3);
        va[k] = __fmul_rn(ds_a, (float)(i8)(((k < 4 ? pa.x : pa.y) >> bit) & 0xFF));
        vb[k] = __fmul_rn(ds_b, (float)(i8)(((k < 4 ? pb.x : pb.y) >> bit) & 0xFF));
    }
    u16* dst = y + b * QK_K + 8 * c;
    store8_f16(dst, va);
    store8_f16(dst + 128, vb);
}

// Up to DQ_SEGMENTS weights in one launch (a layer's q/k/v or gate/up, dequantized
// side by side into the grouped GEMM's scratch: one launch instead of one a weight).
// Segment s: its type (DQ_Q4K: w as stored; DQ_Q6K: w padded; DQ_Q6K_EXP: w padded
// for d and the scales, e its W_exp plane), y its f16 output, n its thread count
// (n_out*n_in/16), and its blocks from first[s] (first[0] = 0; an absent segment's
// first is the grid's size, which no block reaches). A block lies in one segment, so
// the type is uniform in it.
#define DQ_SEG_ARGS(s) const u8* __restrict__ w##s, const i8* __restrict__ e##s, \
                       u16* __restrict__ y##s, long long n##s, int t##s
static_assert(DQ_SEGMENTS == 3, "the kernel spells out three segments");

extern "C" __global__ void __launch_bounds__(THREADS_1D)
dequant_f16_segments(DQ_SEG_ARGS(0), DQ_SEG_ARGS(1), DQ_SEG_ARGS(2), int first1, int first2,
                     int early) {
    if (!early) GRID_DEPENDENCY();
    const int b = blockIdx.x, s = b >= first2 ? 2 : b >= first1 ? 1 : 0;
    const u8* w = s == 2 ? w2 : s == 1 ? w1 : w0;
    const i8* e = s == 2 ? e2 : s == 1 ? e1 : e0;
    u16* y = s == 2 ? y2 : s == 1 ? y1 : y0;
    const long long n = s == 2 ? n2 : s == 1 ? n1 : n0;
    const int type = s == 2 ? t2 : s == 1 ? t1 : t0;
    const long long i = (long long)(b - (s == 2 ? first2 : s == 1 ? first1 : 0)) * blockDim.x + threadIdx.x;
    if (i < n) {
        if (type == DQ_Q4K) q4k_group_f16(w, y, i);
        else if (type == DQ_Q6K) q6k_group_f16(w, y, i);
        else q6k_exp_group_f16(w, e, y, i);
    }
    if (early) GRID_DEPENDENCY();
}

// x (n,) f32 -> y (n,) f16 bits, RNE; n4 = n/4 (4 elements per thread: 16 B in, 8 B out).
// Activations before the GEMM, and K/V into the f16 cache (y offset by pos0 rows).
extern "C" __global__ void __launch_bounds__(THREADS_1D)
cast_f32_f16(const float4* __restrict__ x, uint2* __restrict__ y, long long n4) {
    GRID_DEPENDENCY();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
         i += (long long)gridDim.x * blockDim.x) {
        const float4 v = x[i];
        y[i] = make_uint2(f32x2_to_f16x2(v.x, v.y), f32x2_to_f16x2(v.z, v.w));
    }
}

// gate, up (rows, cols) f16 -> y (rows, cols) f16 packed = silu(gate) * up, computed
// in f32 as swiglu_f32 (elementwise.cu) and rounded once: the f16 FFN (ffn.py,
// FFN.f16) keeps its (T, d_ff) intermediates in f16, the precision the down
// GEMM reads. gate's and up's rows are ldv vectors apart (the column blocks of one
// GEMM's output over the concatenated gate/up weights: ldv = 2 colsv; packed: ldv =
// colsv). V elements a thread (V = 4: 8-byte loads and stores; V = 8: 16-byte ones,
// which keep more bytes in flight per thread); cols % V == 0; grid x over a row's
// vectors, grid y over the rows (r = blockIdx.y, + gridDim.y, ...), so no thread
// divides to find its row. The same expression for every element whatever V.
template <int V>
struct F16Vec;
template <> struct F16Vec<4> { typedef uint2 T; };
template <> struct F16Vec<8> { typedef uint4 T; };

template <int V>
__device__ __forceinline__ void swiglu_f16_rows(const typename F16Vec<V>::T* __restrict__ gate,
                                                const typename F16Vec<V>::T* __restrict__ up,
                                                typename F16Vec<V>::T* __restrict__ y, int colsv,
                                                long long ldv, int rows) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= colsv) return;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const typename F16Vec<V>::T g = gate[r * ldv + c], u = up[r * ldv + c];
        const u32* gw = (const u32*)&g;
        const u32* uw = (const u32*)&u;
        u32 o[V / 2];
#pragma unroll
        for (int k = 0; k < V / 2; ++k)
            o[k] = swiglu_f16x2(gw[k], uw[k]);
        y[(long long)r * colsv + c] = *(const typename F16Vec<V>::T*)o;
    }
}

extern "C" __global__ void
swiglu_f16(const uint2* __restrict__ gate, const uint2* __restrict__ up,
           uint2* __restrict__ y, int cols4, long long ld4, int rows) {
    GRID_DEPENDENCY();
    swiglu_f16_rows<4>(gate, up, y, cols4, ld4, rows);
}

extern "C" __global__ void
swiglu_f16_x8(const uint4* __restrict__ gate, const uint4* __restrict__ up,
              uint4* __restrict__ y, int cols8, long long ld8, int rows) {
    GRID_DEPENDENCY();
    swiglu_f16_rows<8>(gate, up, y, cols8, ld8, rows);
}

#ifdef MINFER_SASS_INSTANTIATE
// All kernels here are plain extern "C" (no templates): compiling the file
// (nvcc -arch=sm_90 -c -Xptxas -v) already emits SASS for each of them.
#endif
