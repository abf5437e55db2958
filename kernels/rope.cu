// Rotary position embedding, f32, from a precomputed table (mirrors ggml's
// rope_f32 / rope_neox_f32 with freq_scale 1, no YaRN):
//   theta(p, i) = p * base^(-2i/hd),  cs = (cos, sin)(theta) in cos_sin (n_pos, hd/2, 2),
//   computed on the host in float64 and rounded once to f32.
// NeoX (qwen2):  pairs (x[i], x[i + hd/2]);  normal (llama): pairs (x[2i], x[2i+1]).
//   (a, b) -> (a cos - b sin, a sin + b cos)
// One thread per pair; in place is allowed (each thread reads its pair before writing it).
#include "common.cuh"

// x, y (T, n_heads, hd); cos_sin (n_pos, hd/2, 2) with n_pos >= p + T, where the
// first position p = *pos_dev when given (a captured decode step), else pos0; with
// rows ((T, 2) int32: position, cache row; a batch of sequences) token t is at rows[2t];
// grid.x covers T * n_heads * hd/2 pairs
extern "C" __global__ void
rope_f32(const float* __restrict__ x, float* __restrict__ y, const float* __restrict__ cos_sin,
         int T, int n_heads, int hd, int pos0, const int* __restrict__ pos_dev, int neox,
         const int* __restrict__ rows) {
    GRID_DEPENDENCY();
    const int half = hd / 2;
    const long long n_pairs = (long long)T * n_heads * half;
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= n_pairs) return;
    const int i = (int)(g % half);
    const long long th = g / half;          // (t, head) row
    const int t = (int)(th / n_heads);
    const size_t base = (size_t)th * hd;
    const int ia = neox ? i : 2 * i;
    const int ib = neox ? i + half : 2 * i + 1;
    const int p = pos_dev ? *pos_dev : pos0;
    const float* cs = cos_sin + ((size_t)(rows ? rows[2 * t] : p + t) * half + i) * 2;
    const float c = cs[0], s = cs[1];
    float ya, yb;
    rope_rotate(x[base + ia], x[base + ib], c, s, &ya, &yb);
    y[base + ia] = ya;
    y[base + ib] = yb;
}
