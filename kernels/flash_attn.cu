// Causal GQA flash attention on tensor cores (f16 inputs, f32 softmax and
// accumulation), head_dim 128, for prefill (FlashAttention-2's forward pass):
//   O[t, h, :] = sum_j softmax_j(Q[t,h,:] . K[j,kvh,:] / sqrt(128)) V[j,kvh,:]
//   over keys j = 0 .. pos0 + t,   kvh = h / (n_head / n_kv)
//
// Block = 64 queries of one head, 4 warps of 16 query rows each; keys in tiles
// of 64 staged in shared memory by cp.async (K and V in separate commit groups,
// so V(j) lands while S = Q K(j)^T is computed, and K(j+1) while P V(j) is).
// Tiles past the block's last query position are never visited (causal skip);
// only tiles that cross the diagonal or the end of the keys are masked.
//
// mma.m16n8k16 f16 fragments per lane (g = lane/4, t = lane%4), PTX ISA:
//   A (16x16, row): a[0] = A[g][2t..2t+1]   a[1] = A[g+8][2t..2t+1]
//                   a[2] = A[g][2t+8..+9]   a[3] = A[g+8][2t+8..+9]
//   B (16x8, col):  b[0] = B[2t..2t+1][g]   b[1] = B[2t+8..2t+9][g]
//   C (16x8 f32):   c[0..1] = C[g][2t, 2t+1]   c[2..3] = C[g+8][2t, 2t+1]
// S = Q K^T: A = Q rows (registers, loaded once), B[k][n] = K[key n][dim k], so
//   b is two consecutive dims of one K row (32-bit shared loads).
// O += P V: A = P straight from the S accumulators (the C layout of two adjacent
//   8-key tiles is the A layout of one 16-key chunk), B[k][n] = V[key k][dim n]
//   via ldmatrix.trans from the row-major V tile.
// Shared rows are padded to 136 halves (272 B): the 8 rows g = 0..7 a fragment
// load touches start 4 banks apart, so neither the K loads nor ldmatrix conflict.

#include "common.cuh"

// FA_HD (head dim), FA_BQ (queries per block), FA_BK (keys per tile) and FA_WARPS
// (16 query rows each) come from nvrtc.py
#define FA_THREADS (32 * FA_WARPS)
#define FA_LD (FA_HD + 8)        // shared row length in halves
#define FA_NEG_INF (-__int_as_float(0x7f800000))

// D (16x8 f32) += A (16x16 f16, row) * B (16x8 f16, col)
__device__ __forceinline__ void mma_f16_16816(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 f16 matrices from shared memory, transposed: lanes 8i..8i+7 give the
// row addresses of matrix i; r[i] of lane (g, t) = {M_i[2t][g], M_i[2t+1][g]}.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], const u16* smem_row) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(smem_row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// f32 pair -> f16x2 (RNE), lo in the low half (= the lower k / column index)
__device__ __forceinline__ u32 fa_pack_f16x2(float lo, float hi) {
    unsigned short l, h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(l) : "f"(lo));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(hi));
    return (u32)l | ((u32)h << 16);
}

// 64 keys k0..k0+63 of one KV head (rows of 128 halves, positions n_kv*128 apart)
// -> tile (64, FA_LD) in shared memory. Keys >= n_keys are zero-filled (src-size 0),
// so masked probabilities (0) never meet garbage (0 * NaN).
__device__ __forceinline__ void fa_load_tile(u16* tile, const u16* __restrict__ base,
                                             long long pos_stride, int k0, int n_keys) {
#pragma unroll
    for (int i = 0; i < FA_BK * FA_HD / 8 / FA_THREADS; ++i) {   // 8 chunks of 16 B
        const int c = threadIdx.x + i * FA_THREADS;
        const int key = c >> 4, ch = c & 15;                     // 16 chunks per key row
        const int p = k0 + key;
        const bool ok = p < n_keys;
        cp16(tile + key * FA_LD + ch * 8, base + (long long)(ok ? p : 0) * pos_stride + ch * 8, ok);
    }
}

// q: (T, n_head, 128) f16; k_cache, v_cache: (n_ctx, n_kv, 128) f16 with
// positions 0 .. pos0+T-1 stored; o: (T, n_head*128) f32.
// scale_log2 = log2(e) / sqrt(128): scores are kept in the log2 domain (exp2f).
// grid = (ceil(T / 64), n_head), block = 128
extern "C" __global__ void __launch_bounds__(FA_THREADS)
flash_attn_f16(const u16* __restrict__ q, const u16* __restrict__ k_cache,
               const u16* __restrict__ v_cache, float* __restrict__ o,
               int T, int n_head, int n_kv, int pos0, float scale_log2) {
    __shared__ __align__(16) u16 Ks[FA_BK * FA_LD];   // (64 keys, 136)  17 KB
    __shared__ __align__(16) u16 Vs[FA_BK * FA_LD];   // (64 keys, 136)  17 KB

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int qt = gridDim.x - 1 - blockIdx.x;        // longest (last) query tiles start first
    const int h = blockIdx.y;
    const int kvh = h / (n_head / n_kv);
    const int q0 = qt * FA_BQ;
    const int n_keys = pos0 + T;                      // keys 0 .. pos0+T-1 exist
    const int key_end = pos0 + min(q0 + FA_BQ, T);    // one past the last key this block sees
    const int n_tiles = (key_end + FA_BK - 1) / FA_BK;
    const long long pos_stride = (long long)n_kv * FA_HD;    // halves between positions
    const u16* kb = k_cache + (long long)kvh * FA_HD;
    const u16* vb = v_cache + (long long)kvh * FA_HD;

    // this lane's two query rows (g and g+8 of the warp's 16); rows >= T compute on
    // zeros and are not stored
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
    const int qp0 = pos0 + r0, qp1 = pos0 + r1;      // absolute positions
    const int warp_qp_min = pos0 + q0 + warp * 16;

    fa_load_tile(Ks, kb, pos_stride, 0, n_keys);
    cp_commit();
    fa_load_tile(Vs, vb, pos_stride, 0, n_keys);
    cp_commit();

    // Q fragments for the 8 k-chunks of 16 dims: 32 registers, loaded once
    u32 qa[8][4];
    {
        const u32* q0p = (const u32*)(q + ((long long)r0 * n_head + h) * FA_HD);
        const u32* q1p = (const u32*)(q + ((long long)r1 * n_head + h) * FA_HD);
        const bool v0 = r0 < T, v1 = r1 < T;
#pragma unroll
        for (int kc = 0; kc < 8; ++kc) {              // u32 index of dims 16kc+2t = 8kc+t
            qa[kc][0] = v0 ? q0p[8 * kc + t] : 0u;
            qa[kc][1] = v1 ? q1p[8 * kc + t] : 0u;
            qa[kc][2] = v0 ? q0p[8 * kc + t + 4] : 0u;
            qa[kc][3] = v1 ? q1p[8 * kc + t + 4] : 0u;
        }
    }

    float acc[16][4];                                 // O (16 rows, 128 dims): 16 n-tiles of 8
#pragma unroll
    for (int n = 0; n < 16; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float m0 = FA_NEG_INF, m1 = FA_NEG_INF;           // running max (log2 domain), rows g, g+8
    float l0 = 0.0f, l1 = 0.0f;                       // this lane's partial row sums

    for (int j = 0; j < n_tiles; ++j) {
        const int k0 = j * FA_BK;
        cp_wait1();                                   // K(j) landed (V(j) may be in flight)
        __syncthreads();

        // S (16 x 64) = Q K^T: 8 key tiles of 8
        float s[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
            const u16* kr = Ks + (8 * nt + g) * FA_LD + 2 * t;
#pragma unroll
            for (int kc = 0; kc < 8; ++kc)
                mma_f16_16816(s[nt], qa[kc], *(const u32*)(kr + 16 * kc), *(const u32*)(kr + 16 * kc + 8));
        }
        __syncthreads();                              // every warp is done with K(j)
        if (j + 1 < n_tiles) fa_load_tile(Ks, kb, pos_stride, k0 + FA_BK, n_keys);
        cp_commit();                                  // (possibly empty: keeps the group count uniform)

        // mask (only tiles reaching past this warp's first query, or past the last key)
        const bool need_mask = k0 + FA_BK - 1 > warp_qp_min || k0 + FA_BK > n_keys;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = s[nt][e] * scale_log2;
                if (need_mask) {
                    const int key = k0 + 8 * nt + 2 * t + (e & 1);
                    const int qp = e < 2 ? qp0 : qp1;
                    if (key > qp || key >= n_keys) v = FA_NEG_INF;
                }
                s[nt][e] = v;
            }
        }

        // online softmax: the 4 lanes t = 0..3 of a quad share rows g and g+8.
        // Key 0 is visible to every row and sits in tile 0, so after tile 0 the
        // running max is finite and exp2f(-inf - m) = 0 covers all masked keys.
        float mx0 = FA_NEG_INF, mx1 = FA_NEG_INF;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float al0 = exp2f(m0 - mn0), al1 = exp2f(m1 - mn1);   // 0 on the first tile
        m0 = mn0;
        m1 = mn1;
        float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            s[nt][0] = exp2f(s[nt][0] - mn0);
            s[nt][1] = exp2f(s[nt][1] - mn0);
            s[nt][2] = exp2f(s[nt][2] - mn1);
            s[nt][3] = exp2f(s[nt][3] - mn1);
            rs0 += s[nt][0] + s[nt][1];
            rs1 += s[nt][2] + s[nt][3];
        }
        l0 = l0 * al0 + rs0;                          // denominators from the f32 p
        l1 = l1 * al1 + rs1;
#pragma unroll
        for (int n = 0; n < 16; ++n) {
            acc[n][0] *= al0;
            acc[n][1] *= al0;
            acc[n][2] *= al1;
            acc[n][3] *= al1;
        }
        // P as A fragments: k-chunk kk = keys 16kk..16kk+15 = S tiles 2kk, 2kk+1
        u32 pa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            pa[kk][0] = fa_pack_f16x2(s[2 * kk][0], s[2 * kk][1]);
            pa[kk][1] = fa_pack_f16x2(s[2 * kk][2], s[2 * kk][3]);
            pa[kk][2] = fa_pack_f16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[kk][3] = fa_pack_f16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }

        cp_wait1();                                   // V(j) landed (K(j+1) may be in flight)
        __syncthreads();
        // O += P V: ldmatrix.trans matrices 0..3 = (keys +0..7, dims +0..7),
        // (keys +8..15, dims +0..7), (keys +0..7, dims +8..15), (keys +8..15, dims +8..15)
        // -> b0, b1 of dim tile 2np and b0, b1 of dim tile 2np+1
        const u16* vr = Vs + ((lane & 7) + ((lane >> 3) & 1) * 8) * FA_LD + (lane >> 4) * 8;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
            for (int np = 0; np < 8; ++np) {
                u32 b[4];
                ldmatrix_x4_trans(b, vr + 16 * kk * FA_LD + 16 * np);
                mma_f16_16816(acc[2 * np], pa[kk], b[0], b[1]);
                mma_f16_16816(acc[2 * np + 1], pa[kk], b[2], b[3]);
            }
        }
        __syncthreads();                              // every warp is done with V(j)
        if (j + 1 < n_tiles) fa_load_tile(Vs, vb, pos_stride, k0 + FA_BK, n_keys);
        cp_commit();
    }
    cp_wait0();

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = 1.0f / l0, inv1 = 1.0f / l1;
    const long long ld_o = (long long)n_head * FA_HD;
    if (r0 < T) {
        float* op = o + (long long)r0 * ld_o + h * FA_HD + 2 * t;
#pragma unroll
        for (int n = 0; n < 16; ++n) *(float2*)(op + 8 * n) = make_float2(acc[n][0] * inv0, acc[n][1] * inv0);
    }
    if (r1 < T) {
        float* op = o + (long long)r1 * ld_o + h * FA_HD + 2 * t;
#pragma unroll
        for (int n = 0; n < 16; ++n) *(float2*)(op + 8 * n) = make_float2(acc[n][2] * inv1, acc[n][3] * inv1);
    }
}

#ifdef MINFER_SASS_INSTANTIATE
// No templates here: compiling the file already emits flash_attn_f16's SASS.
#endif
