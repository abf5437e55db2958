// The f16 KV cache's writer and its one-query (decode) attention, with the
// position read from device memory when given, so that a decode step captured
// once in a CUDA graph replays at every position:
//   p = pos_dev ? *pos_dev : pos0
//
// Decode attention is split over the keys (flash-decoding): a block per
// (KV head, split of DEC_CHUNK keys) walks its keys for all the query heads of
// that KV head (K and V are read once per group), keeping an online softmax
// per head, and writes a partial (max, sum, accumulator); attn_decode_combine
// merges the splits. The grid covers the whole cache, so a step captured once
// replays at any position; the blocks past the position exit at once. A fixed
// chunk (not a fixed number of splits) keeps the work per warp short at long
// contexts: 3,325 keys in 32 splits left each warp 26 keys in a row, latency-bound.
// Below DEC_SHORT_SPLITS splits' worth of keys, attn_decode_short does the splits
// and their merge in one launch (the same arithmetic, so the same bits); a decode
// graph is captured for one side of that limit or the other.
// q stays f32 (it is one row); K and V come from the f16 cache; scores, softmax
// and accumulators are f32.
// Batched decode: the kernels take B rows at once (grid's last dimension), row b at
// position pos_dev[b] over its own sequence's cache rows, through its block table
// tab + b * tab_stride (a paged cache; tab null: one contiguous sequence). A row's
// arithmetic is the same whatever B is and whichever rows are beside it.
#include "common.cuh"

#define DEC_THREADS (32 * DEC_WARPS)
#if DEC_THREADS != FA_HD
#error "attn_decode_f16 merges its warps with one thread per head dim: DEC_WARPS * 32 == FA_HD"
#endif
#define DEC_PART (FA_HD + 2)        // floats per partial: max, sum, accumulator
#define DEC_NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float f16_lo(u32 w) { return f16_to_f32((u16)(w & 0xFFFF)); }
__device__ __forceinline__ float f16_hi(u32 w) { return f16_to_f32((u16)(w >> 16)); }

// k, v (T, row) f32 -> one layer's f16 caches kc, vc (n_rows, row), rounded to nearest
// even: token t at position p + t goes to cache row kv_row(tab, p + t), or to
// rows[2t + 1] when rows ((T, 2) int32: position, cache row; a batch of sequences)
// is given; row = n_kv * head_dim, n4 = T * row / 4
extern "C" __global__ void __launch_bounds__(THREADS_1D)
store_kv_f16(const float4* __restrict__ k, const float4* __restrict__ v, uint2* __restrict__ kc,
             uint2* __restrict__ vc, long long n4, int row, int pos0, const int* __restrict__ pos_dev,
             const int* __restrict__ rows, const int* __restrict__ tab) {
    GRID_DEPENDENCY();
    const int p = pos_dev ? *pos_dev : pos0, r4 = row / 4;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
         i += (long long)gridDim.x * blockDim.x) {
        const int t = (int)(i / r4);
        const long long at = (rows ? rows[2 * t + 1] : kv_row(tab, p + t)) * r4 + (i - (long long)t * r4);
        const float4 a = k[i], b = v[i];
        kc[at] = make_uint2(f32x2_to_f16x2(a.x, a.y), f32x2_to_f16x2(a.z, a.w));
        vc[at] = make_uint2(f32x2_to_f16x2(b.x, b.y), f32x2_to_f16x2(b.z, b.w));
    }
}

// RoPE and the KV store in one launch (rope.cu's rotation, store_kv_f16's rounding):
// q (T, n_head, hd) [+ bq] -> rotated into qo (f32) or qo16 (f16, the flash
// attention's operand, (T, n_head, hd) packed); k (T, n_kv, hd) [+ bk] rotated and
// v [+ bv] -> one layer's f16 caches kc, vc (n_rows, n_kv, hd): token t at position
// p + t, cache row kv_row(tab, p + t); or with rows ((T, 2) int32, a batch of
// sequences) at position rows[2t], cache row rows[2t + 1].
// q's token rows are ldq floats apart, k's and v's ldkv: they may be column blocks
// of one GEMM's output over the concatenated q/k/v weights. The biases (nullable)
// are the q/k/v projections' own, added here instead of after the GEMMs: the same
// f32 sums. cos_sin (n_pos, hd/2, 2) as in rope.cu; NeoX halves or adjacent pairs.
// One thread per four consecutive pairs i0..i0+3 of one head of q or k (the k
// threads also store v's eight elements): T * (n_head + n_kv) * hd/8 threads,
// hd % 8 == 0. Four pairs are two 16-byte loads of x (NeoX: dims i0.. and
// hd/2 + i0..; adjacent pairs: dims 2 i0..2 i0+7) and two of the table, and 8- or
// 16-byte stores (a thread per pair made 4-byte loads and 2-byte stores).
__device__ __forceinline__ float4 ld4(const float* p) { return *(const float4*)p; }

// the four pairs' elements (a[k], b[k]) at x + at, plus the bias at b + e (nullable)
__device__ __forceinline__ void rope_quad_load(const float* __restrict__ x, size_t at,
                                               const float* __restrict__ bias, int e, int half,
                                               bool neox, float (&a)[4], float (&b)[4]) {
    float4 u = ld4(x + at), w = ld4(x + at + (neox ? half : 4));
    if (bias) {
        const float4 bu = ld4(bias + e), bw = ld4(bias + e + (neox ? half : 4));
        u = make_float4(u.x + bu.x, u.y + bu.y, u.z + bu.z, u.w + bu.w);
        w = make_float4(w.x + bw.x, w.y + bw.y, w.z + bw.z, w.w + bw.w);
    }
    if (neox) {
        a[0] = u.x; a[1] = u.y; a[2] = u.z; a[3] = u.w;
        b[0] = w.x; b[1] = w.y; b[2] = w.z; b[3] = w.w;
    } else {
        a[0] = u.x; b[0] = u.y; a[1] = u.z; b[1] = u.w;
        a[2] = w.x; b[2] = w.y; a[3] = w.z; b[3] = w.w;
    }
}

// the four pairs' values rounded to f16 at dst (the layout rope_quad_load read)
__device__ __forceinline__ void rope_quad_store16(u16* __restrict__ dst, int half, bool neox,
                                                  const float (&a)[4], const float (&b)[4]) {
    if (neox) {
        *(uint2*)dst = make_uint2(f32x2_to_f16x2(a[0], a[1]), f32x2_to_f16x2(a[2], a[3]));
        *(uint2*)(dst + half) = make_uint2(f32x2_to_f16x2(b[0], b[1]), f32x2_to_f16x2(b[2], b[3]));
    } else {
        *(uint4*)dst = make_uint4(f32x2_to_f16x2(a[0], b[0]), f32x2_to_f16x2(a[1], b[1]),
                                  f32x2_to_f16x2(a[2], b[2]), f32x2_to_f16x2(a[3], b[3]));
    }
}

extern "C" __global__ void __launch_bounds__(THREADS_1D)
rope_store_kv_f16(const float* __restrict__ q, float* __restrict__ qo, u16* __restrict__ qo16,
                  const float* __restrict__ k, const float* __restrict__ v,
                  const float* __restrict__ bq, const float* __restrict__ bk,
                  const float* __restrict__ bv, u16* __restrict__ kc, u16* __restrict__ vc,
                  const float* __restrict__ cos_sin, int T, int n_head, int n_kv, int hd,
                  long long ldq, long long ldkv, int pos0, const int* __restrict__ pos_dev, int neox,
                  const int* __restrict__ rows, const int* __restrict__ tab) {
    GRID_DEPENDENCY();
    const int half = hd / 2, quads = hd / 8, heads = n_head + n_kv;
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= (long long)T * heads * quads) return;
    const int i0 = 4 * (int)(g % quads), hh = (int)(g / quads % heads), t = (int)(g / quads / heads);
    const int p = rows ? rows[2 * t] : (pos_dev ? *pos_dev : pos0) + t;
    const float4 c01 = ld4(cos_sin + ((size_t)p * half + i0) * 2), c23 = ld4(cos_sin + ((size_t)p * half + i0) * 2 + 4);
    const float cs[4] = {c01.x, c01.z, c23.x, c23.z}, sn[4] = {c01.y, c01.w, c23.y, c23.w};
    const int off = neox ? i0 : 2 * i0;                           // the first element's dim
    const bool is_q = hh < n_head;
    const int e = (is_q ? hh : hh - n_head) * hd + off;
    const size_t src = (size_t)t * (is_q ? ldq : ldkv) + e;
    float a[4], b[4], ya[4], yb[4];
    rope_quad_load(is_q ? q : k, src, is_q ? bq : bk, e, half, neox, a, b);
#pragma unroll
    for (int j = 0; j < 4; ++j) rope_rotate(a[j], b[j], cs[j], sn[j], &ya[j], &yb[j]);
    if (is_q) {
        const size_t base = ((size_t)t * n_head + hh) * hd + off;   // in qo / qo16
        if (qo16) {
            rope_quad_store16(qo16 + base, half, neox, ya, yb);
        } else if (neox) {
            *(float4*)(qo + base) = make_float4(ya[0], ya[1], ya[2], ya[3]);
            *(float4*)(qo + base + half) = make_float4(yb[0], yb[1], yb[2], yb[3]);
        } else {
            *(float4*)(qo + base) = make_float4(ya[0], yb[0], ya[1], yb[1]);
            *(float4*)(qo + base + 4) = make_float4(ya[2], yb[2], ya[3], yb[3]);
        }
        return;
    }
    const size_t dst = ((size_t)(rows ? rows[2 * t + 1] : kv_row(tab, p)) * n_kv + (hh - n_head)) * hd + off;
    rope_quad_store16(kc + dst, half, neox, ya, yb);
    rope_quad_load(v, src, bv, e, half, neox, a, b);
    rope_quad_store16(vc + dst, half, neox, a, b);
}

// Lane l's four dims 4l..4l+3 of a head row (f32), rotated by RoPE at position p
// when cs (the table row of p, (64, 2)) is given: NeoX pairs (i, i+64) sit in lanes
// l and l+16 (one shuffle), adjacent pairs inside the lane. rope_rotate, as rope.cu.
__device__ __forceinline__ float4 rope_lane(float4 x, const float* __restrict__ cs, int lane, bool neox) {
    if (!cs) return x;
    float v[4] = {x.x, x.y, x.z, x.w}, y[4];
    if (neox) {
        const bool lo = lane < 16;
        const int i0 = 4 * (lane % 16);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float other = __shfl_xor_sync(0xffffffffu, v[e], 16);
            const float c = cs[2 * (i0 + e)], sn = cs[2 * (i0 + e) + 1];
            float ya, yb;
            rope_rotate(lo ? v[e] : other, lo ? other : v[e], c, sn, &ya, &yb);
            y[e] = lo ? ya : yb;
        }
    } else {
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
            const int i = 2 * lane + e / 2;
            rope_rotate(v[e], v[e + 1], cs[2 * i], cs[2 * i + 1], &y[e], &y[e + 1]);
        }
    }
    return make_float4(y[0], y[1], y[2], y[3]);
}

// One split: keys j0..j1-1 of KV head kvh for its G query heads, walked by the
// DEC_WARPS warps of one sub-block (warp, lane: the thread's place in it; every
// thread of the block calls this, a sub-block without keys with j0 >= j1, because
// it holds the block's barriers). q (n_head, 128) f32; kc, vc (n_ctx, n_kv, 128) f16
// of one layer, keys 0..p stored. scale_log2 = log2(e)/sqrt(128): scores in the
// log2 domain (exp2f). Warp w takes keys j0+w, j0+w+DEC_WARPS, ... two at a time,
// the next pair's rows loaded while this pair is added in; lane l holds dims
// 4l..4l+3. The warps meet in s_ml, s_acc (the sub-block's own), and head g's
// partial (max, sum, accumulator: DEC_PART floats) goes to out + g * gstride.
// With cos_sin (n_pos, 64, 2) given, q and k_new come un-rotated: every sub-block
// rotates its query heads, and the one that holds key p rotates k_new and stores
// it and v_new (1, n_kv, 128) f32 into position p before reading it (rope_store_kv_f16's
// values, one launch fewer); only that sub-block ever reads position p. Position j
// sits at cache row kv_row(tab, j); a split lies in one block (KV_BLOCK % DEC_CHUNK == 0).
__device__ __forceinline__ void split_partial(
        const float* __restrict__ q, u16* __restrict__ kc, u16* __restrict__ vc, const int* __restrict__ tab,
        int G, int n_kv,
        int kvh, int p, int j0, int j1, float scale_log2, const float* __restrict__ k_new,
        const float* __restrict__ v_new, const float* __restrict__ cos_sin, int neox, int warp,
        int lane, float (*s_ml)[DEC_MAX_G][2], float (*s_acc)[DEC_MAX_G][FA_HD], float* out,
        size_t gstride) {
    const int d0 = 4 * lane, n_keys = p + 1;
    // key j of this split at row kv_row(tab, j0) + j - j0: the split's keys as rows of kc, vc from j = 0
    const long long rb = (j0 < j1 ? kv_row(tab, j0) - j0 : 0) * n_kv * FA_HD;
    kc += rb;
    vc += rb;
    const float* cs = cos_sin ? cos_sin + (size_t)p * FA_HD : nullptr;   // (64, 2) at p

    if (cs && j0 < j1 && j1 == n_keys && warp == 0) {       // this sub-block holds key p
        const size_t src = (size_t)kvh * FA_HD + d0, dst = ((size_t)p * n_kv + kvh) * FA_HD + d0;
        const float4 kr = rope_lane(*(const float4*)(k_new + src), cs, lane, neox);
        const float4 vv = *(const float4*)(v_new + src);
        *(uint2*)(kc + dst) = make_uint2(f32x2_to_f16x2(kr.x, kr.y), f32x2_to_f16x2(kr.z, kr.w));
        *(uint2*)(vc + dst) = make_uint2(f32x2_to_f16x2(vv.x, vv.y), f32x2_to_f16x2(vv.z, vv.w));
    }
    float qr[DEC_MAX_G][4], m[DEC_MAX_G], l[DEC_MAX_G], acc[DEC_MAX_G][4];
#pragma unroll
    for (int g = 0; g < DEC_MAX_G; ++g) {
        float4 qv = g < G ? *(const float4*)(q + (size_t)(kvh * G + g) * FA_HD + d0)
                          : make_float4(0.f, 0.f, 0.f, 0.f);
        qv = rope_lane(qv, cs, lane, neox);
        qr[g][0] = qv.x * scale_log2; qr[g][1] = qv.y * scale_log2;
        qr[g][2] = qv.z * scale_log2; qr[g][3] = qv.w * scale_log2;
        m[g] = DEC_NEG_INF; l[g] = 0.f;
        acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.f;
    }
    if (cs) __syncthreads();                                // row p stored before any warp reads it
    // keys j and j + DEC_WARPS (the second clamped to the first past j1) of this lane
    auto load_pair = [&](int j, uint2 (&kw)[2], uint2 (&vw)[2]) {
        const int jb = j + DEC_WARPS < j1 ? j + DEC_WARPS : j;
        const size_t at = ((size_t)j * n_kv + kvh) * FA_HD + d0, bt = ((size_t)jb * n_kv + kvh) * FA_HD + d0;
        kw[0] = *(const uint2*)(kc + at); kw[1] = *(const uint2*)(kc + bt);
        vw[0] = *(const uint2*)(vc + at); vw[1] = *(const uint2*)(vc + bt);
    };
    // the next pair's loads are issued before this pair's arithmetic, so a warp
    // waits on memory once, not once per pair (after 3,325 keys a warp walks 16)
    uint2 kw[2], vw[2];
    if (j0 + warp < j1) load_pair(j0 + warp, kw, vw);
    for (int j = j0 + warp; j < j1; j += 2 * DEC_WARPS) {
        const bool two = j + DEC_WARPS < j1;
        const int jn = j + 2 * DEC_WARPS;
        uint2 kn[2], vn[2];
        if (jn < j1) load_pair(jn, kn, vn);
        // the scores of both keys for every head first, their warp sums side by side
        // (each sum in the same butterfly order as alone): 2 x DEC_MAX_G independent
        // shuffle chains in flight instead of one after another; heads past G have
        // q = 0 and are never used. Then the online softmax, key by key, head by head.
        float s[2][DEC_MAX_G];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const float k4[4] = {f16_lo(kw[u].x), f16_hi(kw[u].x), f16_lo(kw[u].y), f16_hi(kw[u].y)};
#pragma unroll
            for (int g = 0; g < DEC_MAX_G; ++g)
                s[u][g] = qr[g][0] * k4[0] + qr[g][1] * k4[1] + qr[g][2] * k4[2] + qr[g][3] * k4[3];
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
            for (int u = 0; u < 2; ++u) {
#pragma unroll
                for (int g = 0; g < DEC_MAX_G; ++g) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], o);
            }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            if (u == 1 && !two) break;
            const float v4[4] = {f16_lo(vw[u].x), f16_hi(vw[u].x), f16_lo(vw[u].y), f16_hi(vw[u].y)};
#pragma unroll
            for (int g = 0; g < DEC_MAX_G; ++g) {
                if (g >= G) break;
                const float mn = fmaxf(m[g], s[u][g]);
                const float c = exp2f(m[g] - mn), p = exp2f(s[u][g] - mn);
                l[g] = l[g] * c + p;
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[g][i] = acc[g][i] * c + p * v4[i];
                m[g] = mn;
            }
        }
        if (jn < j1) {
            kw[0] = kn[0]; kw[1] = kn[1]; vw[0] = vn[0]; vw[1] = vn[1];
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
    if (j0 >= j1) return;                                   // no keys: no partial
    // merge the warps: thread d of the sub-block owns dim d of every head
    const int d = warp * 32 + lane;
    for (int g = 0; g < G; ++g) {
        float M = DEC_NEG_INF;
        for (int w = 0; w < DEC_WARPS; ++w) M = fmaxf(M, s_ml[w][g][0]);
        float L = 0.f, A = 0.f;
        for (int w = 0; w < DEC_WARPS; ++w) {
            if (s_ml[w][g][0] == DEC_NEG_INF) continue;   // a warp with no key (a short last split)
            const float c = exp2f(s_ml[w][g][0] - M);
            L += s_ml[w][g][1] * c;
            A += s_acc[w][g][d] * c;
        }
        float* o = out + g * gstride;
        if (d == 0) { o[0] = M; o[1] = L; }
        o[2 + d] = A;
    }
}

// The splits' partials merged, one step: split s (in split order, from L = A = 0)
// with c = exp2(m_s - M), M the largest max. Both merges (attn_decode_combine and
// attn_decode_short) add through this, so their sums are the same expressions.
__device__ __forceinline__ void merge_split(float& L, float& A, float l_s, float a_s, float c) {
    L += l_s * c;
    A += a_s * c;
}

// head h's merged value y of dim d -> o (f32) and/or the q8_1 form oq, od, os (a
// warp per block of 32: all 32 lanes of the warp call this)
__device__ __forceinline__ void store_head(float y, int h, int d, float* __restrict__ o, i8* __restrict__ oq,
                                           float* __restrict__ od, float* __restrict__ os) {
    if (o) o[(size_t)h * FA_HD + d] = y;
    if (oq) {
        const size_t g = (size_t)h * (FA_HD / QK8_1) + d / QK8_1;
        q8_1_block(y, d % QK8_1, oq + g * QK8_1, od + g, os + g);
    }
}

static_assert(KV_BLOCK % DEC_CHUNK == 0, "a decode split lies in one block of a paged cache");

// row b's outputs of a batch: o and oq hold n_head * 128 values a row, od and os
// (n_head * 128) / 32 (any of them nullable)
__device__ __forceinline__ void offset_outputs(int b, int n_head, float* __restrict__& o, i8* __restrict__& oq,
                                               float* __restrict__& od, float* __restrict__& os) {
    const size_t n = (size_t)b * n_head * FA_HD;
    if (o) o += n;
    if (oq) oq += n;
    if (od) od += n / QK8_1;
    if (os) os += n / QK8_1;
}

// The split kernel: part (B, n_head, n_split, DEC_PART) f32. grid = (n_kv, n_split, B),
// n_split * DEC_CHUNK >= n_ctx, block = DEC_THREADS; a block whose keys start past
// p writes nothing (the combine reads only the splits that hold keys).
extern "C" __global__ void __launch_bounds__(DEC_THREADS)
attn_decode_f16(const float* __restrict__ q, u16* __restrict__ kc, u16* __restrict__ vc,
                float* __restrict__ part, int n_head, int n_kv, int n_split, int pos0,
                const int* __restrict__ pos_dev, float scale_log2, const float* __restrict__ k_new,
                const float* __restrict__ v_new, const float* __restrict__ cos_sin, int neox,
                const int* __restrict__ tab, int tab_stride) {
    GRID_DEPENDENCY();
    __shared__ float s_ml[DEC_WARPS][DEC_MAX_G][2];
    __shared__ float s_acc[DEC_WARPS][DEC_MAX_G][FA_HD];
    const int kvh = blockIdx.x, split = blockIdx.y, b = blockIdx.z, G = n_head / n_kv;
    const int p = pos_dev ? pos_dev[b] : pos0;
    const int j0 = split * DEC_CHUNK, j1 = min(p + 1, j0 + DEC_CHUNK);
    if (j0 >= j1) return;                                   // whole block: no key here
    const size_t qb = (size_t)b * n_head * FA_HD, kb = (size_t)b * n_kv * FA_HD;
    split_partial(q + qb, kc, vc, tab ? tab + (size_t)b * tab_stride : nullptr, G, n_kv, kvh, p, j0, j1,
                  scale_log2, k_new ? k_new + kb : nullptr, v_new ? v_new + kb : nullptr, cos_sin, neox,
                  threadIdx.x / 32, threadIdx.x % 32, s_ml, s_acc,
                  part + (((size_t)b * n_head + kvh * G) * n_split + split) * DEC_PART,
                  (size_t)n_split * DEC_PART);
}

// The K and V rows of the DEC_CHUNK keys of this thread's sub-block into L2, one
// 256-byte row a thread (K for even threads, V for odd), rows past the cache skipped:
// every row the sub-block may read, whatever the position (which it reads only after
// its wait). A paged cache's block table is read here too: the host writes it
// (CudaCache.set_table) before the step is queued, never a kernel in flight. Called before GRID_DEPENDENCY(): those rows were stored by earlier steps
// (no kernel in flight writes them), or are row p, which this kernel stores later
// (through L2: the prefetched line is the one the store updates); a prefetch changes
// no value.
__device__ __forceinline__ void decode_rows_prefetch_l2(const u16* __restrict__ kc, const u16* __restrict__ vc,
                                                        const int* __restrict__ tab, int tab_stride, int n_kv,
                                                        int n_ctx) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (tab) tab += (size_t)blockIdx.y * tab_stride;         // row blockIdx.y's table
    const int d = threadIdx.x % DEC_THREADS;
    const int key = (threadIdx.x / DEC_THREADS) * DEC_CHUNK + d / 2;
    if (key < n_ctx) {
        const u16* row = ((d & 1) ? vc : kc) + ((size_t)kv_row(tab, key) * n_kv + blockIdx.x) * FA_HD;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(row), "r"(FA_HD * 2) : "memory");
    }
#endif
}

// Keys 0..p with p < DEC_SHORT_SPLITS * DEC_CHUNK in one launch: a block per KV head,
// whose DEC_SHORT_SPLITS sub-blocks of DEC_THREADS each do what attn_decode_f16's
// blocks of the splits 0, 1, ... do, into shared memory, and then merge the splits
// as attn_decode_combine does (merge_split, store_head): the same bits, without the
// combine's launch. Sub-block b merges heads b, b + DEC_SHORT_SPLITS, ...
// (The table's entries for every block up to n_ctx are valid blocks: the prefetch
// reads them before the position is known.)
// Outputs as attn_decode_combine's. kc, vc hold n_ctx positions. grid = (n_kv, B), block =
// DEC_SHORT_SPLITS * DEC_THREADS, dynamic shared memory DEC_SHORT_SMEM bytes.
extern "C" __global__ void __launch_bounds__(DEC_SHORT_SPLITS * DEC_THREADS)
attn_decode_short(const float* __restrict__ q, u16* __restrict__ kc, u16* __restrict__ vc,
                  float* __restrict__ o, i8* __restrict__ oq, float* __restrict__ od,
                  float* __restrict__ os, int n_head, int n_kv, int n_ctx, int pos0,
                  const int* __restrict__ pos_dev, float scale_log2, const float* __restrict__ k_new,
                  const float* __restrict__ v_new, const float* __restrict__ cos_sin, int neox,
                  const int* __restrict__ tab, int tab_stride) {
    decode_rows_prefetch_l2(kc, vc, tab, tab_stride, n_kv, n_ctx);
    GRID_DEPENDENCY();
    const int b = blockIdx.y;
    if (tab) tab += (size_t)b * tab_stride;
    extern __shared__ float4 s_dyn[];
    typedef float Acc[DEC_MAX_G][FA_HD];
    typedef float Ml[DEC_MAX_G][2];
    typedef float Part[DEC_MAX_G][DEC_PART];
    Acc* s_acc = (Acc*)s_dyn;                                           // [splits * warps]
    Ml* s_ml = (Ml*)(s_acc + DEC_SHORT_SPLITS * DEC_WARPS);             // [splits * warps]
    Part* s_part = (Part*)(s_ml + DEC_SHORT_SPLITS * DEC_WARPS);        // [splits]
    const int kvh = blockIdx.x, G = n_head / n_kv;
    const int sub = threadIdx.x / DEC_THREADS, d = threadIdx.x % DEC_THREADS;
    const int p = pos_dev ? pos_dev[b] : pos0;
    const int j0 = sub * DEC_CHUNK, j1 = min(p + 1, j0 + DEC_CHUNK);
    const size_t qb = (size_t)b * n_head * FA_HD, kb = (size_t)b * n_kv * FA_HD;
    q += qb;
    if (k_new) k_new += kb;
    if (v_new) v_new += kb;
    split_partial(q, kc, vc, tab, G, n_kv, kvh, p, j0, j1, scale_log2, k_new, v_new, cos_sin, neox,
                  d / 32, d % 32, s_ml + sub * DEC_WARPS, s_acc + sub * DEC_WARPS,
                  &s_part[sub][0][0], DEC_PART);
    __syncthreads();
    offset_outputs(b, n_head, o, oq, od, os);
    const int used = min(DEC_SHORT_SPLITS, (p + DEC_CHUNK) / DEC_CHUNK);
    for (int g = sub; g < G; g += DEC_SHORT_SPLITS) {
        float M = DEC_NEG_INF;
        for (int s = 0; s < used; ++s) M = fmaxf(M, s_part[s][g][0]);
        float L = 0.f, A = 0.f;
        for (int s = 0; s < used; ++s) merge_split(L, A, s_part[s][g][1], s_part[s][g][2 + d],
                                                   exp2f(s_part[s][g][0] - M));
        store_head(A / L, kvh * G + g, d, o, oq, od, os);
    }
}

// part (B, n_head, n_split, DEC_PART) -> o (B, n_head * 128) f32 and/or its q8_1 form
// oq, od, os (the o projection's operand: quantize_q8_1's bits, a warp per block of
// 32), merging the splits that hold keys 0..p; either output nullable;
// grid = (n_head, B), block = FA_HD.
// The merge: M = the splits' largest max, then L = sum of l_s * c_s and A = sum of
// a_s * c_s in split order, c_s = exp2(m_s - M). After 3,325 keys that is 52 splits,
// and a loop that loaded them one after another waited on L2 for each: the block
// loads a chunk of the splits' (m, l) at once (one split per thread), forms c_s
// once per split, and each thread loads DEC_AHEAD of its a_s before adding them,
// in the same order (the same bits).
#define DEC_AHEAD 16
extern "C" __global__ void __launch_bounds__(FA_HD)
attn_decode_combine(const float* __restrict__ part, float* __restrict__ o, i8* __restrict__ oq,
                    float* __restrict__ od, float* __restrict__ os, int n_split, int pos0,
                    const int* __restrict__ pos_dev) {
    GRID_DEPENDENCY();
    __shared__ float s_l[FA_HD], s_c[FA_HD], s_max[FA_HD / 32];
    const int b = blockIdx.y;
    const int used = min(n_split, ((pos_dev ? pos_dev[b] : pos0) + DEC_CHUNK) / DEC_CHUNK);
    const float* p = part + ((size_t)b * gridDim.x + blockIdx.x) * n_split * DEC_PART;
    offset_outputs(b, gridDim.x, o, oq, od, os);
    const int d = threadIdx.x;
    float M = DEC_NEG_INF;                                  // (a max: the order is free)
    for (int s = d; s < used; s += FA_HD) M = fmaxf(M, p[(size_t)s * DEC_PART]);
    for (int k = 16; k > 0; k >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, k));
    if (d % 32 == 0) s_max[d / 32] = M;
    __syncthreads();
    M = s_max[0];
    for (int w = 1; w < FA_HD / 32; ++w) M = fmaxf(M, s_max[w]);
    float L = 0.f, A = 0.f;
    for (int c0 = 0; c0 < used; c0 += FA_HD) {
        const int n = min(FA_HD, used - c0);
        if (d < n) {
            const float m = p[(size_t)(c0 + d) * DEC_PART];
            s_l[d] = p[(size_t)(c0 + d) * DEC_PART + 1];
            s_c[d] = exp2f(m - M);
        }
        __syncthreads();
        for (int s0 = 0; s0 < n; s0 += DEC_AHEAD) {
            float a[DEC_AHEAD];
#pragma unroll
            for (int u = 0; u < DEC_AHEAD; ++u)
                a[u] = s0 + u < n ? p[(size_t)(c0 + s0 + u) * DEC_PART + 2 + d] : 0.f;
#pragma unroll
            for (int u = 0; u < DEC_AHEAD; ++u) {
                if (s0 + u >= n) break;
                merge_split(L, A, s_l[s0 + u], a[u], s_c[s0 + u]);
            }
        }
        __syncthreads();                                    // before the next chunk's loads
    }
    store_head(A / L, blockIdx.x, d, o, oq, od, os);
}
