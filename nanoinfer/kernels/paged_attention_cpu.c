/* Paged decode attention on the CPU: one query token per sequence, K/V read in place from the block
 * cache (no gather, no padding), each block streamed once, front to back, for all heads of its sequence.
 * Built with -fopenmp after torch is loaded, so it shares torch's OpenMP threads instead of fighting them. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp for x <= 0, vectorisable (libm's expf is not without -ffast-math, whose startup code would flush
 * denormals for the whole process): 2^n * p(r) with |r| <= ln2/2, relative error ~2e-7. */
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = __builtin_roundf(x * 1.44269504f);
    const float r = x - n * 0.693145752f - n * 1.42860677e-6f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* One sequence: q and out [heads, dim]; scores [heads, len - first]; keys at positions first..len-1. */
static void attend(const float *q, const float *k_cache, const float *v_cache, const int32_t *table, int64_t first,
                   int64_t len, float *out, float *scores, int64_t num_heads, int64_t num_kv_heads, int64_t dim,
                   int64_t block_size, float scale) {
    const int64_t g = num_heads / num_kv_heads, row = num_kv_heads * dim, block = block_size * row;
    const int64_t span = len - first;
    for (int64_t pos = first; pos < len;) {
        const int64_t off = pos % block_size, n = len - pos < block_size - off ? len - pos : block_size - off;
        const float *k = k_cache + table[pos / block_size] * block + off * row;
        for (int64_t t = 0; t < n; ++t, k += row) {
            for (int64_t h = 0; h < num_heads; ++h) {
                const float *kh = k + h / g * dim, *qh = q + h * dim;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < dim; ++d) s += qh[d] * kh[d];
                scores[h * span + pos - first + t] = s * scale;
            }
        }
        pos += n;
    }
    for (int64_t h = 0; h < num_heads; ++h) {
        float *s = scores + h * span, max = s[0], sum = 0.f;
        for (int64_t t = 1; t < span; ++t) max = s[t] > max ? s[t] : max;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < span; ++t) sum += s[t] = exp_nonpositive(s[t] - max);
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < span; ++t) s[t] *= inv;
    }
    memset(out, 0, sizeof(float) * num_heads * dim);
    for (int64_t pos = first; pos < len;) {
        const int64_t off = pos % block_size, n = len - pos < block_size - off ? len - pos : block_size - off;
        const float *v = v_cache + table[pos / block_size] * block + off * row;
        for (int64_t t = 0; t < n; ++t, v += row) {
            for (int64_t h = 0; h < num_heads; ++h) {
                const float p = scores[h * span + pos - first + t], *vh = v + h / g * dim;
                float *oh = out + h * dim;
#pragma omp simd
                for (int64_t d = 0; d < dim; ++d) oh[d] += p * vh[d];
            }
        }
        pos += n;
    }
}

/* q, out: [seqs, heads, dim]; caches: [blocks, block_size, kv_heads, dim]; tables: [seqs, max_blocks].
 * window > 0: each query sees only the last `window` positions of its context (sliding-window attention). */
void paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                            const int32_t *block_tables, const int32_t *context_lens, float *out,
                            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t dim,
                            int64_t block_size, int64_t max_blocks, int64_t max_context, int64_t window,
                            float scale) {
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * num_heads * max_context);
#pragma omp for schedule(dynamic, 1)
        for (int64_t seq = 0; seq < num_seqs; ++seq) {
            const int64_t len = context_lens[seq], first = window > 0 && len > window ? len - window : 0;
            attend(q + seq * num_heads * dim, k_cache, v_cache, block_tables + seq * max_blocks, first, len,
                   out + seq * num_heads * dim, scores, num_heads, num_kv_heads, dim, block_size, scale);
        }
        free(scores);
    }
}
