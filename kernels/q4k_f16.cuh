// q4_K super-block groups to f16: the f16 engine's weight values, written by
// dequant_f16.cu's whole-weight dequantization and by gateup_sm90.cu's f16 kernel
// (the next layer's gate and up, dequantized beside its products). One definition,
// so both write the same bits.
#pragma once

#include "common.cuh"

// 8 f32 -> 8 f16 in one 16-byte store
__device__ __forceinline__ void store8_f16(u16* dst, const float v[8]) {
    *(uint4*)dst = make_uint4(f32x2_to_f16x2(v[0], v[1]), f32x2_to_f16x2(v[2], v[3]),
                              f32x2_to_f16x2(v[4], v[5]), f32x2_to_f16x2(v[6], v[7]));
}

// Group i of a q4_K weight (raw ggml blocks, 144 B: d | dmin | scales[12] | qs[128]):
// 16 groups a super-block b = i / 16; group c = i % 16 is the 8-element chunks c and
// c + 16 (elements 8c.. and 128+8c..). Elements 32j..32j+31 (sub-block j) are nibble
// (j&1) of qs[32*(j/2) .. +31], with 6-bit (sc, m) j of get_scale_min_k4: chunk c
// lies in sub-block j = c/4 (0..3), chunk c+16 in sub-block j+4, 64 qs bytes
// further, same nibble. The loads and the conversion are apart, so a caller can
// have several groups' loads in flight.
struct Q4kGroup {
    uint4 hdr;                   // d | dmin | scales[12]
    uint2 qa, qb;                // the nibble bytes of chunks c and c + 16
};

// group c (0..15) of the super-block at blk (16-byte aligned: 144 = 9*16)
__device__ __forceinline__ Q4kGroup q4k_group_at(const u8* blk, int c) {
    const int off = Q4K_QS + 32 * (c >> 3) + 8 * (c & 3);
    return {*(const uint4*)blk, *(const uint2*)(blk + off), *(const uint2*)(blk + off + 64)};
}

__device__ __forceinline__ Q4kGroup q4k_group_load(const u8* __restrict__ w, long long i) {
    return q4k_group_at(w + (i >> 4) * Q4K_BYTES, (int)(i & 15));
}

// byte k of v (any byte: a nibble 0..15, or 16 times one) as an exact f32, without an
// int-to-float conversion (a quarter-rate instruction): the byte placed in the
// mantissa of 2^23, 2^23 taken off
__device__ __forceinline__ float q4k_nibble_f32(u32 v, int k) {
    return __int_as_float(__byte_perm(v, 0x4B000000u, 0x7440 | k)) - 8388608.f;
}

// The group's 16 values f16((d*sc)*q - dmin*m) as NumPy computes them (the product,
// then the difference, each rounded to f32) into y (the weight's f16 form, row-major)
// at elements b*256 + 8c and + 128. d*sc and dmin*m are exact in f32 (an f16 times a
// 6-bit integer), and so is (d*sc)*q (at most 17 + 4 significant bits), so one fused
// multiply-add rounds exactly where the reference's subtraction does.
__device__ __forceinline__ void q4k_group_store(const Q4kGroup& g, u16* __restrict__ y, long long i) {
    const int c = (int)(i & 15);
    const int j = c >> 2;                                    // 0..3; the second chunk: j + 4
    const int shift = 4 * (j & 1);
    int sc_a, m_a, sc_b, m_b;                                // scales[k] = header byte 4 + k
    q4k_scale_min_words(g.hdr.y, g.hdr.z, g.hdr.w, j, sc_a, m_a);
    q4k_scale_min_words(g.hdr.y, g.hdr.z, g.hdr.w, j + 4, sc_b, m_b);
    const float d = f16_to_f32((u16)(g.hdr.x & 0xFFFF));
    const float dmin = f16_to_f32((u16)(g.hdr.x >> 16));
    const float dl_a = __fmul_rn(d, (float)sc_a), ml_a = __fmul_rn(dmin, (float)m_a);
    const float dl_b = __fmul_rn(d, (float)sc_b), ml_b = __fmul_rn(dmin, (float)m_b);
    const u32 qa[2] = {(g.qa.x >> shift) & 0x0F0F0F0Fu, (g.qa.y >> shift) & 0x0F0F0F0Fu};
    const u32 qb[2] = {(g.qb.x >> shift) & 0x0F0F0F0Fu, (g.qb.y >> shift) & 0x0F0F0F0Fu};

    float va[8], vb[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        va[k] = fmaf(dl_a, q4k_nibble_f32(qa[k >> 2], k & 3), -ml_a);
        vb[k] = fmaf(dl_b, q4k_nibble_f32(qb[k >> 2], k & 3), -ml_b);
    }
    u16* dst = y + (i >> 4) * QK_K + 8 * c;                  // 16-aligned
    store8_f16(dst, va);
    store8_f16(dst + 128, vb);
}

__device__ __forceinline__ void q4k_group_f16(const u8* __restrict__ w, u16* __restrict__ y, long long i) {
    q4k_group_store(q4k_group_load(w, i), y, i);
}
