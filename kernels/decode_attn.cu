// The f16 KV cache's writer and its one-query (decode) attention, with the
// position read from device memory when given, so that a decode step captured
// once in a CUDA graph replays at every position:
//   p = pos_dev ? *pos_dev : pos0
//
// Decode attention is split over the keys (flash-decoding): a block per
// (KV head, split) walks its share of keys 0..p for all the query heads of
// that KV head (K and V are read once per group), keeping an online softmax
// per head, and writes a partial (max, sum, accumulator); attn_decode_combine
// merges the splits. q stays f32 (it is one row); K and V come from the f16
// cache; scores, softmax and accumulators are f32.
#include "common.cuh"

#define DEC_THREADS (32 * DEC_WARPS)
#if DEC_THREADS != FA_HD
#error "attn_decode_f16 merges its warps with one thread per head dim: DEC_WARPS * 32 == FA_HD"
#endif
#define DEC_PART (FA_HD + 2)        // floats per partial: max, sum, accumulator
#define DEC_NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ u32 f16_bits_rn(float f) {          // round to nearest even
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ u32 f32x2_to_f16x2(float lo, float hi) {
    return f16_bits_rn(lo) | (f16_bits_rn(hi) << 16);
}

__device__ __forceinline__ float f16_lo(u32 w) { return f16_to_f32((u16)(w & 0xFFFF)); }
__device__ __forceinline__ float f16_hi(u32 w) { return f16_to_f32((u16)(w >> 16)); }

// k, v (T, row) f32 -> rows p..p+T-1 of one layer's f16 caches kc, vc (n_ctx, row),
// rounded to nearest even; row = n_kv * head_dim, n4 = T * row / 4
extern "C" __global__ void __launch_bounds__(THREADS_1D)
store_kv_f16(const float4* __restrict__ k, const float4* __restrict__ v, uint2* __restrict__ kc,
             uint2* __restrict__ vc, long long n4, int row, int pos0, const int* __restrict__ pos_dev) {
    const long long off = (long long)(pos_dev ? *pos_dev : pos0) * row / 4;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
         i += (long long)gridDim.x * blockDim.x) {
        const float4 a = k[i], b = v[i];
        kc[off + i] = make_uint2(f32x2_to_f16x2(a.x, a.y), f32x2_to_f16x2(a.z, a.w));
        vc[off + i] = make_uint2(f32x2_to_f16x2(b.x, b.y), f32x2_to_f16x2(b.z, b.w));
    }
}

// RoPE and the KV store in one launch (rope.cu's rotation, store_kv_f16's rounding):
// q (T, n_head, hd) -> qo rotated; k (T, n_kv, hd) rotated and v -> rows p..p+T-1 of
// one layer's f16 caches kc, vc (n_ctx, n_kv, hd). cos_sin (n_pos, hd/2, 2) as in
// rope.cu; NeoX halves or adjacent pairs. One thread per pair of one head of q or k
// (the k threads also store v's two elements): T * (n_head + n_kv) * hd/2 threads.
extern "C" __global__ void __launch_bounds__(THREADS_1D)
rope_store_kv_f16(const float* __restrict__ q, float* __restrict__ qo, const float* __restrict__ k,
                  const float* __restrict__ v, u16* __restrict__ kc, u16* __restrict__ vc,
                  const float* __restrict__ cos_sin, int T, int n_head, int n_kv, int hd,
                  int pos0, const int* __restrict__ pos_dev, int neox) {
    const int half = hd / 2, heads = n_head + n_kv;
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= (long long)T * heads * half) return;
    const int i = (int)(g % half), hh = (int)(g / half % heads), t = (int)(g / half / heads);
    const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
    const int p = (pos_dev ? *pos_dev : pos0) + t;
    const float* cs = cos_sin + ((size_t)p * half + i) * 2;
    float ya, yb;
    if (hh < n_head) {
        const size_t base = ((size_t)t * n_head + hh) * hd;
        rope_rotate(q[base + ia], q[base + ib], cs[0], cs[1], &ya, &yb);
        qo[base + ia] = ya;
        qo[base + ib] = yb;
        return;
    }
    const int kvh = hh - n_head;
    const size_t src = ((size_t)t * n_kv + kvh) * hd, dst = ((size_t)p * n_kv + kvh) * hd;
    rope_rotate(k[src + ia], k[src + ib], cs[0], cs[1], &ya, &yb);
    kc[dst + ia] = (u16)f16_bits_rn(ya);
    kc[dst + ib] = (u16)f16_bits_rn(yb);
    vc[dst + ia] = (u16)f16_bits_rn(v[src + ia]);
    vc[dst + ib] = (u16)f16_bits_rn(v[src + ib]);
}

// q (n_head, 128) f32; kc, vc (n_ctx, n_kv, 128) f16 of one layer, keys 0..p stored;
// part (n_head, DEC_SPLITS, DEC_PART) f32. scale_log2 = log2(e)/sqrt(128): scores
// in the log2 domain (exp2f). grid = (n_kv, DEC_SPLITS), block = DEC_THREADS.
// A warp takes every DEC_WARPS-th key of the split; lane l holds dims 4l..4l+3.
extern "C" __global__ void __launch_bounds__(DEC_THREADS)
attn_decode_f16(const float* __restrict__ q, const u16* __restrict__ kc, const u16* __restrict__ vc,
                float* __restrict__ part, int n_head, int n_kv, int pos0,
                const int* __restrict__ pos_dev, float scale_log2) {
    __shared__ float s_ml[DEC_WARPS][DEC_MAX_G][2];
    __shared__ float s_acc[DEC_WARPS][DEC_MAX_G][FA_HD];
    const int kvh = blockIdx.x, split = blockIdx.y, G = n_head / n_kv;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, d0 = 4 * lane;
    const int n_keys = (pos_dev ? *pos_dev : pos0) + 1;
    const int chunk = (n_keys + DEC_SPLITS - 1) / DEC_SPLITS;
    const int j0 = split * chunk, j1 = min(n_keys, j0 + chunk);

    float qr[DEC_MAX_G][4], m[DEC_MAX_G], l[DEC_MAX_G], acc[DEC_MAX_G][4];
#pragma unroll
    for (int g = 0; g < DEC_MAX_G; ++g) {
        const float4 qv = g < G ? *(const float4*)(q + (size_t)(kvh * G + g) * FA_HD + d0)
                                : make_float4(0.f, 0.f, 0.f, 0.f);
        qr[g][0] = qv.x * scale_log2; qr[g][1] = qv.y * scale_log2;
        qr[g][2] = qv.z * scale_log2; qr[g][3] = qv.w * scale_log2;
        m[g] = DEC_NEG_INF; l[g] = 0.f;
        acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.f;
    }
    for (int j = j0 + warp; j < j1; j += DEC_WARPS) {
        const size_t at = ((size_t)j * n_kv + kvh) * FA_HD + d0;
        const uint2 kw = *(const uint2*)(kc + at), vw = *(const uint2*)(vc + at);
        const float k4[4] = {f16_lo(kw.x), f16_hi(kw.x), f16_lo(kw.y), f16_hi(kw.y)};
        const float v4[4] = {f16_lo(vw.x), f16_hi(vw.x), f16_lo(vw.y), f16_hi(vw.y)};
#pragma unroll
        for (int g = 0; g < DEC_MAX_G; ++g) {
            if (g >= G) break;
            float s = qr[g][0] * k4[0] + qr[g][1] * k4[1] + qr[g][2] * k4[2] + qr[g][3] * k4[3];
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            const float mn = fmaxf(m[g], s);
            const float c = exp2f(m[g] - mn), p = exp2f(s - mn);
            l[g] = l[g] * c + p;
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[g][i] = acc[g][i] * c + p * v4[i];
            m[g] = mn;
        }
    }
#pragma unroll
    for (int g = 0; g < DEC_MAX_G; ++g) {
        if (g >= G) break;
        if (lane == 0) { s_ml[warp][g][0] = m[g]; s_ml[warp][g][1] = l[g]; }
#pragma unroll
        for (int i = 0; i < 4; ++i) s_acc[warp][g][d0 + i] = acc[g][i];
    }
    __syncthreads();
    // merge the warps: thread t owns dim t of every head (DEC_THREADS == FA_HD)
    const int d = threadIdx.x;
    for (int g = 0; g < G; ++g) {
        float M = DEC_NEG_INF;
        for (int w = 0; w < DEC_WARPS; ++w) M = fmaxf(M, s_ml[w][g][0]);
        float L = 0.f, A = 0.f;
        if (M != DEC_NEG_INF) {                         // a split with no keys stays empty
            for (int w = 0; w < DEC_WARPS; ++w) {
                const float c = exp2f(s_ml[w][g][0] - M);
                L += s_ml[w][g][1] * c;
                A += s_acc[w][g][d] * c;
            }
        }
        float* out = part + ((size_t)(kvh * G + g) * DEC_SPLITS + split) * DEC_PART;
        if (d == 0) { out[0] = M; out[1] = L; }
        out[2 + d] = A;
    }
}

// part (n_head, DEC_SPLITS, DEC_PART) -> o (n_head * 128) f32; grid = n_head, block = FA_HD
extern "C" __global__ void __launch_bounds__(FA_HD)
attn_decode_combine(const float* __restrict__ part, float* __restrict__ o) {
    const float* p = part + (size_t)blockIdx.x * DEC_SPLITS * DEC_PART;
    const int d = threadIdx.x;
    float M = DEC_NEG_INF;
    for (int s = 0; s < DEC_SPLITS; ++s) M = fmaxf(M, p[s * DEC_PART]);
    float L = 0.f, A = 0.f;
    for (int s = 0; s < DEC_SPLITS; ++s) {
        const float ms = p[s * DEC_PART];
        if (ms == DEC_NEG_INF) continue;                 // an empty split
        const float c = exp2f(ms - M);
        L += p[s * DEC_PART + 1] * c;
        A += p[s * DEC_PART + 2 + d] * c;
    }
    o[(size_t)blockIdx.x * FA_HD + d] = A / L;
}
