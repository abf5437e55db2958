// Causal GQA flash attention for Hopper (sm_90a: wgmma), head dim 128, prefill.
// Computes what flash_attn.cu computes, with the same work items, tiles and
// softmax arithmetic, so the two agree bit for bit where the tensor cores sum a
// 16-wide product the same way in mma.sync and wgmma (tests/gpu: compared):
//   O[t, h, :] = sum_j softmax_j(Q[t,h,:] . K[j,kvh,:] / sqrt(128)) V[j,kvh,:]
//
// Work items as in flash_attn.cu (flash_common.cuh's fa_item): the G query heads
// of a KV head flattened into rows t*G + i, a block takes FA_BQ = 128 of them
// (heaviest first) and walks the keys in tiles of FA_BK = 64 up to its last row's
// position.
//
// Why wgmma: with mma.sync every warp pulls its K and V fragments through the
// register file (ldmatrix), and a 32-row warp needs ~255 registers, so an SM
// holds 8 warps and the tensor pipe idles on their latencies (measured with ncu).
// wgmma reads both operands of S = Q K^T and the V operand of O += P V straight
// from shared memory, asynchronously, for a warpgroup (4 warps, 64 rows) at a
// time; its accumulators (64 registers of O, 32 of S a thread) leave the kernel
// at 128 registers, so two blocks (16 warps) fit an SM and one warpgroup's
// softmax runs while another's products do.
//
// Block = FA90_WG warpgroups of 64 rows. Shared memory (FA90_SMEM bytes,
// 1024-aligned inside): Q (FA_BQ rows), then two stages of a K tile and a V
// tile (FA_BK rows each), every tile stored as two panels (dims 0-63, 64-127)
// of 128-byte rows with the 128-byte swizzle wgmma reads: the 16-byte chunk c
// of row r sits at chunk position c ^ (r % 8) of its row. Tile j+1 is fetched
// by cp.async while tile j is computed, as in flash_attn.cu; its copies are
// issued once the S products are under way, so the tensor cores start first.
//
// wgmma operands (PTX ISA, "asynchronous warpgroup level matrix"):
//   S (64 x 64 f32, m64n64k16 x 8 steps of 16 dims): A = Q rows, B = K rows,
//     both K-major (the dims contiguous): descriptor start = panel + row*128 +
//     32*(step % 4), stride between 8-row groups (SBO) 1024 bytes.
//   O (64 x 128 f32, m64n128k16 x 4 steps of 16 keys): A = P from registers,
//     B = V tile MN-major (dims contiguous, "transposed"): start = tile +
//     16 keys * 128 bytes * step, LBO = the panel (the next 64 dims), SBO =
//     1024 bytes (the next 8 keys).
//   Accumulators per thread (warp w of the warpgroup, g = lane/4, t = lane%4):
//     d[4n + 2h + e] = D[16w + 8h + g][8n + 2t + e], the layout of mma.sync's
//     C tiles side by side, so the softmax is flash_attn.cu's with its n-tiles;
//     P's A registers for keys 16kk.. are S's tiles 2kk and 2kk+1 packed.
// The smem tiles are written by cp.async (the generic proxy) and read by wgmma
// (the async proxy): a fence.proxy.async between the copies' wait and the
// barrier makes them visible. Registers a wgmma reads or accumulates into are
// pinned around it (fw_pin) so the compiler cannot move their uses across the
// wgmma.fence / wait_group pair.

#include "common.cuh"
#include "flash_common.cuh"
#include "wgmma.cuh"

// FA_HD, FA_BQ, FA_BK (as flash_attn.cu), FA90_WG (warpgroups a block) and
// FA90_SMEM (dynamic shared bytes the launch passes) come from nvrtc.py
#define FW_THREADS (128 * FA90_WG)
#define FW_Q_PANEL (FA_BQ * 128)                 // bytes of one 64-dim panel of Q
#define FW_KV_PANEL (FA_BK * 128)                // ... of a K or V tile
#define FW_Q_BYTES (2 * FW_Q_PANEL)
#define FW_KV_BYTES (2 * FW_KV_PANEL)

static_assert(FA_HD == 128, "head dim 128: two 64-dim panels");
static_assert(FA_BQ == 64 * FA90_WG, "a warpgroup owns 64 rows");
static_assert(FA_BK == 64, "S is one m64n64 wgmma chain; P feeds four k16 steps");
static_assert(FA90_SMEM == FW_Q_BYTES + 4 * FW_KV_BYTES + 1024, "shared layout: Q, 2 x (K, V), alignment");

// byte offset of 16-byte chunk c (dims 8c..8c+7) of row r in a two-panel tile
__device__ __forceinline__ int fw_chunk(int panel_bytes, int r, int c) {
    return (c >> 3) * panel_bytes + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// x, hidden from the optimizer: a descriptor made in the loop from it is not hoisted
// out (eight 64-bit values kept live across the loop spill at 128 registers)
__device__ __forceinline__ u64 fw_opaque(u64 x) {
    u64 y;
    asm volatile("mov.b64 %0, %1;" : "=l"(y) : "l"(x));
    return y;
}

__device__ __forceinline__ void fw_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void fw_pin(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// d (64x64 f32) += A (64x16, smem desc a) * B (16x64, smem desc b, K-major)
__device__ __forceinline__ void fw_mma_s(float (&d)[32], u64 a, u64 b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        WG_D32 "%32, %33, p, 1, 1, 0, 0;\n}\n"
        : WG_F32(d, 0)
        : "l"(a), "l"(b), "r"(1));
}

// d (64x128 f32) += A (64x16 f16, registers) * B (16x128, smem desc b, MN-major)
__device__ __forceinline__ void fw_mma_o(float (&d)[64], const u32 (&a)[4], u64 b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        WG_D64 "{%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
        : WG_F32(d, 0), WG_F32(d, 32)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// Arguments, grid and results as flash_attn_f16 (flash_attn.cu); block:
// FW_THREADS threads, FA90_SMEM bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(FW_THREADS, 2)
flash_attn_f16_sm90(FA_ARGS) {
    GRID_DEPENDENCY();
    extern __shared__ __align__(16) u8 fw_smem[];
    const unsigned raw = (unsigned)__cvta_generic_to_shared(fw_smem);
    const unsigned pad = (1024u - (raw & 1023u)) & 1023u;        // swizzle atoms: 1024-aligned
    u8* const sm = fw_smem + pad;
    const unsigned s_q = raw + pad, s_kv = s_q + FW_Q_BYTES;     // shared addresses

    FaItem it;
    if (!fa_item(it, q, o, o16, tab, T, pos0, n_head, n_kv, seqs, items)) return;

    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const long long pos_stride = (long long)n_kv * FA_HD;
    const u16* kb = k_cache + (long long)it.kvh * FA_HD;
    const u16* vb = v_cache + (long long)it.kvh * FA_HD;
    // a swizzled tile of two panels (panel bytes each): chunk c of row r at fw_chunk
    auto swizzled = [](u8* tile, int panel) {
        return [tile, panel](int r, int c) { return tile + fw_chunk(panel, r, c); };
    };

    fa_load_q<FW_THREADS>(swizzled(sm, FW_Q_PANEL), q, it, n_head);
    fa_load_kv<FW_THREADS>(swizzled(sm + FW_Q_BYTES, FW_KV_PANEL), kb, pos_stride, tab, 0, it.n_keys);
    fa_load_kv<FW_THREADS>(swizzled(sm + FW_Q_BYTES + FW_KV_BYTES, FW_KV_PANEL), vb, pos_stride, tab, 0, it.n_keys);
    cp_commit();

    // this thread's rows: h -> block row 64wg + 16warp + 8h + g
    const int warp_row0 = it.row0 + wg * 64 + warp * 16;
    const int warp_pos_min = pos0 + warp_row0 / it.G;
    const unsigned s_qa = s_q + (wg * 64) * 128;                // this warpgroup's Q rows

    float acc[64];                                    // O (64 rows, 128 dims)
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    float m[2] = {FA_NEG_INF, FA_NEG_INF}, l[2] = {0.0f, 0.0f};

    for (int j = 0; j < it.n_tiles; ++j) {
        const int k0 = j * FA_BK;
        cp_wait0();                                   // this thread's copies of tile j landed
        fw_proxy_fence();                             // ... and are visible to wgmma
        __syncthreads();                              // everyone's; and tile j-1's stage is free
        const unsigned s_k = s_kv + (j & 1) * 2 * FW_KV_BYTES, s_v = s_k + FW_KV_BYTES;

        // S (64 x FA_BK) = Q K^T
        float s[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] = 0.0f;
        fw_pin(s);
        wg_fence();
        {
            const u64 da = fw_opaque(wg_desc(s_qa, 16, 1024)), db = wg_desc(s_k, 16, 1024);
#pragma unroll
            for (int kc = 0; kc < FA_HD / 16; ++kc) {
                const unsigned in = (kc & 3) * 32;    // 16 dims = 32 bytes into the swizzled row
                fw_mma_s(s, da + (((kc >> 2) * FW_Q_PANEL + in) >> 4), db + (((kc >> 2) * FW_KV_PANEL + in) >> 4));
            }
        }
        wg_commit();
        if (j + 1 < it.n_tiles) {                     // the next tile's copies, behind the products
            u8* nxt = sm + FW_Q_BYTES + ((j + 1) & 1) * 2 * FW_KV_BYTES;
            fa_load_kv<FW_THREADS>(swizzled(nxt, FW_KV_PANEL), kb, pos_stride, tab, k0 + FA_BK, it.n_keys);
            fa_load_kv<FW_THREADS>(swizzled(nxt + FW_KV_BYTES, FW_KV_PANEL), vb, pos_stride, tab, k0 + FA_BK, it.n_keys);
            cp_commit();
        }
        wg_wait<0>();
        fw_pin(s);

        // causal mask, only where the tile reaches past this warp's first query
        if (k0 + FA_BK - 1 > warp_pos_min) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                // key k0 + 8nt + 2t + e is past this row's position qp when 8nt + e > lim
                const int lim = pos0 + (warp_row0 + 8 * hf + g) / it.G - k0 - 2 * t;
#pragma unroll
                for (int nt = 0; nt < FA_BK / 8; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (8 * nt + e > lim) s[4 * nt + 2 * hf + e] = FA_NEG_INF;
            }
        }

        // online softmax, flash_attn.cu's arithmetic and order (see there)
        float mn[2];
        bool grew = false;
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            float mx = FA_NEG_INF;
#pragma unroll
            for (int nt = 0; nt < FA_BK / 8; ++nt) mx = fmaxf(mx, fmaxf(s[4 * nt + 2 * hf], s[4 * nt + 2 * hf + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            mn[hf] = fmaxf(m[hf], mx * scale_log2);
            grew |= mn[hf] != m[hf];
        }
        if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const float al = fa_exp2(m[hf] - mn[hf]);
                l[hf] *= al;
#pragma unroll
                for (int n = 0; n < 16; ++n) {
                    acc[4 * n + 2 * hf] *= al;
                    acc[4 * n + 2 * hf + 1] *= al;
                }
            }
        }
        u32 pa[FA_BK / 16][4];
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            m[hf] = mn[hf];
            float rs = 0.0f;
#pragma unroll
            for (int nt = 0; nt < FA_BK / 8; ++nt) {
                s[4 * nt + 2 * hf] = fa_exp2(fmaf(s[4 * nt + 2 * hf], scale_log2, -mn[hf]));
                s[4 * nt + 2 * hf + 1] = fa_exp2(fmaf(s[4 * nt + 2 * hf + 1], scale_log2, -mn[hf]));
                rs += s[4 * nt + 2 * hf] + s[4 * nt + 2 * hf + 1];
            }
            l[hf] += rs;
        }
#pragma unroll
        for (int kk = 0; kk < FA_BK / 16; ++kk) {
            pa[kk][0] = fa_pack_f16x2(s[8 * kk + 0], s[8 * kk + 1]);
            pa[kk][1] = fa_pack_f16x2(s[8 * kk + 2], s[8 * kk + 3]);
            pa[kk][2] = fa_pack_f16x2(s[8 * kk + 4], s[8 * kk + 5]);
            pa[kk][3] = fa_pack_f16x2(s[8 * kk + 6], s[8 * kk + 7]);
        }

        // O += P V
        fw_pin(acc);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < FA_BK / 16; ++kk)
            fw_mma_o(acc, pa[kk], wg_desc(s_v + kk * 16 * 128, FW_KV_PANEL, 1024));
        wg_commit();
        wg_wait<0>();
        fw_pin(acc);
    }

#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
        fa_store_row(o, o16, it, n_head, warp_row0 + 8 * hf + g, t, l[hf],
                     [&](int n, int e) { return acc[4 * n + 2 * hf + e]; });
}
