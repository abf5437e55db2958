// The group decoders of the quantization types read in 32-element groups: Q4_0,
// Q4_1, Q5_0, Q5_1, Q8_0 (one group per block) and Q5_K (eight per 256-element
// super-block). A decoder gives a group's 32 quants as int8 lanes of eight words
// (u), its zero point z and the affine map of ggml's dequantizer,
//   y = a * (u - z) [+ b]          (f32, each operation rounded on its own)
// Template argument: the ggml type id (Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q5_K 13).
// Weights are stored as in the file (rows of blocks, no padding); a group g of
// the flattened weight is group g % G of block g / G (G groups per block).
// Included by quants32.cu (dequantization) and matvec.cu (the decode matvec, where
// a group's dot is the integer dot sum(u*xq) - z*sum(xq) (dp4a) rescaled once:
// a * d_a * dot [+ b * s_a]).
#pragma once
#include "common.cuh"

struct Group {
    u32 u[8];         // 32 quants, byte e of word e/4 = element e
    int z;            // zero point subtracted from every quant
    float a, b;       // y = a * (u - z) + b  (b = 0: no offset term)
    bool has_b;
};

__device__ __forceinline__ u32 ld_u16x2(const u8* p) {          // 2-byte aligned 32-bit load
    return (u32)*(const u16*)p | ((u32)*(const u16*)(p + 2) << 16);
}

// nibbles of 16 bytes q (as 4 words) -> u[0..3] = low nibbles, u[4..7] = high nibbles
__device__ __forceinline__ void nibbles(const u32 w[4], u32 u[8]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u[k] = w[k] & 0x0F0F0F0Fu;
        u[k + 4] = (w[k] >> 4) & 0x0F0F0F0Fu;
    }
}

// bits 0..31 of qh -> bit 4 of byte e (element e), or'ed into u
__device__ __forceinline__ void fifth_bits(u32 qh, u32 u[8]) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const u32 b = (qh >> (4 * k)) & 0xF;          // bits for elements 4k..4k+3
        u[k] |= ((b & 1) << 4) | ((b & 2) << 11) | ((b & 4) << 18) | ((b & 8) << 25);
    }
}

template <int QT> struct Fmt;
template <> struct Fmt<2> { static constexpr int BYTES = 18, G = 1; };    // Q4_0: d | qs[16]
template <> struct Fmt<3> { static constexpr int BYTES = 20, G = 1; };    // Q4_1: d m | qs[16]
template <> struct Fmt<6> { static constexpr int BYTES = 22, G = 1; };    // Q5_0: d | qh[4] | qs[16]
template <> struct Fmt<7> { static constexpr int BYTES = 24, G = 1; };    // Q5_1: d m | qh[4] | qs[16]
template <> struct Fmt<8> { static constexpr int BYTES = 34, G = 1; };    // Q8_0: d | qs[32] int8
template <> struct Fmt<13> { static constexpr int BYTES = 176, G = 8; };  // Q5_K: d dmin | sc[12] | qh[32] | qs[128]

template <int QT>
__device__ __forceinline__ Group decode(const u8* __restrict__ W, long long g) {
    const u8* blk = W + (g / Fmt<QT>::G) * Fmt<QT>::BYTES;
    Group r;
    r.b = 0.0f;
    r.has_b = false;
    r.z = 0;
    if constexpr (QT == 2 || QT == 6) {                        // Q4_0, Q5_0: d * (q - z)
        const int qs = QT == 2 ? 2 : 6;
        const u32 w[4] = {ld_u16x2(blk + qs), ld_u16x2(blk + qs + 4), ld_u16x2(blk + qs + 8),
                          ld_u16x2(blk + qs + 12)};
        nibbles(w, r.u);
        if constexpr (QT == 6) fifth_bits(ld_u16x2(blk + 2), r.u);
        r.z = QT == 2 ? 8 : 16;
        r.a = load_f16(blk);
    } else if constexpr (QT == 3 || QT == 7) {                 // Q4_1, Q5_1: d * q + m
        const int qs = QT == 3 ? 4 : 8;                     // 20-byte Q4_1 blocks: 4-byte alignment
        const u32* q32 = (const u32*)(blk + qs);
        const u32 w[4] = {q32[0], q32[1], q32[2], q32[3]};
        nibbles(w, r.u);
        if constexpr (QT == 7) fifth_bits(*(const u32*)(blk + 4), r.u);
        r.a = load_f16(blk);
        r.b = load_f16(blk + 2);
        r.has_b = true;
    } else if constexpr (QT == 8) {                            // Q8_0: q * d
#pragma unroll
        for (int k = 0; k < 8; ++k) r.u[k] = ld_u16x2(blk + 2 + 4 * k);
        r.a = load_f16(blk);
    } else {                                                   // Q5_K: (d*sc) * q - (dmin*m)
        const int j = (int)(g % 8);                            // sub-block
        int sc, m;
        q4k_scale_min(j, blk + 4, &sc, &m);
        const uint4 qa = *(const uint4*)(blk + 48 + 32 * (j / 2));
        const uint4 qb = *(const uint4*)(blk + 48 + 32 * (j / 2) + 16);
        const u32 w[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
        const int sh = 4 * (j & 1);
#pragma unroll
        for (int k = 0; k < 8; ++k) r.u[k] = (w[k] >> sh) & 0x0F0F0F0Fu;
        // bit j of qh[l] is the fifth bit of element l of sub-block j
        const uint4 ha = *(const uint4*)(blk + 16), hb = *(const uint4*)(blk + 32);
        const u32 h[8] = {ha.x, ha.y, ha.z, ha.w, hb.x, hb.y, hb.z, hb.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) r.u[k] |= ((h[k] >> j) & 0x01010101u) << 4;
        r.a = __fmul_rn(load_f16(blk), (float)sc);
        r.b = -__fmul_rn(load_f16(blk + 2), (float)m);
        r.has_b = true;
    }
    return r;
}

// element e of a decoded group, as ggml's dequantizer rounds it
__device__ __forceinline__ float value(const Group& r, int e) {
    const int q = (int)(i8)((r.u[e >> 2] >> (8 * (e & 3))) & 0xFF) - r.z;
    const float y = __fmul_rn(r.a, (float)q);
    return r.has_b ? __fadd_rn(y, r.b) : y;
}

// sum of the byte-wise int8 products of 8 words and 32 bytes of x
__device__ __forceinline__ int dot32(const u32 u[8], uint4 x0, uint4 x1) {
    const u32 xs[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    int s = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) s = __dp4a((int)u[k], (int)xs[k], s);
    return s;
}
