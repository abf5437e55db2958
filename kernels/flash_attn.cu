// Causal GQA flash attention on tensor cores (f16 inputs, f32 softmax and
// accumulation), head_dim 128, for prefill (FlashAttention-2's forward pass):
//   O[t, h, :] = sum_j softmax_j(Q[t,h,:] . K[j,kvh,:] / sqrt(128)) V[j,kvh,:]
//   over keys j = 0 .. pos0 + t,   kvh = h / G,   G = n_head / n_kv
//
// Work items: the G query heads of a KV head read the same keys, so their rows
// are flattened into one sequence per KV head, row = t*G + i for token t and
// head kvh*G + i (for a fixed t these G rows are adjacent in q and in o). A
// block takes FA_BQ = 128 consecutive rows of one KV head (~128/G tokens): each
// K/V tile it stages in shared memory serves 128 query rows, and as its rows
// span few positions little work is lost at the causal diagonal. Blocks take
// the items heaviest (last rows) first, the KV heads interleaved, so that the
// longest items start in the first wave and the lightest fill the tail
// (fa_item in flash_common.cuh, with the Q and K/V copies and the row store).
//
// Block = 4 warps of 32 rows (two m16 tiles each, sharing every K and V
// fragment the warp loads). Dynamic shared memory (FA_SMEM bytes): the block's
// Q (128 rows, loaded once) and two stages of a 64-key K tile and V tile.
// Tile j+1 is fetched by cp.async while tile j is computed, one __syncthreads
// per tile. Tiles past the block's last query position are never visited
// (causal skip); only tiles that reach past a warp's first query are masked.
// Per tile and warp: S = Q K^T (128 mma), online softmax, O += P V (128 mma).
//
// mma.m16n8k16 f16 fragments per lane (g = lane/4, t = lane%4), PTX ISA:
//   A (16x16, row): a[0] = A[g][2t..2t+1]   a[1] = A[g+8][2t..2t+1]
//                   a[2] = A[g][2t+8..+9]   a[3] = A[g+8][2t+8..+9]
//   B (16x8, col):  b[0] = B[2t..2t+1][g]   b[1] = B[2t+8..2t+9][g]
//   C (16x8 f32):   c[0..1] = C[g][2t, 2t+1]   c[2..3] = C[g+8][2t, 2t+1]
// ldmatrix.x4: lanes 8i..8i+7 give the row addresses of the 8x8 matrix M_i,
//   and r[i] of lane (g, t) = {M_i[g][2t], M_i[g][2t+1]}; with .trans
//   {M_i[2t][g], M_i[2t+1][g]}.
// S = Q K^T: A = Q rows by ldmatrix with M_0..3 = (rows 0-7, dims 0-7),
//   (rows 8-15, dims 0-7), (rows 0-7, dims 8-15), (rows 8-15, dims 8-15).
//   B[k][n] = K[key n][dim k]: b[0], b[1] are rows of the K tile at dims +0..7
//   and +8..15, so ldmatrix with M_0..3 = (keys 0-7, dims 0-7), (keys 0-7,
//   dims 8-15), (keys 8-15, dims 0-7), (keys 8-15, dims 8-15) gives b[0], b[1]
//   of two adjacent 8-key tiles.
// O += P V: A = P straight from the S accumulators (the C layout of two adjacent
//   8-key tiles is the A layout of one 16-key chunk), B[k][n] = V[key k][dim n]
//   via ldmatrix.trans from the row-major V tile.
// Softmax in the log2 domain: with c = log2(e)/sqrt(128) the running max is
// kept as m = c * max(s), and p = 2^(s c - m) is one FFMA and one MUFU.EX2.
// Shared rows are padded to 136 halves (272 B): the 8 rows of an 8x8 matrix
// start 4 banks apart, so ldmatrix is conflict-free.

#include "common.cuh"
#include "flash_common.cuh"

// FA_HD (head dim), FA_BQ (flattened query rows per block), FA_BK (keys per
// tile), FA_WARPS (32 rows each) and FA_SMEM (dynamic shared bytes the launch
// passes) come from nvrtc.py
#define FA_THREADS (32 * FA_WARPS)
#define FA_LD (FA_HD + 8)                        // shared row length in halves
#define FA_NT (FA_BK / 8)                        // 8-key tiles of S per tile
#define FA_KC (FA_HD / 16)                       // 16-dim chunks of Q K^T

static_assert(FA_HD == 128, "head dim 128");
static_assert(FA_BQ == 32 * FA_WARPS, "each warp owns two m16 tiles (32 rows)");
static_assert(FA_BK % 16 == 0 && (FA_BK * FA_HD / 8) % FA_THREADS == 0, "key tile");
static_assert(FA_SMEM == (FA_BQ + 4 * FA_BK) * FA_LD * 2, "shared layout: Q, 2 x (K, V)");

// D (16x8 f32) += A (16x16 f16, row) * B (16x8 f16, col)
__device__ __forceinline__ void mma_f16_16816(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(u32 r[4], const u16* smem_row) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(smem_row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], const u16* smem_row) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(smem_row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// The arguments (FA_ARGS, flash_common.cuh): q: (T, n_head, 128) f16; k_cache,
// v_cache: (n_ctx, n_kv, 128) f16 with positions 0 .. pos0+T-1 stored; o: (T, n_head*128) f32, or with o16 given the
// same values rounded to f16 there instead (cast_f32_f16's bits: the o
// projection's GEMM operand, without the f32 round trip and the cast's launch).
// scale_log2 = log2(e) / sqrt(128): probabilities are 2^(scale_log2 * (s - max)).
// grid: at least n_kv * ceil(T * G / FA_BQ) blocks in all, in any shape (the
//   linear block index picks the work item; spare blocks return at once);
// block: FA_THREADS threads, FA_SMEM bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(FA_THREADS, 2)
flash_attn_f16(FA_ARGS) {
    GRID_DEPENDENCY();
    extern __shared__ __align__(16) u16 fa_smem[];
    u16* const Qs = fa_smem;                          // (FA_BQ rows, FA_LD)
    u16* const KVs = fa_smem + FA_BQ * FA_LD;         // stage s: K at 2s, V at 2s+1

    FaItem it;
    if (!fa_item(it, q, o, o16, tab, T, pos0, n_head, n_kv, seqs, items)) return;
    const int G = it.G, row0 = it.row0;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const long long pos_stride = (long long)n_kv * FA_HD;       // halves between positions
    const u16* kb = k_cache + (long long)it.kvh * FA_HD;
    const u16* vb = v_cache + (long long)it.kvh * FA_HD;
    // a tile of shared rows of FA_LD halves: chunk c of row r at r * FA_LD + 8c
    auto padded = [](u16* tile) { return [tile](int r, int c) { return tile + r * FA_LD + c * 8; }; };

    fa_load_q<FA_THREADS>(padded(Qs), q, it, n_head);
    fa_load_kv<FA_THREADS>(padded(KVs), kb, pos_stride, tab, 0, it.n_keys);
    fa_load_kv<FA_THREADS>(padded(KVs + FA_BK * FA_LD), vb, pos_stride, tab, 0, it.n_keys);
    cp_commit();

    // this lane's rows: m-tile mt, half hf -> block row warp*32 + 16mt + 8hf + g
    const int warp_pos_min = pos0 + (row0 + warp * 32) / G;

    float acc[2][16][4];                              // O (32 rows, 128 dims): 16 n-tiles of 8
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int n = 0; n < 16; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.0f;
    float m[2][2], l[2][2];                           // running max (log2 domain), this lane's partial sums
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) m[mt][0] = m[mt][1] = FA_NEG_INF, l[mt][0] = l[mt][1] = 0.0f;

    // per-lane ldmatrix row addresses (see the header)
    const u16* qa_base = Qs + (warp * 32 + (lane & 15)) * FA_LD + (lane >> 4) * 8;
    const int k_off = ((lane & 7) + ((lane >> 4) << 3)) * FA_LD + ((lane >> 3) & 1) * 8;
    const int v_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * FA_LD + (lane >> 4) * 8;

    for (int j = 0; j < it.n_tiles; ++j) {
        const int k0 = j * FA_BK;
        cp_wait0();                                   // this thread's copies of tile j landed
        __syncthreads();                              // everyone's; and tile j-1's stage is free
        if (j + 1 < it.n_tiles) {
            u16* nxt = KVs + ((j + 1) & 1) * 2 * FA_BK * FA_LD;
            fa_load_kv<FA_THREADS>(padded(nxt), kb, pos_stride, tab, k0 + FA_BK, it.n_keys);
            fa_load_kv<FA_THREADS>(padded(nxt + FA_BK * FA_LD), vb, pos_stride, tab, k0 + FA_BK, it.n_keys);
            cp_commit();
        }
        const u16* Kt = KVs + (j & 1) * 2 * FA_BK * FA_LD;
        const u16* Vt = Kt + FA_BK * FA_LD;

        // S (32 x FA_BK) = Q K^T
        float s[2][FA_NT][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < FA_NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
#pragma unroll
        for (int kc = 0; kc < FA_KC; ++kc) {
            u32 qa[2][4];
            ldmatrix_x4(qa[0], qa_base + 16 * kc);
            ldmatrix_x4(qa[1], qa_base + 16 * FA_LD + 16 * kc);
#pragma unroll
            for (int np = 0; np < FA_NT / 2; ++np) {
                u32 kf[4];                            // b0, b1 of key tiles 2np and 2np+1
                ldmatrix_x4(kf, Kt + k_off + 16 * np * FA_LD + 16 * kc);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    mma_f16_16816(s[mt][2 * np], qa[mt], kf[0], kf[1]);
                    mma_f16_16816(s[mt][2 * np + 1], qa[mt], kf[2], kf[3]);
                }
            }
        }

        // causal mask, only where the tile reaches past this warp's first query
        if (k0 + FA_BK - 1 > warp_pos_min) {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int qp = pos0 + (row0 + warp * 32 + 16 * mt + 8 * hf + g) / G;
#pragma unroll
                    for (int nt = 0; nt < FA_NT; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            if (k0 + 8 * nt + 2 * t + e > qp) s[mt][nt][2 * hf + e] = FA_NEG_INF;
                }
        }

        // online softmax: the 4 lanes t = 0..3 of a quad share a row. Key 0 is
        // visible to every row and sits in tile 0, so after tile 0 every m is
        // finite and 2^(-inf) = 0 covers all masked keys.
        float mn[2][2];
        bool grew = false;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                float mx = FA_NEG_INF;
#pragma unroll
                for (int nt = 0; nt < FA_NT; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hf], s[mt][nt][2 * hf + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                mn[mt][hf] = fmaxf(m[mt][hf], mx * scale_log2);
                grew |= mn[mt][hf] != m[mt][hf];
            }
        // O and l need rescaling only when some row of the warp found a larger
        // max (alpha = 1 exactly otherwise): skipped once the maxima settle (a
        // dominant early key, as attention sinks are). Deciding it before the
        // exponentials leaves those and P V in one basic block, which the
        // scheduler interleaves (MUFU under the mma).
        if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const float al = fa_exp2(m[mt][hf] - mn[mt][hf]);     // 0 on tile 0
                    l[mt][hf] *= al;
#pragma unroll
                    for (int n = 0; n < 16; ++n) {
                        acc[mt][n][2 * hf] *= al;
                        acc[mt][n][2 * hf + 1] *= al;
                    }
                }
        }
        // p = 2^(s c - m), summed in f32 for the denominators, rounded to f16 as
        // A fragments: k-chunk kk = keys 16kk..16kk+15 = S tiles 2kk, 2kk+1
        u32 pa[2][FA_BK / 16][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                m[mt][hf] = mn[mt][hf];
                float rs = 0.0f;
#pragma unroll
                for (int nt = 0; nt < FA_NT; ++nt) {
                    s[mt][nt][2 * hf] = fa_exp2(fmaf(s[mt][nt][2 * hf], scale_log2, -mn[mt][hf]));
                    s[mt][nt][2 * hf + 1] = fa_exp2(fmaf(s[mt][nt][2 * hf + 1], scale_log2, -mn[mt][hf]));
                    rs += s[mt][nt][2 * hf] + s[mt][nt][2 * hf + 1];
                }
                l[mt][hf] += rs;
            }
#pragma unroll
            for (int kk = 0; kk < FA_BK / 16; ++kk) {
                pa[mt][kk][0] = fa_pack_f16x2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                pa[mt][kk][1] = fa_pack_f16x2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                pa[mt][kk][2] = fa_pack_f16x2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                pa[mt][kk][3] = fa_pack_f16x2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
        }

        // O += P V: ldmatrix.trans matrices 0..3 = (keys +0..7, dims +0..7),
        // (keys +8..15, dims +0..7), (keys +0..7, dims +8..15), (keys +8..15, dims +8..15)
        // -> b0, b1 of dim tile 2np and b0, b1 of dim tile 2np+1
#pragma unroll
        for (int kk = 0; kk < FA_BK / 16; ++kk) {
#pragma unroll
            for (int np = 0; np < 8; ++np) {
                u32 vf[4];
                ldmatrix_x4_trans(vf, Vt + v_off + 16 * kk * FA_LD + 16 * np);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    mma_f16_16816(acc[mt][2 * np], pa[mt][kk], vf[0], vf[1]);
                    mma_f16_16816(acc[mt][2 * np + 1], pa[mt][kk], vf[2], vf[3]);
                }
            }
        }
    }

#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
            fa_store_row(o, o16, it, n_head, row0 + warp * 32 + 16 * mt + 8 * hf + g, t, l[mt][hf],
                         [&](int n, int e) { return acc[mt][n][2 * hf + e]; });
}

#ifdef MINFER_SASS_INSTANTIATE
// No templates here: compiling the file already emits flash_attn_f16's SASS.
#endif
