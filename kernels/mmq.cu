// Int8 tensor-core GEMMs on quantized weights (ggml-cuda mmq.cuh's role):
//   y (T, od) f32 = x (T, K) @ W (od, K)^T [+ bias (od,)]
// with x given as q8_1 blocks of 32 (quantize.cu: int8 q, scale d_a, sum s_a =
// d_a*sum(q)) and W in its GGUF block format. The integer dot of every 16- or
// 32-element k-slice runs on mma.sync m16n8k16 s8*s8->s32 and is rescaled in f32.
//
// Tile geometry (both kernels): a CTA of 256 threads (8 warps) computes a
// BM=64 tokens x BN=64 weight rows tile of y; warp w owns tokens 16*(w%4)..+16
// and rows 32*(w/4)..+32 (four 16x8 mma tiles, 16 f32 accumulators per lane).
// K is walked in tiles of KDR*32 (KDR = 32-element k-chunks per pipeline tile;
// KDR divides 8, so a tile never straddles a 256-element super-block).
// Pipeline: NST=3 shared-memory stages, two tile copy groups in
// flight. Per tile: cp.async.wait_group 1 (wait_group 0 on the last tile), ONE
// __syncthreads (makes tile kt visible AND proves every warp finished reading
// the stage that tile kt+2 now overwrites), stage tile kt+2, compute tile kt.
// Activations always travel by cp.async; A and B copies of a tile are committed
// as ONE group.
#include "common.cuh"

// Shared-memory row stride of a staged tile: BK bytes + 16 (keeps the 16-byte
// alignment cp.async needs; 20-word stride makes the fragment loads conflict-free).
template <int KDR> struct Tile {
    static constexpr int BK = KDR * 32;      // k per tile
    static constexpr int SROW = BK + 16;     // bytes per staged row
    static constexpr int NC = BK / 16;       // 16-byte chunks per staged row
};

// A (activations) of tile k0: rows m0..m0+BM-1 of xq (T, K), async; rows >= T zero-filled.
template <int KDR>
__device__ __forceinline__ void stage_a(i8* sA, const i8* __restrict__ xq, int m0, int T, int K,
                                        int k0) {
    typedef Tile<KDR> TL;
    for (int g = threadIdx.x; g < MMQ_BM * TL::NC; g += MMQ_THREADS) {
        const int mm = g / TL::NC, cc = g % TL::NC;
        const int m = m0 + mm;
        const bool full = m < T;
        const i8* src = xq + (size_t)(full ? m : 0) * K + k0 + cc * 16;   // clamped: never read when !full
        cp16(sA + mm * TL::SROW + cc * 16, src, full);
    }
}

// One 16-deep k-step for a warp: a (16 tokens) x four 8-row B tiles -> int dots.
template <int KDR>
__device__ __forceinline__ void load_a(u32 a[2], const i8* sA, int row, int kk, int t) {
    typedef Tile<KDR> TL;
    a[0] = *(const u32*)(sA + row * TL::SROW + kk + 4 * t);
    a[1] = *(const u32*)(sA + (row + 8) * TL::SROW + kk + 4 * t);
}

template <int KDR>
__device__ __forceinline__ u32 load_b(const i8* sB, int row, int kk, int t) {
    typedef Tile<KDR> TL;
    return *(const u32*)(sB + row * TL::SROW + kk + 4 * t);
}

// Epilogue: lane's accumulators -> y (T, od), rows/cols past the edges not stored.
__device__ __forceinline__ void store_tile(float acc[4][4], float* __restrict__ y,
                                           const float* __restrict__ bias, int T, int od,
                                           int mrow, int ncol0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int m = mrow + (e >> 1) * 8;
            const int n = ncol0 + i * 8 + (e & 1);
            if (m < T && n < od)
                y[(size_t)m * od + n] = bias ? acc[i][e] + bias[n] : acc[i][e];
        }
    }
}

// The main loop both kernels run around their own staging and products, and the
// store of the result. A warp owns 16 tokens x 32 rows of the block's 64 x 64
// output tile (8 warps: 4 rows x 2 columns), a lane its place (g4, t4) in the
// m16n8 fragments and 16 f32 accumulators. Tiles are staged MMQ_NST deep by
// stage(kt, slot) (its cp.async copies one commit group a tile); each tile is
// waited for (the next may still fly), tile kt + 2 staged, then
// compute(slot, g4, t4, wrow, wcol, acc) adds the products of the tile that landed.
template <class Stage, class Compute>
__device__ __forceinline__ void mmq_main(int nkt, const Stage& stage, const Compute& compute,
                                         float* __restrict__ y, const float* __restrict__ bias,
                                         int T, int od, int m0, int n0) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g4 = lane / 4, t4 = lane % 4;
    const int wrow = (warp % 4) * 16, wcol = (warp / 4) * 32;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] = 0.0f;

    stage(0, 0);
    if (nkt > 1) stage(1, 1);
    for (int kt = 0; kt < nkt; ++kt) {
        if (kt + 1 < nkt) cp_wait1(); else cp_wait0();   // tile kt landed; kt+1 may fly
        __syncthreads();
        if (kt + 2 < nkt) stage(kt + 2, (kt + 2) % MMQ_NST);
        compute(kt % MMQ_NST, g4, t4, wrow, wcol, acc);
    }
    store_tile(acc, y, bias, T, od, m0 + wrow + g4, n0 + wcol + 2 * t4);
}

// --------------------------------------------------------------------------- //
// q4_K: 32-element sub-blocks, y += (d_a * d*sc_j) * dot(qa, qw) - (dmin*m_j) * s_a
// (ggml vec_dot_q4_K_q8_1's algebra: W = d*sc*q - dmin*m, x = d_a*qa).
// qw are the unsigned 4-bit values 0..15, staged as int8 (synchronous loads).
// --------------------------------------------------------------------------- //
// Occupancy 2 (not 3 like the q6_K kernel): the min term's extra scales need a
// few registers over the 80 that 3 blocks of 256 threads allow, and a spill is worse.
template <int KDR>
__global__ void __launch_bounds__(MMQ_THREADS, 2)
mmq_q4k(const i8* __restrict__ xq,      // (T, K) q8_1 values
        const float* __restrict__ xd,   // (T, K/32) d_a
        const float* __restrict__ xs,   // (T, K/32) s_a = d_a*sum(qa)
        const u8* __restrict__ W,       // (od, K/256*144) block_q4_K rows, as stored
        const float* __restrict__ bias, // (od,) or nullptr
        float* __restrict__ y,          // (T, od)
        int T, int od, int K) {
    GRID_DEPENDENCY();
    typedef Tile<KDR> TL;
    __shared__ __align__(16) i8 sA[MMQ_NST][MMQ_BM * TL::SROW];
    __shared__ __align__(16) i8 sB[MMQ_NST][MMQ_BN * TL::SROW];
    __shared__ float sDa[MMQ_NST][MMQ_BM * KDR];   // d_a per (token, chunk)
    __shared__ float sSa[MMQ_NST][MMQ_BM * KDR];   // s_a per (token, chunk)
    __shared__ float sDw[MMQ_NST][MMQ_BN * KDR];   // d*sc_j per (row, chunk)
    __shared__ float sMw[MMQ_NST][MMQ_BN * KDR];   // dmin*m_j per (row, chunk)

    const int m0 = blockIdx.y * MMQ_BM, n0 = blockIdx.x * MMQ_BN;
    const size_t row_bytes = (size_t)(K / QK_K) * Q4K_BYTES;

    auto stage = [&](int kt, int st) {
        const int k0 = kt * TL::BK, sb = k0 / QK_K, jbase = (k0 % QK_K) / 32;
        stage_a<KDR>(sA[st], xq, m0, T, K, k0);
        for (int g = threadIdx.x; g < MMQ_BN * TL::NC; g += MMQ_THREADS) {
            const int jj = g / TL::NC, cc = g % TL::NC, j = n0 + jj;
            uint4 v = make_uint4(0, 0, 0, 0);              // rows past od stage as zeros
            if (j < od) {
                // sub-block js = low (even) / high (odd) nibbles of qs[32*(js/2) .. +32]
                const int js = jbase + cc / 2, l0 = (cc % 2) * 16, sh = (js & 1) * 4;
                const uint4 q = *(const uint4*)(W + j * row_bytes + sb * Q4K_BYTES + Q4K_QS +
                                                (js / 2) * 32 + l0);
                v = make_uint4((q.x >> sh) & 0x0F0F0F0Fu, (q.y >> sh) & 0x0F0F0F0Fu,
                               (q.z >> sh) & 0x0F0F0F0Fu, (q.w >> sh) & 0x0F0F0F0Fu);
            }
            *(uint4*)(sB[st] + jj * TL::SROW + cc * 16) = v;
        }
        cp_commit();                                      // the tile's one copy group
        for (int g = threadIdx.x; g < MMQ_BM * KDR; g += MMQ_THREADS) {
            const int m = m0 + g / KDR, c = g % KDR;
            const size_t i = (size_t)m * (K / 32) + k0 / 32 + c;
            sDa[st][g] = m < T ? xd[i] : 0.0f;
            sSa[st][g] = m < T ? xs[i] : 0.0f;
        }
        for (int g = threadIdx.x; g < MMQ_BN * KDR; g += MMQ_THREADS) {
            const int j = n0 + g / KDR, c = g % KDR;
            float dsc = 0.0f, dm = 0.0f;
            if (j < od) {
                const u8* blk = W + j * row_bytes + sb * Q4K_BYTES;
                int sc, m;
                q4k_scale_min(jbase + c, blk + 4, &sc, &m);
                dsc = load_f16(blk) * (float)sc;
                dm = load_f16(blk + 2) * (float)m;
            }
            sDw[st][g] = dsc;
            sMw[st][g] = dm;
        }
    };

    mmq_main(K / TL::BK, stage, [&](const int st, const int g4, const int t4, const int wrow, const int wcol,
                             float (&acc)[4][4]) {
#pragma unroll 1
        for (int c = 0; c < KDR; ++c) {                  // not unrolled (left from a register squeeze; untuned)
            const float da0 = sDa[st][(wrow + g4) * KDR + c], da1 = sDa[st][(wrow + g4 + 8) * KDR + c];
            const float sa0 = sSa[st][(wrow + g4) * KDR + c], sa1 = sSa[st][(wrow + g4 + 8) * KDR + c];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int nb = wcol + i * 8;
                int dot[4] = {0, 0, 0, 0};
#pragma unroll
                for (int hs = 0; hs < 2; ++hs) {          // the 32-chunk as two k16 passes, one int sum
                    u32 a[2];
                    load_a<KDR>(a, sA[st], wrow + g4, c * 32 + hs * 16, t4);
                    mma_s8_16816(dot, a, load_b<KDR>(sB[st], nb + g4, c * 32 + hs * 16, t4));
                }
                const int r0 = (nb + 2 * t4) * KDR + c, r1 = r0 + KDR;
                const float dw0 = sDw[st][r0], dw1 = sDw[st][r1];
                const float mw0 = sMw[st][r0], mw1 = sMw[st][r1];
                acc[i][0] += (da0 * dw0) * (float)dot[0] - mw0 * sa0;
                acc[i][1] += (da0 * dw1) * (float)dot[1] - mw1 * sa0;
                acc[i][2] += (da1 * dw0) * (float)dot[2] - mw0 * sa1;
                acc[i][3] += (da1 * dw1) * (float)dot[3] - mw1 * sa1;
            }
        }
    }, y, bias, T, od, m0, n0);
}

// --------------------------------------------------------------------------- //
// q6_K "BT" kernel (the W_exp bundle). 16-element sub-blocks: one 32-k chunk spans
// two scales, so KSPLIT=2 m16n8k16 passes per chunk, each rescaled on its own:
// y += (d_a * d*sc_s) * dot(qa, qw); no min term. qw are the centered int8
// values ((ql | qh<<4) - 32) in -32..31.
//   EXP=false: B staged from the padded blocks (224-byte stride), expanded in
//              the kernel: ((ql>>shift)&0xF) | (((qh>>shift)&3)<<4) - 32.
//   EXP=true:  B staged as a pure cp.async copy out of the W_exp plane (od, K)
//              (row stride K = id, super-block stride 256), rows
//              past od zero-filled by src-size 0.
// Both stage the same bytes into the same layout and share the compute loop,
// so the two modes' outputs are bit-identical. Scales (dsc) always come from
// the padded blocks. `if (EXP)` is a template constant: EXP=false compiles to
// its own artifact without the plane path.
// --------------------------------------------------------------------------- //
template <int KDR, bool EXP>
__global__ void __launch_bounds__(MMQ_THREADS, 3)
mmq_q6k_bt(const i8* __restrict__ xq,      // (T, K) q8_1 values
           const float* __restrict__ xd,   // (T, K/32) d_a
           const u8* __restrict__ Wp,      // (od, K/256*224) padded block_q6_K rows
           const i8* __restrict__ Wexp,    // (od, K) W_exp plane (EXP=true only)
           const float* __restrict__ bias, // (od,) or nullptr
           float* __restrict__ y, int T, int od, int K) {   // y (T, od)
    GRID_DEPENDENCY();
    typedef Tile<KDR> TL;
    __shared__ __align__(16) i8 sA[MMQ_NST][MMQ_BM * TL::SROW];
    __shared__ __align__(16) i8 sB[MMQ_NST][MMQ_BN * TL::SROW];
    __shared__ float sDa[MMQ_NST][MMQ_BM * KDR];       // d_a per (token, chunk)
    __shared__ float sDw[MMQ_NST][MMQ_BN * 2 * KDR];   // d*sc_s per (row, sub-block)

    const size_t row_bytes = (size_t)(K / QK_K) * Q6K_PADDED;
    const int m0 = blockIdx.y * MMQ_BM, n0 = blockIdx.x * MMQ_BN;

    auto stage = [&](int kt, int st) {
        const int k0 = kt * TL::BK, sb = k0 / QK_K, cbase = (k0 % QK_K) / 32;
        stage_a<KDR>(sA[st], xq, m0, T, K, k0);
        for (int g = threadIdx.x; g < MMQ_BN * TL::NC; g += MMQ_THREADS) {
            const int jj = g / TL::NC, cc = g % TL::NC;
            const int j = n0 + jj;
            i8* dst = sB[st] + jj * TL::SROW + cc * 16;
            if (EXP) {
                // dense index: row stride id (= K), not the padded row length
                const bool full = j < od;
                const i8* src = Wexp + (size_t)(full ? j : 0) * K + (size_t)sb * QK_K + cbase * 32 + cc * 16;
                cp16(dst, src, full);
            } else {
                uint4 v = make_uint4(0, 0, 0, 0);          // rows past od stage as zeros
                if (j < od) {
                    // chunk c of the super-block: half h = c/4, quarter q = c%4;
                    // element l (0..31) = nibble q/2 of ql[64h + 32(q%2) + l] | 2-bit
                    // field 2q of qh[32h + l] << 4 (ggml dequantize_row_q6_K)
                    const int c = cbase + cc / 2, l0 = (cc % 2) * 16;
                    const int h = c / 4, q = c % 4, shl = (q / 2) * 4, shh = 2 * q;
                    const u8* blk = Wp + j * row_bytes + sb * Q6K_PADDED;
                    const uint4 ql = *(const uint4*)(blk + 64 * h + 32 * (q % 2) + l0);
                    const uint4 qh = *(const uint4*)(blk + Q6K_QH + 32 * h + l0);
                    // four bytes per word at once; __vsub4: bytewise -32 (wraps to int8)
                    v.x = __vsub4(((ql.x >> shl) & 0x0F0F0F0Fu) | (((qh.x >> shh) & 0x03030303u) << 4), 0x20202020u);
                    v.y = __vsub4(((ql.y >> shl) & 0x0F0F0F0Fu) | (((qh.y >> shh) & 0x03030303u) << 4), 0x20202020u);
                    v.z = __vsub4(((ql.z >> shl) & 0x0F0F0F0Fu) | (((qh.z >> shh) & 0x03030303u) << 4), 0x20202020u);
                    v.w = __vsub4(((ql.w >> shl) & 0x0F0F0F0Fu) | (((qh.w >> shh) & 0x03030303u) << 4), 0x20202020u);
                }
                *(uint4*)dst = v;
            }
        }
        cp_commit();                                      // A and B: ONE group per tile
        for (int g = threadIdx.x; g < MMQ_BM * KDR; g += MMQ_THREADS) {
            const int m = m0 + g / KDR, c = g % KDR;
            sDa[st][g] = m < T ? xd[(size_t)m * (K / 32) + k0 / 32 + c] : 0.0f;
        }
        for (int g = threadIdx.x; g < MMQ_BN * 2 * KDR; g += MMQ_THREADS) {
            const int j = n0 + g / (2 * KDR), s = g % (2 * KDR);
            float dsc = 0.0f;
            if (j < od) {
                const u8* blk = Wp + j * row_bytes + sb * Q6K_PADDED;
                dsc = load_f16(blk + Q6K_D) * (float)(i8)blk[Q6K_SC + 2 * cbase + s];
            }
            sDw[st][g] = dsc;
        }
    };

    mmq_main(K / TL::BK, stage, [&](const int st, const int g4, const int t4, const int wrow, const int wcol,
                             float (&acc)[4][4]) {
#pragma unroll
        for (int c = 0; c < KDR; ++c) {
            const float da0 = sDa[st][(wrow + g4) * KDR + c], da1 = sDa[st][(wrow + g4 + 8) * KDR + c];
#pragma unroll
            for (int hs = 0; hs < 2; ++hs) {              // KSPLIT=2: sub-block 2c+hs
                const int kk = c * 32 + hs * 16;
                u32 a[2];
                load_a<KDR>(a, sA[st], wrow + g4, kk, t4);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int nb = wcol + i * 8;
                    int dot[4] = {0, 0, 0, 0};
                    mma_s8_16816(dot, a, load_b<KDR>(sB[st], nb + g4, kk, t4));
                    const int r0 = (nb + 2 * t4) * 2 * KDR + 2 * c + hs, r1 = r0 + 2 * KDR;
                    const float dw0 = sDw[st][r0], dw1 = sDw[st][r1];
                    acc[i][0] += (da0 * dw0) * (float)dot[0];
                    acc[i][1] += (da0 * dw1) * (float)dot[1];
                    acc[i][2] += (da1 * dw0) * (float)dot[2];
                    acc[i][3] += (da1 * dw1) * (float)dot[3];
                }
            }
        }
    }, y, bias, T, od, m0, n0);
}

#ifdef MINFER_SASS_INSTANTIATE
// Offline builds only (scripts/check/sass_check.py: nvcc -cubin); NVRTC instantiates
// through name_expressions instead and never sees these.
template __global__ void mmq_q4k<MMQ_KDR>(const i8*, const float*, const float*, const u8*,
                                    const float*, float*, int, int, int);
template __global__ void mmq_q6k_bt<MMQ_KDR, true>(const i8*, const float*, const u8*, const i8*,
                                             const float*, float*, int, int, int);
template __global__ void mmq_q6k_bt<MMQ_KDR, false>(const i8*, const float*, const u8*, const i8*,
                                              const float*, float*, int, int, int);
#endif
