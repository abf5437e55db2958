// What the two prefill flash attentions (flash_attn.cu: mma.sync, any sm_80+;
// flash_attn_sm90.cu: wgmma, Hopper) share: the softmax's arithmetic, so that
// the same scores give the same probabilities in both; the work item a block
// takes, the copies of its Q rows and K/V tiles (each kernel says where a chunk
// goes in its shared layout), and the store of an output row.
#pragma once

#define FA_NEG_INF (-__int_as_float(0x7f800000))

// The arguments of both flash kernels (flash_attn.cu's flash_attn_f16 says what each is)
#define FA_ARGS                                                                           \
    const u16* __restrict__ q, const u16* __restrict__ k_cache, const u16* __restrict__ v_cache, \
    float* __restrict__ o, u16* __restrict__ o16, int T, int n_head, int n_kv, int pos0,      \
    float scale_log2, const int* __restrict__ seqs, const int* __restrict__ items,           \
    const int* __restrict__ tab

// f32 pair -> f16x2 (RNE) in one instruction, lo in the low half (= the lower k index)
__device__ __forceinline__ u32 fa_pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 2^x on the MUFU (flushes results below 2^-126 to 0: those probabilities are
// negligible next to the row's largest, which is 1); 2^-inf = 0
__device__ __forceinline__ float fa_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---- the work item, and the copies and the store that follow from it ----------
// FA_BQ, FA_BK and FA_HD come from nvrtc.py. A block takes FA_BQ consecutive
// flattened rows (row = t*G + i for token t and query head kvh*G + i) of one KV
// head of one sequence, the items heaviest (last rows) first with the KV heads
// interleaved, and walks the keys in tiles of FA_BK up to its last row's position.
//
// One sequence (items null): T tokens at positions pos0.., the cache rows through
// the block table tab (null: contiguous). A batch of sequences (FlashAttention's
// varlen layout): seqs (n_seq, 4) int32 = its first row in q and o, its tokens, the
// position of its first token, the offset of its block table in tab; items
// (T, 2) int32 = (sequence, first flattened row), T items, heaviest first (the
// wrapper orders them). A row's arithmetic depends only on its own sequence's keys
// and the fixed key tiles 0, FA_BK, ...: the same bits alone, batched or chunked
// (a tile past a row's position is masked whole: it adds exact zeros).
struct FaItem {
    int G;          // query heads per KV head
    int n_rows;     // flattened rows of a KV head: T * G
    int kvh;        // this block's KV head
    int row0;       // its first row
    int n_keys;     // keys stored: pos0 + T
    int n_tiles;    // key tiles it visits: those holding keys 0 .. pos0 + its last token
};

// the item of the block with this linear index, and its sequence: q, o, o16 moved
// to the sequence's first row, tab to its table, T and pos0 its own; false for a
// spare block (the grid may hold more blocks than items)
__device__ __forceinline__ bool fa_item(FaItem& it, const u16* __restrict__& q, float* __restrict__& o,
                                        u16* __restrict__& o16, const int* __restrict__& tab,
                                        int& T, int& pos0, int n_head, int n_kv,
                                        const int* __restrict__ seqs, const int* __restrict__ items) {
    it.G = n_head / n_kv;
    const int lin = blockIdx.x + gridDim.x * blockIdx.y;
    if (items) {
        if (lin >= T * n_kv) return false;
        const int* item = items + 2 * (lin / n_kv);
        const int* seq = seqs + 4 * item[0];
        const long long first = (long long)seq[0] * n_head * FA_HD;
        q += first;
        if (o) o += first;
        if (o16) o16 += first;
        tab += seq[3];
        T = seq[1];
        pos0 = seq[2];
        it.row0 = item[1];
    } else {
        const int n_items = (T * it.G + FA_BQ - 1) / FA_BQ;
        if (lin >= n_items * n_kv) return false;
        it.row0 = (n_items - 1 - lin / n_kv) * FA_BQ;
    }
    it.kvh = lin % n_kv;
    it.n_rows = T * it.G;
    it.n_keys = pos0 + T;
    const int last_tok = (min(it.row0 + FA_BQ, it.n_rows) - 1) / it.G;
    it.n_tiles = (pos0 + last_tok + FA_BK) / FA_BK;
    return true;
}

// The item's Q rows into shared memory: thread i copies the 16-byte chunk i % 16
// of rows i / 16 + (THREADS / 16) * n, walking (token, head) along; rows past
// n_rows are zero-filled (computed, never stored). dst(r, c): where chunk c
// (dims 8c..8c+7) of row r goes.
template <int THREADS, class Dst>
__device__ __forceinline__ void fa_load_q(Dst dst, const u16* __restrict__ q, const FaItem& it, int n_head) {
    const int r0 = threadIdx.x >> 4, c = threadIdx.x & 15;
    const int step = THREADS / 16, dtok = step / it.G, dhd = step % it.G;
    int tok = (it.row0 + r0) / it.G, hd = it.row0 + r0 - tok * it.G;
#pragma unroll
    for (int i = 0; i < FA_BQ / step; ++i) {
        const int r = r0 + i * step;
        cp16(dst(r, c), q + ((long long)tok * n_head + it.kvh * it.G + hd) * FA_HD + c * 8, it.row0 + r < it.n_rows);
        tok += dtok;
        hd += dhd;
        if (hd >= it.G) {
            hd -= it.G;
            ++tok;
        }
    }
}

// FA_BK keys k0.. of one KV head (rows of FA_HD halves, pos_stride halves apart
// from base, the head's first; key k at cache row kv_row(tab, k), the tile's rows
// consecutive) into shared memory: thread i copies chunk i % 16 of keys k0 + i / 16
// + (THREADS / 16) * n. Keys >= n_keys are zero-filled (src-size 0: nothing is read
// from their addresses), so masked probabilities (0) never meet garbage (0 * NaN).
// dst(key, c) as in fa_load_q.
static_assert(KV_BLOCK % FA_BK == 0, "a key tile lies in one block of a paged cache");
template <int THREADS, class Dst>
__device__ __forceinline__ void fa_load_kv(Dst dst, const u16* __restrict__ base, long long pos_stride,
                                           const int* __restrict__ tab, int k0, int n_keys) {
    const int r = threadIdx.x >> 4, c = threadIdx.x & 15;
    const u16* src = base + (kv_row(tab, k0) + r) * pos_stride + c * 8;      // this thread's first chunk
#pragma unroll
    for (int i = 0; i < FA_BK / (THREADS / 16); ++i) {
        const int key = i * (THREADS / 16) + r;
        cp16(dst(key, c), src + i * (THREADS / 16) * pos_stride, k0 + key < n_keys);
    }
}

// One output row of the block, from the 4 lanes (t = lane % 4) of a quad that hold
// it: l, this lane's partial sum of the probabilities; acc(n, e), its accumulator
// of dim 8n + 2t + e (n < 16). O = acc / (the quad's sum of l), stored in f32 at o,
// or with o16 given rounded to f16 there (cast_f32_f16's bits). Every lane of the
// warp calls it (the sum is a shuffle); rows past n_rows store nothing.
template <class Acc>
__device__ __forceinline__ void fa_store_row(float* __restrict__ o, u16* __restrict__ o16, const FaItem& it,
                                             int n_head, int row, int t, float l, Acc acc) {
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = 1.0f / l;
    if (row >= it.n_rows) return;
    const int tok = row / it.G;
    const long long at = (long long)tok * n_head * FA_HD + (it.kvh * it.G + row - tok * it.G) * FA_HD + 2 * t;
    if (o16) {
#pragma unroll
        for (int n = 0; n < 16; ++n) *(u32*)(o16 + at + 8 * n) = f32x2_to_f16x2(acc(n, 0) * inv, acc(n, 1) * inv);
    } else {
#pragma unroll
        for (int n = 0; n < 16; ++n) *(float2*)(o + at + 8 * n) = make_float2(acc(n, 0) * inv, acc(n, 1) * inv);
    }
}
