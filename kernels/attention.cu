// Causal GQA attention, f32, tiled flash-style (online softmax; no T x T matrix
// anywhere). Mirrors the math of ggml's flash_attn_ext with causal masking:
//   out[t, h, :] = sum_j softmax_j(q[t,h,:] . k[j,kvh,:] / sqrt(hd)) v[j,kvh,:]
//   over keys j = 0 .. pos0 + t,   kvh = h / (n_head / n_kv)
//
// Block = one tile of ATT_BQ query rows of one query head; ATT_WARPS warps own
// ATT_BQ / ATT_WARPS rows each. Keys are walked in tiles of 32 (one key per lane
// for the scores, then lane = a slice of the head dim for the P.V update),
// staged in shared memory. Running max m, denominator l and the accumulator
// live in registers; each tile rescales them by exp(m_old - m_new) (online softmax).
// f32 CUDA-core math throughout (the reference-grade GPU path; flash_attn.cu is
// the tensor-core f16 one).
#include "common.cuh"

#define ATT_ROWS (ATT_BQ / ATT_WARPS)
// -inf without <math.h> (NVRTC has no INFINITY macro)
#define ATT_NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float att_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float att_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// q (T, n_head, HD); k_cache, v_cache: this layer's (n_rows, n_kv, HD), positions
// 0 .. pos0+T-1 already stored, position j at row kv_row(tab, j) (tab: a paged
// cache's block table, or null); out (T, n_head * HD). All four 16-byte aligned.
// grid = (ceil(T / ATT_BQ), n_head), block = 32 * ATT_WARPS
//
// Shared-memory traffic is what bounds this kernel, so it is read in 16-byte
// vectors: a score is a dot of float4 rows (Q row broadcast, K row per lane;
// K rows padded to HD + 4 floats so the 8 lanes of each quarter-warp phase hit
// distinct banks), and in the P.V update each lane owns C = HD/32 CONSECUTIVE
// head-dim elements, read as one float4 (HD 128) or float2 (HD 64) per key.
template <int HD>
__global__ void __launch_bounds__(32 * ATT_WARPS)
attention_f32(const float* __restrict__ q, const float* __restrict__ k_cache,
              const float* __restrict__ v_cache, float* __restrict__ out,
              int T, int n_head, int n_kv, int pos0, float scale, const int* __restrict__ tab) {
    GRID_DEPENDENCY();
    static_assert(HD == 64 || HD == 128, "head_dim 64 or 128");
    constexpr int C = HD / 32;                 // head-dim elements per lane (P.V)
    constexpr int KS = HD + 4;                 // padded K row (floats)
    constexpr int V4 = HD / 4;                 // float4 per row
    __shared__ __align__(16) float Qs[ATT_BQ][HD];   // pre-scaled by 1/sqrt(hd)
    __shared__ __align__(16) float Ks[ATT_BK][KS];
    __shared__ __align__(16) float Vs[ATT_BK][HD];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int t0 = blockIdx.x * ATT_BQ;
    const int h = blockIdx.y;
    const int kvh = h / (n_head / n_kv);
    const int t_last = min(t0 + ATT_BQ, T) - 1;
    const int kend = pos0 + t_last + 1;        // this tile needs keys [0, kend)
    const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);

    for (int i = tid; i < ATT_BQ * V4; i += 32 * ATT_WARPS) {
        const int r = i / V4, d4 = i % V4, t = t0 + r;
        float4 v = zero4;
        if (t < T) {
            v = reinterpret_cast<const float4*>(q + ((size_t)t * n_head + h) * HD)[d4];
            v.x *= scale; v.y *= scale; v.z *= scale; v.w *= scale;
        }
        reinterpret_cast<float4*>(&Qs[r][0])[d4] = v;
    }

    float m[ATT_ROWS], l[ATT_ROWS], acc[ATT_ROWS][C];
#pragma unroll
    for (int rr = 0; rr < ATT_ROWS; ++rr) {
        m[rr] = ATT_NEG_INF;
        l[rr] = 0.0f;
#pragma unroll
        for (int c = 0; c < C; ++c) acc[rr][c] = 0.0f;
    }

    for (int k0 = 0; k0 < kend; k0 += ATT_BK) {
        __syncthreads();                       // the previous tile is consumed
        for (int i = tid; i < ATT_BK * V4; i += 32 * ATT_WARPS) {
            const int j = i / V4, d4 = i % V4, key = k0 + j;
            // keys past kend are zero, never garbage: 0 * NaN would poison P.V
            float4 kv = zero4, vv = zero4;
            if (key < kend) {
                const size_t off = ((size_t)kv_row(tab, key) * n_kv + kvh) * HD;
                kv = reinterpret_cast<const float4*>(k_cache + off)[d4];
                vv = reinterpret_cast<const float4*>(v_cache + off)[d4];
            }
            reinterpret_cast<float4*>(&Ks[j][0])[d4] = kv;
            reinterpret_cast<float4*>(&Vs[j][0])[d4] = vv;
        }
        __syncthreads();

#pragma unroll
        for (int rr = 0; rr < ATT_ROWS; ++rr) {
            const int r = warp * ATT_ROWS + rr, t = t0 + r;
            if (t >= T) continue;              // warp-uniform
            const int p = pos0 + t;            // the query's absolute position
            const int key = k0 + lane;
            const float4* qr = reinterpret_cast<const float4*>(&Qs[r][0]);
            const float4* kr = reinterpret_cast<const float4*>(&Ks[lane][0]);
            float s = 0.0f;
#pragma unroll 8
            for (int d4 = 0; d4 < V4; ++d4) {
                const float4 a = qr[d4], b = kr[d4];
                s += a.x * b.x; s += a.y * b.y; s += a.z * b.z; s += a.w * b.w;
            }
            const bool valid = key <= p;
            s = valid ? s : ATT_NEG_INF;
            // key 0 is in the first tile and valid for every row, so m_new is finite
            const float m_new = fmaxf(m[rr], att_warp_max(s));
            const float pj = valid ? expf(s - m_new) : 0.0f;
            const float corr = m[rr] == ATT_NEG_INF ? 0.0f : expf(m[rr] - m_new);
            l[rr] = l[rr] * corr + att_warp_sum(pj);
            m[rr] = m_new;
#pragma unroll
            for (int c = 0; c < C; ++c) acc[rr][c] *= corr;
#pragma unroll 8
            for (int j = 0; j < ATT_BK; ++j) {
                const float pjj = __shfl_sync(0xffffffffu, pj, j);
                if constexpr (C == 4) {
                    const float4 v = reinterpret_cast<const float4*>(&Vs[j][0])[lane];
                    acc[rr][0] += pjj * v.x; acc[rr][1] += pjj * v.y;
                    acc[rr][2] += pjj * v.z; acc[rr][3] += pjj * v.w;
                } else {
                    const float2 v = reinterpret_cast<const float2*>(&Vs[j][0])[lane];
                    acc[rr][0] += pjj * v.x; acc[rr][1] += pjj * v.y;
                }
            }
        }
    }

#pragma unroll
    for (int rr = 0; rr < ATT_ROWS; ++rr) {
        const int t = t0 + warp * ATT_ROWS + rr;
        if (t >= T) continue;
        const float inv = 1.0f / l[rr];
        float* o = out + (size_t)t * n_head * HD + (size_t)h * HD + lane * C;
#pragma unroll
        for (int c = 0; c < C; ++c) o[c] = acc[rr][c] * inv;
    }
}

template __global__ void attention_f32<64>(const float*, const float*, const float*, float*,
                                           int, int, int, int, float, const int*);
template __global__ void attention_f32<128>(const float*, const float*, const float*, float*,
                                            int, int, int, int, float, const int*);
