// The gate and up projections of a prompt's FFN and the SwiGLU between them, in one
// Hopper kernel (sm_90a: TMA, mbarriers, wgmma, setmaxnreg) that reads gate and up
// as q4_K blocks:
//   h[t, f] = f16(silu_mul(f16(sum_k G[f, k] x[t, k]), f16(sum_k U[f, k] x[t, k])))
// where every weight element is the f16 of dequant_f16.cu's value for it. That is
// what the f16 engine computes for the FFN (dequantize gate and up into the f16
// scratch, one cuBLAS GEMM with f16 output, swiglu_f16), bit for bit where cuBLAS
// sums a row's 16-wide products in k order as wgmma does (tests/gpu/test_gateup.py
// compares the two).
//
// Why: the f16 engine dequantizes each weight into the f16 scratch (2 bytes a weight
// written, then read by the GEMM) whatever the prompt's length; here each consumer
// thread turns the q4_K nibbles of its wgmma A fragments into f16 in registers
// while the previous k-tile's products run, and SwiGLU is applied before anything
// leaves the SM. A block converts its weight rows once for its 256 tokens, so the
// conversions cost ceil(T / 256) times the weight: with one or two nearly full block
// rows that is less than the dequantization, with more rows or a mostly empty last
// one it is more, and below ~128 tokens the conversions are most of the work
// (scripts/bench/ab.py re-measures it); paths.py's gateup_kernel decides the lengths.
//
// Block: 384 threads, one block an SM, a tile of 64 features f0.. of both weights x
// 256 tokens m0.. (or a half tile of 128 tokens in the grid's last wave: see the
// kernel's comment)
//   warpgroup 0: gate rows f0..f0+63, warpgroup 1: up rows f0..f0+63. wgmma
//     m64n256k16 (m64n128k16 for a half tile): A = the 64 rows' dequantized fragments
//     (registers), B = the X tile (tokens as N, K-major, 128-byte swizzle), 128 f32
//     accumulators a thread (64).
//   warpgroup 2: one thread issues the TMA copies. setmaxnreg hands its registers to
//     the consumers (40 a thread here, 232 there: the accumulators, two sets of A
//     fragments and the conversion fit without spills).
// A ring of GU_STAGES stages, one k-tile of 64 each: X (256 tokens x 64 f16, 32 KB,
// swizzled; a half tile fills the first 128 rows) | the q4_K headers (d, dmin, scales: 16 bytes) of the k-tile's
// super-block for gate's 64 rows, then up's | the k-tile's 32 nibble bytes of each
// row, gate's then up's. Per stage an mbarrier `full` (the copies' bytes have
// arrived) and `empty` (both consumer warpgroups are done with it).
//
// Epilogue: once both consumers are done with the ring, each writes its sums rounded
// to f16 as a [256 (128) tokens][64 features] tile into the ring's first 64 KB (16-byte
// chunks swizzled by token, so the fragment stores do not collide on banks); then
// the 256 consumer threads each take 16-byte chunks of a token's features: 8 gate
// and 8 up values in, 8 h values out, one 16-byte store.

#include "common.cuh"
#include "q4k_f16.cuh"
#include "wgmma.cuh"

#define GU_X_BYTES (GU_TOKENS * 128)               // X tile: GU_TOKENS rows of 64 halves
#define GU_H_BYTES (128 * 16)                      // headers: 128 rows (gate, up) x 16 B
#define GU_Q_BYTES (128 * 32)                      // nibbles: 128 rows x 32 B
#define GU_STAGE (GU_X_BYTES + GU_H_BYTES + GU_Q_BYTES)

static_assert(GU_THREADS == 384, "warpgroups 0, 1 consume (threads < 256), warpgroup 2 produces");
static_assert(GU_TOKENS == 256, "a whole tile is one wgmma m64n256 chain (256 tokens), a half tile m64n128");
static_assert(GU_FEATURES == 64, "a consumer warpgroup is wgmma's 64 rows");
static_assert(GU_STAGE % 1024 == 0, "each stage's X tile starts on a 1024-byte swizzle atom");
static_assert(GU_SMEM == GU_STAGES * GU_STAGE + 16 * GU_STAGES + 1024, "shared layout: ring, barriers, alignment");
static_assert(GU_STAGES * GU_STAGE >= 2 * GU_TOKENS * GU_FEATURES * 2, "the epilogue's tiles fit in the ring");

__device__ __forceinline__ u32 gu_smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// ---- mbarriers and TMA (PTX ISA: mbarrier, cp.async.bulk.tensor) ----------------
__device__ __forceinline__ void mb_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mb_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mb_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mb_wait(u32 bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
}
// box (c0, c1) of the 2-D tensor map `map` (in global memory) -> shared dst; the bytes
// count on mbarrier bar. Rows past the tensor's end arrive as zeros.
__device__ __forceinline__ void tma_load_2d(u32 dst, const void* map, int c0, int c1, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

// ---- wgmma ---------------------------------------------------------------------
// shared-memory matrix descriptor of a K-major tile with 128-byte swizzle: rows of
// 128 bytes, 8-row groups 1024 bytes apart
__device__ __forceinline__ u64 gu_desc(u32 saddr) { return wg_desc(saddr, 16, 1024); }

// d (64 rows x 256 tokens, f32) += A (64 x 16 f16, registers) * B (16 x 256, smem desc b)
__device__ __forceinline__ void gu_mma(float (&d)[128], const u32 (&a)[4], u64 b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
        WG_D128 "{%128,%129,%130,%131}, %132, 1, 1, 1, 0;\n"
        : WG_F32(d, 0), WG_F32(d, 32), WG_F32(d, 64), WG_F32(d, 96)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// the same for a 128-token tile: d (64 rows x 128 tokens) += A * B (16 x 128)
__device__ __forceinline__ void gu_mma(float (&d)[64], const u32 (&a)[4], u64 b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        WG_D64 "{%64,%65,%66,%67}, %68, 1, 1, 1, 0;\n"
        : WG_F32(d, 0), WG_F32(d, 32)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// ---- q4_K into A fragments -------------------------------------------------------
// One row's super-block header (16 bytes: d, dmin, the 12 scale bytes), with d and
// dmin as f32: read once for the super-block's four k-tiles
struct GuHeader { uint4 h; float d, dmin; };

__device__ __forceinline__ GuHeader gu_header(const u8* hdr, int r) {
    const uint4 h = *(const uint4*)(hdr + 16 * r);
    return {h, f16_to_f32(h.x & 0xFFFF), f16_to_f32(h.x >> 16)};
}

// The A fragments of k-tile j (0..3) of a super-block for rows r0 and r0 + 8 of the
// stage's 128 rows (their headers hd[0], hd[1]): a[kk] for the four k16 steps, in
// mma.m16n8k16's A layout (a0: row g, k 2t, 2t+1; a1: row g+8; a2: row g, k 2t+8,
// 2t+9; a3: row g+8, k 2t+8..). The k-tile is sub-blocks 2j (low nibbles of its 32
// bytes: k16 steps 0, 1) and 2j+1 (high nibbles: steps 2, 3). Each value is
// dequant_f16.cu's q4k_group_f16 value, f16(dl * q - ml) with dl = d * sc and ml =
// dmin * m: dl * q is exact in f32 (at most 17 + 4 significant bits), so the fused
// multiply-add rounds where the reference's subtraction does. The high nibbles stay
// in place (16 q) and meet dl / 16, exact as well. j is a constant at every call
// (the k-loop is unrolled by a super-block), so the scale unpacking folds to a few
// shifts and masks.
__device__ __forceinline__ void gu_fragments(const GuHeader (&hd)[2], const u8* qs, int r0, int t, int j,
                                             u32 (&a)[4][4]) {
#pragma unroll
    for (int h8 = 0; h8 < 2; ++h8) {
        const int r = r0 + 8 * h8;
        const u8* q = qs + 32 * r + 2 * t;
        const u32 w0 = (u32)*(const u16*)q | ((u32)*(const u16*)(q + 8) << 16);
        const u32 w1 = (u32)*(const u16*)(q + 16) | ((u32)*(const u16*)(q + 24) << 16);
        int sc_a, m_a, sc_b, m_b;
        q4k_scale_min_words(hd[h8].h.y, hd[h8].h.z, hd[h8].h.w, 2 * j, sc_a, m_a);
        q4k_scale_min_words(hd[h8].h.y, hd[h8].h.z, hd[h8].h.w, 2 * j + 1, sc_b, m_b);
        const float d = hd[h8].d, dmin = hd[h8].dmin;
        const float dl_a = __fmul_rn(d, (float)sc_a), ml_a = __fmul_rn(dmin, (float)m_a);
        const float dl_b16 = __fmul_rn(d, (float)sc_b) * 0.0625f, ml_b = __fmul_rn(dmin, (float)m_b);
        const u32 lo0 = w0 & 0x0F0F0F0Fu, lo1 = w1 & 0x0F0F0F0Fu;
        const u32 hi0 = w0 & 0xF0F0F0F0u, hi1 = w1 & 0xF0F0F0F0u;
#define GU_PAIR(dl, ml, v, k) \
    f32x2_to_f16x2(fmaf(dl, q4k_nibble_f32(v, k), -ml), fmaf(dl, q4k_nibble_f32(v, k + 1), -ml))
        a[0][h8] = GU_PAIR(dl_a, ml_a, lo0, 0);
        a[0][2 + h8] = GU_PAIR(dl_a, ml_a, lo0, 2);
        a[1][h8] = GU_PAIR(dl_a, ml_a, lo1, 0);
        a[1][2 + h8] = GU_PAIR(dl_a, ml_a, lo1, 2);
        a[2][h8] = GU_PAIR(dl_b16, ml_b, hi0, 0);
        a[2][2 + h8] = GU_PAIR(dl_b16, ml_b, hi0, 2);
        a[3][h8] = GU_PAIR(dl_b16, ml_b, hi1, 0);
        a[3][2 + h8] = GU_PAIR(dl_b16, ml_b, hi1, 2);
#undef GU_PAIR
    }
}

// byte offset of (token, feature) in an epilogue tile [256 or 128 tokens][64
// features] f16: the 16-byte chunk of 8 features swizzled by the token
__device__ __forceinline__ int gu_tile_at(int tok, int feat) {
    return tok * 128 + ((((feat >> 3) ^ tok) & 7) << 4) + 2 * (feat & 7);
}

// A consumer warpgroup's sums d (its 64 rows x NT tokens) rounded to f16 into `tile`, an
// [NT tokens][64 features] tile (gu_tile_at's layout)
template <int NT>
__device__ __forceinline__ void gu_park(u8* tile, const float (&d)[NT / 2]) {
    const int w = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    // d[4n + 2hh + e] = D[16w + 8hh + g][8n + 2t + e]: (feature, token)
#pragma unroll
    for (int n = 0; n < NT / 8; ++n)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                *(u16*)(tile + gu_tile_at(8 * n + 2 * t + e, 16 * w + 8 * hh + g)) = (u16)f16_bits_rn(d[4 * n + 2 * hh + e]);
}

// h for tokens m0.. (nt of them, those before T) and features f0.. from the parked
// tiles (gate's at `tiles`, up's GU_TOKENS * 128 bytes after), by NTHREADS threads
// (tid): each takes 16-byte chunks of a token's features, 8 gate and 8 up values in,
// 8 h values out, one 16-byte store
template <int NTHREADS>
__device__ __forceinline__ void gu_store_h(const u8* tiles, u16* __restrict__ h, int T, int d_ff, int f0, int m0,
                                           int nt, int tid) {
    const u8* gt = tiles;
    const u8* ut = tiles + GU_TOKENS * GU_FEATURES * 2;
#pragma unroll 2
    for (int i = tid; i < nt * 8; i += NTHREADS) {
        const int tok = i >> 3, chunk = i & 7;
        if (m0 + tok >= T) break;                   // i grows with the token
        const int at = gu_tile_at(tok, 8 * chunk);
        const uint4 gv = *(const uint4*)(gt + at), uv = *(const uint4*)(ut + at);
        const u32 gw[4] = {gv.x, gv.y, gv.z, gv.w}, uw[4] = {uv.x, uv.y, uv.z, uv.w};
        u32 o[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
            o[k] = swiglu_f16x2(gw[k], uw[k]);
        *(uint4*)(h + (long long)(m0 + tok) * d_ff + f0 + 8 * chunk) = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

// A consumer warpgroup of a tile of NT tokens (256, or 128 in a grid's last wave):
// the products of its weight's 64 rows (c: 0 gate, 1 up) with the stages' X tiles,
// then the epilogue (both warpgroups): h for tokens m0.. and features f0..
template <int NT>
__device__ __forceinline__ void gu_consume(u8* sm, u32 s_ring, u32 s_full, u32 s_empty, int nk, u16* __restrict__ h,
                                           int T, int d_ff, int f0, int m0) {
    const int c = threadIdx.x / 128, w = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4, r0 = 64 * c + 16 * w + g;     // c: 0 gate, 1 up
    float d[NT / 2];
#pragma unroll
    for (int i = 0; i < NT / 2; ++i) d[i] = 0.f;
    // the fragments of the k-tile in flight and of the next, by the k-tile's parity
    // (a super-block has four, so the roles swap without copies)
    u32 fr[2][4][4];
    GuHeader hd[2];
    mb_wait(s_full, 0);
    hd[0] = gu_header(sm + GU_X_BYTES, r0);
    hd[1] = gu_header(sm + GU_X_BYTES, r0 + 8);
    gu_fragments(hd, sm + GU_X_BYTES + GU_H_BYTES, r0, t, 0, fr[0]);
    int s = 0;                                      // the k-tile's stage
    u32 phase = 0;                                  // the parity of its current use
    for (int kt0 = 0; kt0 < nk; kt0 += 4) {         // a super-block (nk % 4 == 0)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int kt = kt0 + j;
            u32 (&a)[4][4] = fr[j & 1];
            const u64 desc = gu_desc(s_ring + s * GU_STAGE);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) gu_mma(d, a[kk], desc + 2 * kk);   // + 32 bytes
            wg_commit();
            const int s1 = s + 1 == GU_STAGES ? 0 : s + 1;
            const u32 phase1 = s1 == 0 ? phase ^ 1 : phase;
            if (kt + 1 < nk) {                      // the next k-tile's fragments meanwhile
                mb_wait(s_full + 8 * s1, phase1);
                const u8* st = sm + s1 * GU_STAGE + GU_X_BYTES;
                if (j == 3) {                       // the next super-block's headers
                    hd[0] = gu_header(st, r0);
                    hd[1] = gu_header(st, r0 + 8);
                }
                gu_fragments(hd, st + GU_H_BYTES, r0, t, (j + 1) & 3, fr[(j + 1) & 1]);
            }
            wg_wait<0>();
            // the products read `a` until here: its registers must not be reused before
            // (without this ptxas gave them to the next fragments' temporaries)
#pragma unroll
            for (int i = 0; i < 16; ++i) asm volatile("" ::"r"(a[i / 4][i % 4]) : "memory");
            if (threadIdx.x % 128 == 0) mb_arrive(s_empty + 8 * s);
            s = s1;
            phase = phase1;
        }
    }

    // epilogue: both warpgroups park their sums at the ring's start (gate's tile, then
    // up's), then all 256 threads store h
    asm volatile("bar.sync 1, 256;\n" ::: "memory");                  // the ring is free
    // the ring was last written by the copies and read by the products (the async
    // proxy); the generic stores below come after both
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    gu_park<NT>(sm + c * (GU_TOKENS * GU_FEATURES * 2), d);
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
    gu_store_h<256>(sm, h, T, d_ff, f0, m0, NT, threadIdx.x);
}

// The tile of work unit b (gateup_swiglu_q4k: block b): units 0 .. n_full-1 are whole
// tiles 0 .. n_full-1 (64 features x 256 tokens), each later unit half of one of the
// remaining tiles (128 tokens), so a last wave that would hold few whole tiles holds
// twice as many half tiles instead (the wrapper's tiling decides n_full:
// minfer/backend/cuda/kernels/gateup_sm90.py). Tiles are numbered by 256-token row
// first, then feature block: the blocks running at once cover a few feature blocks for
// every row, whose weight rows and X fit in L2; numbered the other way, they covered
// one row and 132 feature blocks, and every row read the whole weight from memory again
// (the f16 kernel at 3,325 tokens now reads 690 MB from DRAM for its 272 MB of weights,
// measured with ncu). A half tile may start past the prompt's end (m0 >= T).
struct GuTile { bool whole; int f0, m0; };

__device__ __forceinline__ GuTile gu_tile(int b, int n_full, int T) {
    const int rows = (T + GU_TOKENS - 1) / GU_TOKENS;
    const bool whole = b < n_full;
    const int tile = whole ? b : n_full + (b - n_full) / 2;
    return {whole, (tile / rows) * GU_FEATURES, (tile % rows) * GU_TOKENS + (whole ? 0 : (b - n_full) % 2 * (GU_TOKENS / 2))};
}

// xmaps: two 2-D tensor maps (CUtensorMap, 128 bytes each, in global memory) of X (T
// x K f16, 128-byte swizzle) in boxes of 64 x 256 and 64 x 128; wmaps: four more,
// gate's and then up's bytes (rows x K/256*144) in boxes of 16 x 64 (headers) and 32
// x 64 (nibbles). h: (T, d_ff) f16. K % 256 == 0.
// The tiles: gu_tile. grid n_full + 2 (tiles - n_full), block GU_THREADS, GU_SMEM bytes
// of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(GU_THREADS, 1)
gateup_swiglu_q4k(const u8* __restrict__ xmaps, const u8* __restrict__ wmaps, u16* __restrict__ h, int T,
                  int d_ff, int K, int n_full) {
    GRID_DEPENDENCY();
    const GuTile tl = gu_tile(blockIdx.x, n_full, T);
    const bool whole = tl.whole;
    const int f0 = tl.f0, m0 = tl.m0;
    if (m0 >= T) return;                            // a half tile past the prompt's end
    extern __shared__ u8 smem_raw[];
    u8* sm = smem_raw + ((1024 - (gu_smem(smem_raw) & 1023)) & 1023);
    const u32 s_ring = gu_smem(sm), s_full = s_ring + GU_STAGES * GU_STAGE, s_empty = s_full + 8 * GU_STAGES;
    const int nk = K / 64;
    if (threadIdx.x == 0) {
        for (int s = 0; s < GU_STAGES; ++s) { mb_init(s_full + 8 * s, 1); mb_init(s_empty + 8 * s, 2); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (threadIdx.x >= 256) {                       // the producer warpgroup
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (threadIdx.x == 256) {
            const u8* xmap = whole ? xmaps : xmaps + 128;
            const u32 bytes = whole ? GU_STAGE : GU_STAGE - GU_X_BYTES / 2;
            const u8 *gh = wmaps, *gq = wmaps + 128, *uh = wmaps + 256, *uq = wmaps + 384;
            for (int kt = 0; kt < nk; ++kt) {
                const int s = kt % GU_STAGES, use = kt / GU_STAGES;
                if (use > 0) mb_wait(s_empty + 8 * s, (use - 1) & 1);
                const u32 full = s_full + 8 * s, x = s_ring + s * GU_STAGE;
                const u32 hd = x + GU_X_BYTES, qd = hd + GU_H_BYTES;
                const int blk = (kt >> 2) * Q4K_BYTES, nib = blk + Q4K_QS + 32 * (kt & 3);
                mb_expect_tx(full, bytes);
                tma_load_2d(x, xmap, kt * 64, m0, full);
                tma_load_2d(hd, gh, blk, f0, full);
                tma_load_2d(hd + 64 * 16, uh, blk, f0, full);
                tma_load_2d(qd, gq, nib, f0, full);
                tma_load_2d(qd + 64 * 32, uq, nib, f0, full);
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    if (whole) gu_consume<GU_TOKENS>(sm, s_ring, s_full, s_empty, nk, h, T, d_ff, f0, m0);
    else gu_consume<GU_TOKENS / 2>(sm, s_ring, s_full, s_empty, nk, h, T, d_ff, f0, m0);
}

// ==== gate/up + SwiGLU from f16 weights, the next layer's q4_K gate/up alongside ====
// gateup_swiglu_f16: the same tiles, products and values, with gate's and up's rows
// already f16 (dequant_f16.cu's values, rows [gate; up] of one (2 d_ff, K) array)
// copied by TMA as wgmma's shared-memory A operand: no conversion in the k-loop.
// Persistent: one block an SM walks the work units b, b + grid, ... so that the
// epilogue of a tile overlaps the products of the next: the consumer warpgroups
// only park their sums as f16 tiles in an epilogue buffer of their own and go on,
// while three warps of the producer warpgroup apply SwiGLU and store h, and then
// dequantize a slice of the NEXT layer's gate and up (q4_K) into another (2 d_ff, K)
// array, so that dequantization leaves the critical path for every layer but the
// first (state.py keeps the two arrays, ffn.py decides who reads and writes which).
// Shared memory: a ring of GU16_STAGES stages of X (256 tokens x 64, 32 KB) | gate
// rows f0.. (64 x 64 f16, 8 KB) | up's (8 KB), 128-byte swizzled; the epilogue
// buffer (gate's and up's f16 tiles, gu_tile_at's layout, 64 KB); two buffers of the
// next pair's q4_K bytes; mbarriers full / empty a stage, epi_full (the 256 consumer
// threads' stores are in), epi_free (the 96 epilogue threads are done reading), and
// one a q4_K buffer (its bytes are in).
#define GU16_W_BYTES (GU_FEATURES * 128)
#define GU16_STAGE (GU_X_BYTES + 2 * GU16_W_BYTES)
#define GU16_EPI_BYTES (2 * GU_TOKENS * GU_FEATURES * 2)
#define GU16_EPI_THREADS 96                        // warps 1..3 of the producer warpgroup
#define GU16_AHEAD_BYTES (2 * GU16_AHEAD_SB * Q4K_BYTES)   // the next pair's two q4_K buffers
static_assert(GU16_STAGE % 1024 == 0, "each stage's tiles start on 1024-byte swizzle atoms");
static_assert((GU16_AHEAD_SB * Q4K_BYTES) % 16 == 0, "bulk copies move whole 16-byte units");
static_assert(GU16_SMEM == GU16_STAGES * GU16_STAGE + GU16_EPI_BYTES + GU16_AHEAD_BYTES + 8 * (2 * GU16_STAGES + 4) + 1024,
              "shared layout: ring, epilogue buffer, q4_K buffers, barriers, alignment");

// d (64 rows x 256 tokens, f32) += A (64 x 16, smem desc a) * B (16 x 256, smem desc b)
__device__ __forceinline__ void gu_mma_ss(float (&d)[128], u64 a, u64 b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
        WG_D128 "%128, %129, 1, 1, 1, 0, 0;\n"
        : WG_F32(d, 0), WG_F32(d, 32), WG_F32(d, 64), WG_F32(d, 96)
        : "l"(a), "l"(b));
}

// the same for a 128-token tile
__device__ __forceinline__ void gu_mma_ss(float (&d)[64], u64 a, u64 b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        WG_D64 "%64, %65, 1, 1, 1, 0, 0;\n"
        : WG_F32(d, 0), WG_F32(d, 32)
        : "l"(a), "l"(b));
}

// The ring's position: the stage of the next k-tile and the parity of its use, carried
// from tile to tile
struct GuRing { int s; u32 phase; };

__device__ __forceinline__ void gu_ring_next(GuRing& r) {
    if (++r.s == GU16_STAGES) { r.s = 0; r.phase ^= 1; }
}

// One tile of NT tokens for a consumer warpgroup (c: 0 gate, 1 up): the products, one
// k-tile's in flight while the next stage's are issued (a stage is released once the
// products after it are issued and its own are complete), then its sums as an f16
// tile into the epilogue buffer once the epilogue warps are done with the last one
// (`first`: there was none), and epi_full told.
template <int NT>
__device__ __forceinline__ void gu16_tile(u8* epi, u32 s_ring, u32 s_full, u32 s_empty, u32 s_epi_full,
                                          u32 s_epi_free, int nk, GuRing& ring, u32 epi_phase, bool first) {
    const int c = threadIdx.x / 128;
    float d[NT / 2];
#pragma unroll
    for (int i = 0; i < NT / 2; ++i) d[i] = 0.f;
    int prev = -1;
    for (int kt = 0; kt < nk; ++kt) {
        mb_wait(s_full + 8 * ring.s, ring.phase);
        const u32 st = s_ring + ring.s * GU16_STAGE;
        const u64 bd = gu_desc(st), ad = gu_desc(st + GU_X_BYTES + c * GU16_W_BYTES);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) gu_mma_ss(d, ad + 2 * kk, bd + 2 * kk);   // + 32 bytes
        wg_commit();
        wg_wait<1>();
        if (prev >= 0 && threadIdx.x % 128 == 0) mb_arrive(s_empty + 8 * prev);
        prev = ring.s;
        gu_ring_next(ring);
    }
    wg_wait<0>();
    if (threadIdx.x % 128 == 0) mb_arrive(s_empty + 8 * prev);
    if (!first) mb_wait(s_epi_free, epi_phase ^ 1);
    gu_park<NT>(epi + c * (GU_TOKENS * GU_FEATURES * 2), d);
    mb_arrive(s_epi_full);
}

// The next layer's gate and up, q4_K -> f16 rows [gate; up] of out: super-blocks
// [lo, hi) of the pair (gate's n_sb, then up's; super-block j of the pair is super-block
// j of out's rows), by the GU16_EPI_THREADS epilogue threads (tid). The q4_K bytes come
// in chunks of up to GU16_AHEAD_SB super-blocks by bulk copies (one thread issues
// them) into two shared buffers, so one chunk's copy is in flight while the last is
// converted: the conversion then waits on shared memory, not on a load from DRAM
// per group. Every chunk lies in one of the two weights. Bit k of `parity` is the
// parity of buffer k's fills so far (its mbarrier's), carried from call to call.
__device__ __forceinline__ void gu16_ahead(const u8* __restrict__ gate, const u8* __restrict__ up,
                                           u16* __restrict__ out, long long n_sb, long long lo, long long hi,
                                           u8* buf, u32 s_buf, u32 s_job, int tid, u32& parity) {
    auto chunk_end = [&](long long c0) {
        const long long e = c0 + GU16_AHEAD_SB < hi ? c0 + GU16_AHEAD_SB : hi;
        return c0 < n_sb && e > n_sb ? n_sb : e;
    };
    auto issue = [&](long long c0, int k) {         // chunk c0.. into buffer k (tid 0)
        const long long c1 = chunk_end(c0);
        const u8* src = c0 < n_sb ? gate + c0 * Q4K_BYTES : up + (c0 - n_sb) * Q4K_BYTES;
        const u32 bytes = (u32)(c1 - c0) * Q4K_BYTES, bar = s_job + 8 * k;
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   // after the reads of its last use
        mb_expect_tx(bar, bytes);
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(s_buf + k * GU16_AHEAD_SB * Q4K_BYTES), "l"(src), "r"(bytes), "r"(bar) : "memory");
    };
    if (lo >= hi) return;
    int k = 0;
    if (tid == 0) issue(lo, 0);
    for (long long c0 = lo; c0 < hi; k ^= 1) {
        const long long c1 = chunk_end(c0);
        if (tid == 0 && c1 < hi) issue(c1, k ^ 1);   // its buffer was released at the last bar.sync
        mb_wait(s_job + 8 * k, (parity >> k) & 1);
        parity ^= 1u << k;
        const u8* b = buf + k * GU16_AHEAD_SB * Q4K_BYTES;
        const int n_grp = (int)(c1 - c0) * 16;
        for (int gi = tid; gi < n_grp; gi += GU16_EPI_THREADS)
            q4k_group_store(q4k_group_at(b + (gi >> 4) * Q4K_BYTES, gi & 15), out, c0 * 16 + gi);
        asm volatile("bar.sync 2, %0;\n" ::"n"(GU16_EPI_THREADS) : "memory");   // buffer k read
        c0 = c1;
    }
}

// xmaps: X's two maps as for gateup_swiglu_q4k; wmap: one map of the f16 weights w16
// (2 d_ff rows [gate; up] x K, 128-byte swizzle) in boxes of 64 x 64. h: (T, d_ff)
// f16. n_units: n_full whole tiles + 2 (tiles - n_full) half tiles (gu_tile); block b
// takes units b, b + grid, ... ahead_gate / ahead_up: the next layer's gate and up
// (q4_K as stored, d_ff x K each), ahead_out: its (2 d_ff, K) f16 array (not w16),
// ahead_groups: d_ff K / 16, or 0 for none; block b dequantizes its 1/grid of their
// super-blocks, a slice after each of its tiles. K % 256 == 0. Grid <= n_units, or
// any grid when there is a next pair (a block without units only dequantizes); block
// GU_THREADS, GU16_SMEM bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(GU_THREADS, 1)
gateup_swiglu_f16(const u8* __restrict__ xmaps, const u8* __restrict__ wmap, u16* __restrict__ h, int T,
                  int d_ff, int K, int n_full, int n_units, const u8* __restrict__ ahead_gate,
                  const u8* __restrict__ ahead_up, u16* __restrict__ ahead_out, long long ahead_groups) {
    GRID_DEPENDENCY();
    extern __shared__ u8 smem_raw[];
    u8* sm = smem_raw + ((1024 - (gu_smem(smem_raw) & 1023)) & 1023);
    u8* epi = sm + GU16_STAGES * GU16_STAGE;
    u8* abuf = epi + GU16_EPI_BYTES;
    const u32 s_ring = gu_smem(sm), s_abuf = gu_smem(abuf), s_full = s_abuf + GU16_AHEAD_BYTES;
    const u32 s_empty = s_full + 8 * GU16_STAGES, s_epi_full = s_empty + 8 * GU16_STAGES, s_epi_free = s_epi_full + 8;
    const u32 s_job = s_epi_free + 8;
    const int nk = K / 64, b = blockIdx.x, G = gridDim.x;
    const int my_units = b < n_units ? (n_units - 1 - b) / G + 1 : 0;
    if (threadIdx.x == 0) {
        for (int s = 0; s < GU16_STAGES; ++s) { mb_init(s_full + 8 * s, 1); mb_init(s_empty + 8 * s, 2); }
        mb_init(s_epi_full, 256);
        mb_init(s_epi_free, GU16_EPI_THREADS);
        mb_init(s_job, 1);
        mb_init(s_job + 8, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (threadIdx.x >= 256) {                       // the producer warpgroup
        asm volatile("setmaxnreg.dec.sync.aligned.u32 88;\n");
        if (threadIdx.x == 256) {                   // the copies, k-tile after k-tile of each unit
            GuRing ring = {0, 0};
            int use = 0;                            // the ring's fills so far
            for (int i = 0; i < my_units; ++i) {
                const GuTile tl = gu_tile(b + i * G, n_full, T);
                const u8* xmap = tl.whole ? xmaps : xmaps + 128;
                const u32 bytes = tl.whole ? GU16_STAGE : GU16_STAGE - GU_X_BYTES / 2;
                for (int kt = 0; kt < nk; ++kt, ++use) {
                    if (use >= GU16_STAGES) mb_wait(s_empty + 8 * ring.s, ring.phase ^ 1);
                    const u32 full = s_full + 8 * ring.s, x = s_ring + ring.s * GU16_STAGE;
                    mb_expect_tx(full, bytes);
                    tma_load_2d(x, xmap, kt * 64, tl.m0, full);
                    tma_load_2d(x + GU_X_BYTES, wmap, kt * 64, tl.f0, full);
                    tma_load_2d(x + GU_X_BYTES + GU16_W_BYTES, wmap, kt * 64, d_ff + tl.f0, full);
                    gu_ring_next(ring);
                }
            }
        } else if (threadIdx.x >= 256 + 32) {       // the epilogues, then the next pair
            const int tid = threadIdx.x - (256 + 32);
            const long long n_sb = ahead_groups / 16, lo = 2 * n_sb * b / G, hi = 2 * n_sb * (b + 1) / G;
            u32 parity = 0;
            for (int i = 0; i < my_units; ++i) {
                const GuTile tl = gu_tile(b + i * G, n_full, T);
                mb_wait(s_epi_full, i & 1);
                gu_store_h<GU16_EPI_THREADS>(epi, h, T, d_ff, tl.f0, tl.m0, tl.whole ? GU_TOKENS : GU_TOKENS / 2, tid);
                mb_arrive(s_epi_free);
                gu16_ahead(ahead_gate, ahead_up, ahead_out, n_sb, lo + (hi - lo) * i / my_units,
                           lo + (hi - lo) * (i + 1) / my_units, abuf, s_abuf, s_job, tid, parity);
            }
            if (my_units == 0) gu16_ahead(ahead_gate, ahead_up, ahead_out, n_sb, lo, hi, abuf, s_abuf, s_job, tid, parity);
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 208;\n");
    GuRing ring = {0, 0};
    for (int i = 0; i < my_units; ++i) {
        const GuTile tl = gu_tile(b + i * G, n_full, T);
        if (tl.whole) gu16_tile<GU_TOKENS>(epi, s_ring, s_full, s_empty, s_epi_full, s_epi_free, nk, ring, i & 1, i == 0);
        else gu16_tile<GU_TOKENS / 2>(epi, s_ring, s_full, s_empty, s_epi_full, s_epi_free, nk, ring, i & 1, i == 0);
    }
}

#ifdef MINFER_SASS_INSTANTIATE
// Plain extern "C" kernels: compiling the file already emits their SASS.
#endif
