// Causal GQA attention, f32, tiled flash-style (online softmax; no T x T matrix
// anywhere). Mirrors the math of ggml's flash_attn_ext with causal masking:
//   out[t, h, :] = sum_j softmax_j(q[t,h,:] . k[j,kvh,:] / sqrt(hd)) v[j,kvh,:]
//   over keys j = 0 .. pos0 + t,   kvh = h / (n_head / n_kv)
//
// Block = one tile of ATT_BQ query rows of one query head; ATT_WARPS warps own
// ATT_BQ / ATT_WARPS rows each. Keys are walked in tiles of 32 (one key per lane
// for the scores, then lane = head-dim slice for the P.V update), staged in
// shared memory; K rows are padded to HD + 1 floats so that lane j reading row j
// hits distinct banks. Running max m, denominator l and the accumulator live in
// registers; each tile rescales them by exp(m_old - m_new) (online softmax).

#define ATT_BQ 16
#define ATT_BK 32
#define ATT_WARPS 4
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

// q (T, n_head, HD); k_cache, v_cache: this layer's (n_ctx, n_kv, HD), positions
// 0 .. pos0+T-1 already stored; out (T, n_head * HD).
// grid = (ceil(T / ATT_BQ), n_head), block = 32 * ATT_WARPS
template <int HD>
__global__ void __launch_bounds__(32 * ATT_WARPS)
attention_f32(const float* __restrict__ q, const float* __restrict__ k_cache,
              const float* __restrict__ v_cache, float* __restrict__ out,
              int T, int n_head, int n_kv, int pos0, float scale) {
    static_assert(HD % 32 == 0, "head_dim must be a multiple of 32");
    constexpr int C = HD / 32;                 // head-dim elements per lane
    __shared__ float Qs[ATT_BQ][HD];           // pre-scaled by 1/sqrt(hd)
    __shared__ float Ks[ATT_BK][HD + 1];       // +1: conflict-free row-per-lane reads
    __shared__ float Vs[ATT_BK][HD];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int t0 = blockIdx.x * ATT_BQ;
    const int h = blockIdx.y;
    const int kvh = h / (n_head / n_kv);
    const int t_last = min(t0 + ATT_BQ, T) - 1;
    const int kend = pos0 + t_last + 1;        // this tile needs keys [0, kend)

    for (int i = tid; i < ATT_BQ * HD; i += 32 * ATT_WARPS) {
        const int r = i / HD, d = i % HD, t = t0 + r;
        Qs[r][d] = t < T ? q[((size_t)t * n_head + h) * HD + d] * scale : 0.0f;
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
        for (int i = tid; i < ATT_BK * HD; i += 32 * ATT_WARPS) {
            const int j = i / HD, d = i % HD, key = k0 + j;
            // keys past kend are zero, never garbage: 0 * NaN would poison P.V
            const bool ok = key < kend;
            const size_t off = ((size_t)key * n_kv + kvh) * HD + d;
            Ks[j][d] = ok ? k_cache[off] : 0.0f;
            Vs[j][d] = ok ? v_cache[off] : 0.0f;
        }
        __syncthreads();

#pragma unroll
        for (int rr = 0; rr < ATT_ROWS; ++rr) {
            const int r = warp * ATT_ROWS + rr, t = t0 + r;
            if (t >= T) continue;              // warp-uniform
            const int p = pos0 + t;            // the query's absolute position
            const int key = k0 + lane;
            float s = 0.0f;
#pragma unroll 16
            for (int d = 0; d < HD; ++d) s += Qs[r][d] * Ks[lane][d];
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
#pragma unroll
                for (int c = 0; c < C; ++c) acc[rr][c] += pjj * Vs[j][lane + 32 * c];
            }
        }
    }

#pragma unroll
    for (int rr = 0; rr < ATT_ROWS; ++rr) {
        const int t = t0 + warp * ATT_ROWS + rr;
        if (t >= T) continue;
        const float inv = 1.0f / l[rr];
        float* o = out + (size_t)t * n_head * HD + (size_t)h * HD;
#pragma unroll
        for (int c = 0; c < C; ++c) o[lane + 32 * c] = acc[rr][c] * inv;
    }
}

template __global__ void attention_f32<64>(const float*, const float*, const float*, float*,
                                           int, int, int, int, float);
template __global__ void attention_f32<128>(const float*, const float*, const float*, float*,
                                            int, int, int, int, float);
