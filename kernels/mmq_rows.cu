// Tensor-core products of few rows: y (T, od) = x (T, K) @ W (od, K)^T [+ bias]
// [+ res] for the T <= 32 rows of a decode step of T sequences, x as q8_1 blocks of
// 32 (quantize.cu), W q4_K as stored or q6_K padded (the matvec's formats).
//
// The dp4a matvec (matvec.cu) runs out of integer throughput near 8 rows: every
// weight byte costs each row a dp4a and a conversion. Here the integer dot of a
// 32- (q4_K) or 16-element (q6_K) sub-block runs on mma.sync for 16 rows of x at
// once (the A operand, rows of x padded to 16) against 8 weight rows (the B
// operand), and is rescaled in f32 per sub-block, as the MMQ does (mmq.cu).
//
// Geometry: a block of MR_WARPS warps owns 8*RT weight rows; its warps split K
// (warp w takes super-blocks w, w + MR_WARPS, ...), each over all of the block's
// rows and all T rows of x, and their sums meet in shared memory in warp order.
// Fragments are loaded straight from global memory (no staging): within a
// sub-block any order of k gives the same integer sum, so lane t takes the 8
// contiguous bytes 8t..8t+7 (q4_K; k slots 4t..4t+3 and 16+4t..16+4t+3) or the 4
// bytes 4t..4t+3 (q6_K) of the weight row and of x alike.
//
// Bits: the sum of output (x row i, weight row j) is the same sequence of f32
// operations whatever T, MT or RT (the fragment place of row i and j changes, the
// arithmetic does not), so a decode row's output does not depend on how many
// sequences share its step, nor on which launch of 32 it falls in.
#include "common.cuh"

#define QT_Q4K 12
#define QT_Q6K 14

// D (16x8 s32) = A (16x32 s8, row) * B (32x8 s8, col) + C (PTX ISA "mma.m16n8k32
// .s8"): a[0] = A[g][4t..], a[1] = A[g+8][4t..], a[2] = A[g][16+4t..],
// a[3] = A[g+8][16+4t..]; b[0] = B[4t..][g], b[1] = B[16+4t..][g]; c as 16816's.
__device__ __forceinline__ void mma_s8_16832(int c[4], const u32 a[4], const u32 b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <int QT>
__device__ __forceinline__ size_t mr_row_bytes(int K) {
    return QT == QT_Q4K ? (size_t)(K / QK_K) * Q4K_BYTES : (size_t)(K / QK_K) * Q6K_PADDED;
}

// q6_K: the 6-bit values u (0..63) of 4 elements, as the signed int8 u - 32
__device__ __forceinline__ u32 q6_centered(u32 ql, u32 qh, int q) {
    const u32 u = ((ql >> (4 * (q / 2))) & 0x0F0F0F0Fu) | (((qh >> (2 * q)) & 0x03030303u) << 4);
    const u32 v = u ^ 0x20202020u;                 // u - 32 as a 6-bit two's complement
    return v | ((v & 0x20202020u) * 6u);           // sign-extended to 8 bits (0x20 * 6 = 0xC0)
}

// One warp's share of the block's tile: rows wrow[r] (this lane's B row of n-tile
// r), C rows crow[r][e] = n-tile r's rows 2t+e; x rows xa[m][h] (A rows g, g+8 of
// m-tile m) -> acc[m][r][0..3] = (x row 16m+g, W row 2t), (16m+g, 2t+1),
// (16m+g+8, 2t), (16m+g+8, 2t+1) of n-tile r.
template <int QT, int MT, int RT>
__device__ __forceinline__ void mr_tile(const u8* const (&wrow)[RT], const u8* const (&crow)[RT][2],
                                        const i8* const (&xa)[MT][2], const float* const (&da)[MT][2],
                                        const float* const (&sa)[MT][2], int K, int warp, int t,
                                        float (&acc)[MT][RT][4]) {
    const int nsb = K / QK_K;
    for (int sb = warp; sb < nsb; sb += MR_WARPS) {
        if constexpr (QT == QT_Q4K) {
            uint2 qs[RT][4];                       // chunk i (sub-blocks 2i, 2i+1): bytes 8t..8t+7
            uint4 hd[RT][2];                       // d, dmin, scales of the C rows
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                const u8* b = wrow[r] + (size_t)sb * Q4K_BYTES + Q4K_QS + 8 * t;
#pragma unroll
                for (int i = 0; i < 4; ++i) qs[r][i] = __ldg((const uint2*)(b + 32 * i));
#pragma unroll
                for (int e = 0; e < 2; ++e) hd[r][e] = __ldg((const uint4*)(crow[r][e] + (size_t)sb * Q4K_BYTES));
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {          // sub-block j: nibbles (j%2) of chunk j/2
                u32 a[MT][4];
                float dx[MT][2], sx[MT][2];
#pragma unroll
                for (int m = 0; m < MT; ++m) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const uint2 v = *(const uint2*)(xa[m][h] + sb * QK_K + 32 * j + 8 * t);
                        a[m][h] = v.x;
                        a[m][2 + h] = v.y;
                        dx[m][h] = da[m][h][sb * 8 + j];
                        sx[m][h] = sa[m][h][sb * 8 + j];
                    }
                }
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    const int sh = 4 * (j % 2);
                    const u32 b[2] = {(qs[r][j / 2].x >> sh) & 0x0F0F0F0Fu, (qs[r][j / 2].y >> sh) & 0x0F0F0F0Fu};
                    float dw[2], mw[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        int sc, mn;
                        q4k_scale_min_words(hd[r][e].y, hd[r][e].z, hd[r][e].w, j, sc, mn);
                        dw[e] = f16_to_f32((u16)(hd[r][e].x & 0xFFFF)) * (float)sc;
                        mw[e] = f16_to_f32((u16)(hd[r][e].x >> 16)) * (float)mn;
                    }
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        int c[4] = {0, 0, 0, 0};
                        mma_s8_16832(c, a[m], b);
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            acc[m][r][e] += (dx[m][e / 2] * dw[e % 2]) * (float)c[e] - mw[e % 2] * sx[m][e / 2];
                    }
                }
            }
        } else {
            u32 ql[RT][2][2][2];                   // [r][half][quarter % 2][l0 / 16]: bytes 4t..4t+3
            u32 qh[RT][2][2];                      // [r][half][l0 / 16]
            uint4 sc[RT][2];                       // the 16 int8 scales of the C rows
            float d[RT][2];
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                const u8* b = wrow[r] + (size_t)sb * Q6K_PADDED + 4 * t;
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int l = 0; l < 2; ++l) {
#pragma unroll
                        for (int qq = 0; qq < 2; ++qq) ql[r][h][qq][l] = __ldg((const u32*)(b + 64 * h + 32 * qq + 16 * l));
                        qh[r][h][l] = __ldg((const u32*)(b + Q6K_QH + 32 * h + 16 * l));
                    }
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const u8* blk = crow[r][e] + (size_t)sb * Q6K_PADDED;
                    sc[r][e] = __ldg((const uint4*)(blk + Q6K_SC));
                    d[r][e] = f16_to_f32(__ldg((const u16*)(blk + Q6K_D)));
                }
            }
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int q = 0; q < 4; ++q) {      // elements 128h + 32q + (0..31): x block 4h + q
                    float dx[MT][2];
#pragma unroll
                    for (int m = 0; m < MT; ++m)
#pragma unroll
                        for (int hh = 0; hh < 2; ++hh) dx[m][hh] = da[m][hh][sb * 8 + 4 * h + q];
#pragma unroll
                    for (int l = 0; l < 2; ++l) {  // the 16-element group 8h + 2q + l
                        const int grp = 8 * h + 2 * q + l;
                        u32 a[MT][2];
#pragma unroll
                        for (int m = 0; m < MT; ++m)
#pragma unroll
                            for (int hh = 0; hh < 2; ++hh)
                                a[m][hh] = *(const u32*)(xa[m][hh] + sb * QK_K + 128 * h + 32 * q + 16 * l + 4 * t);
#pragma unroll
                        for (int r = 0; r < RT; ++r) {
                            const u32 b = q6_centered(ql[r][h][q % 2][l], qh[r][h][l], q);
                            float dw[2];
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                const u32 w = grp < 8 ? (grp < 4 ? sc[r][e].x : sc[r][e].y)
                                                      : (grp < 12 ? sc[r][e].z : sc[r][e].w);
                                dw[e] = d[r][e] * (float)(i8)byte_of(w, grp % 4);
                            }
#pragma unroll
                            for (int m = 0; m < MT; ++m) {
                                int c[4] = {0, 0, 0, 0};
                                mma_s8_16816(c, a[m], b);
#pragma unroll
                                for (int e = 0; e < 4; ++e)
                                    acc[m][r][e] += (dx[m][e / 2] * dw[e % 2]) * (float)c[e];
                            }
                        }
                    }
                }
        }
    }
}

// x q8_1 (T, K) with T <= 16*MT; W (od, K) in QT's device layout; y (T, od) =
// x @ W^T [+ bias (od,)] [+ res (T, od), added last: the residual stream; y may
// alias it]. grid = ceil(od / (8*RT)) blocks of MR_WARPS warps. (RT = 4 took 255
// registers and spilled at MT = 2.)
template <int QT, int MT, int RT>
__global__ void __launch_bounds__(MR_WARPS * 32)
mmq_rows(const i8* __restrict__ xq, const float* __restrict__ xd, const float* __restrict__ xs, int T, int K,
         const u8* __restrict__ W, const float* __restrict__ bias, const float* res, float* y, int od) {
    GRID_DEPENDENCY();
    __shared__ float s_part[MR_WARPS - 1][MT][RT][4][32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int row0 = blockIdx.x * 8 * RT;
    const size_t rb = mr_row_bytes<QT>(K);
    const u8* wrow[RT];
    const u8* crow[RT][2];
#pragma unroll
    for (int r = 0; r < RT; ++r) {              // rows past od read the last row (never stored)
        wrow[r] = W + (size_t)min(row0 + 8 * r + g, od - 1) * rb;
#pragma unroll
        for (int e = 0; e < 2; ++e) crow[r][e] = W + (size_t)min(row0 + 8 * r + 2 * t + e, od - 1) * rb;
    }
    const i8* xa[MT][2];
    const float* da[MT][2];
    const float* sa[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {            // rows of x past T read the last row (never stored)
            const int i = min(16 * m + 8 * h + g, T - 1);
            xa[m][h] = xq + (size_t)i * K;
            da[m][h] = xd + (size_t)i * (K / QK8_1);
            sa[m][h] = xs + (size_t)i * (K / QK8_1);
        }
    float acc[MT][RT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][r][e] = 0.0f;
    mr_tile<QT, MT, RT>(wrow, crow, xa, da, sa, K, warp, t, acc);
    if (warp > 0) {
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int e = 0; e < 4; ++e) s_part[warp - 1][m][r][e][lane] = acc[m][r][e];
    }
    __syncthreads();
    if (warp > 0) return;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = acc[m][r][e];
#pragma unroll
                for (int w = 0; w < MR_WARPS - 1; ++w) v += s_part[w][m][r][e][lane];
                const int i = 16 * m + 8 * (e / 2) + g, j = row0 + 8 * r + 2 * t + e % 2;
                if (i < T && j < od) {
                    const size_t at = (size_t)i * od + j;
                    float o = bias ? v + bias[j] : v;
                    if (res) o = res[at] + o;
                    y[at] = o;
                }
            }
}

#ifdef MINFER_SASS_INSTANTIATE
#define MINFER_MR(QT, MT, RT)                                                                  \
    template __global__ void mmq_rows<QT, MT, RT>(const i8*, const float*, const float*, int, int, \
                                                  const u8*, const float*, const float*, float*, int);
MINFER_MR(12, 1, 1) MINFER_MR(12, 2, 1) MINFER_MR(14, 1, 1) MINFER_MR(14, 2, 1)
MINFER_MR(12, 1, 2) MINFER_MR(12, 2, 2) MINFER_MR(14, 1, 2) MINFER_MR(14, 2, 2)
#endif
