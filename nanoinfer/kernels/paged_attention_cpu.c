/* Paged decode attention on the CPU: one query token per sequence, K/V read in place from the block cache
 * (no gather, no padding), each byte of K/V read from memory once. One pass over the context with an online
 * softmax, a chunk of up to 16 tokens at a time: a chunk's rows are scored, then accumulated while they are
 * still in L1, and each loaded K/V row serves all query heads that share it. Software prefetch runs one
 * pass ahead, which roughly doubles the bandwidth reached (the hardware prefetcher alone leaves the loads
 * waiting on memory). Built with -fopenmp after torch is loaded, so it shares torch's OpenMP threads. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define CHUNK 16 /* tokens scored at once: their scores fit in registers, their K/V rows in L1 */

/* exp for x <= 0, vectorisable (libm's expf is not without -ffast-math, whose startup code would flush
 * denormals for the whole process): 2^n * p(r) with |r| <= ln2/2, relative error ~2e-7. */
INLINE float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = (x * 1.44269504f + 12582912.f) - 12582912.f; /* round to nearest: 1.5 * 2^23 trick */
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

/* GCC vector extensions: one AVX-512 register where the CPU has them, two AVX2 ones (or four SSE) elsewhere. */
#define W 16
typedef float vf __attribute__((vector_size(4 * W)));
typedef float vf_unaligned __attribute__((vector_size(4 * W), aligned(4)));

INLINE vf load(const float *p) { return *(const vf_unaligned *)p; }
INLINE void store(float *p, vf x) { *(vf_unaligned *)p = x; }

INLINE float hsum(vf x) {  /* a shuffle tree, not 16 dependent scalar adds */
    x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    x += __builtin_shufflevector(x, x, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
    return x[0];
}

INLINE float dot(const float *a, const float *b, int64_t dim) {
    vf acc = {0};
    int64_t d = 0;
    for (; d + W <= dim; d += W) acc += load(a + d) * load(b + d);
    float s = hsum(acc);
    for (; d < dim; ++d) s += a[d] * b[d];
    return s;
}

INLINE void axpy(float *y, float p, const float *x, int64_t dim) {  /* y += p * x */
    const vf pv = (vf){0} + p;
    int64_t d = 0;
    for (; d + W <= dim; d += W) store(y + d, load(y + d) + pv * load(x + d));
    for (; d < dim; ++d) y[d] += p * x[d];
}

INLINE void scale_by(float *y, float c, int64_t dim) {
    const vf cv = (vf){0} + c;
    int64_t d = 0;
    for (; d + W <= dim; d += W) store(y + d, load(y + d) * cv);
    for (; d < dim; ++d) y[d] *= c;
}

INLINE void prefetch(const float *p, int64_t floats) {  /* one cache line at a time */
    for (int64_t i = 0; i < floats; i += 64 / sizeof(float)) __builtin_prefetch(p + i);
}

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int32_t *block_tables, *context_lens;
    float *out;
    int64_t num_heads, num_kv_heads, block_size, max_blocks, window;
    float scale;
} Args;

/* Query heads [j0 * g, j1 * g) of one sequence against KV heads [j0, j1), over context tokens [first, len).
 * scratch: (j1 - j0) * g * (dim + CHUNK + 2) floats. `dim` is a
 * compile-time constant where it matters (see attend_dispatch), so the vector loops unroll into registers. */
INLINE void attend(const Args *a, int64_t seq, int64_t j0, int64_t j1, int64_t dim, float *scratch) {
    const int64_t g = a->num_heads / a->num_kv_heads, nkv = j1 - j0, nh = nkv * g, row = a->num_kv_heads * dim;
    const int64_t len = a->context_lens[seq];
    const int64_t first = a->window > 0 && len > a->window ? len - a->window : 0;
    const int32_t *table = a->block_tables + seq * a->max_blocks;
    const float *q = a->q + (seq * a->num_heads + j0 * g) * dim;
    float *acc = scratch, *s = acc + nh * dim, *m = s + nh * CHUNK, *l = m + nh;  /* s: [token][head] */
    memset(acc, 0, sizeof(float) * nh * dim);
    for (int64_t h = 0; h < nh; ++h) m[h] = -INFINITY, l[h] = 0.f;
    for (int64_t t0 = first; t0 < len;) {
        const int64_t off = t0 % a->block_size;
        int64_t n = a->block_size - off < CHUNK ? a->block_size - off : CHUNK;
        n = len - t0 < n ? len - t0 : n;
        const int64_t base = ((int64_t)table[t0 / a->block_size] * a->block_size + off) * row + j0 * dim;
        const float *k = a->k_cache + base, *v = a->v_cache + base;
        /* Prefetch one pass ahead: this chunk's V rows while scoring, the next chunk's K rows while accumulating. */
        const int64_t t1 = t0 + n, next_off = t1 % a->block_size;
        const float *k_next = t1 < len ? a->k_cache + ((int64_t)table[t1 / a->block_size] * a->block_size + next_off)
                                                      * row + j0 * dim : NULL;
        for (int64_t t = 0; t < n; ++t) {
            prefetch(v + t * row, nkv * dim);
            for (int64_t j = 0; j < nkv; ++j)
                for (int64_t i = 0; i < g; ++i)
                    s[t * nh + j * g + i] = dot(q + (j * g + i) * dim, k + t * row + j * dim, dim) * a->scale;
        }
        for (int64_t h = 0; h < nh; ++h) {
            float mx = m[h], sum = 0.f;
            for (int64_t t = 0; t < n; ++t) mx = s[t * nh + h] > mx ? s[t * nh + h] : mx;
            for (int64_t t = 0; t < n; ++t) sum += s[t * nh + h] = exp_nonpositive(s[t * nh + h] - mx);
            if (mx > m[h]) {  /* rescale what was accumulated under the old maximum */
                const float c = m[h] == -INFINITY ? 0.f : exp_nonpositive(m[h] - mx);
                l[h] *= c;
                scale_by(acc + h * dim, c, dim);
                m[h] = mx;
            }
            l[h] += sum;
        }
        for (int64_t t = 0; t < n; ++t) {
            if (k_next != NULL && t1 + t < len && next_off + t < a->block_size) prefetch(k_next + t * row, nkv * dim);
            for (int64_t j = 0; j < nkv; ++j)
                for (int64_t i = 0; i < g; ++i)
                    axpy(acc + (j * g + i) * dim, s[t * nh + j * g + i], v + t * row + j * dim, dim);
        }
        t0 += n;
    }
    float *o = a->out + (seq * a->num_heads + j0 * g) * dim;
    for (int64_t h = 0; h < nh; ++h) {
        memcpy(o + h * dim, acc + h * dim, sizeof(float) * dim);
        scale_by(o + h * dim, 1.f / l[h], dim);
    }
}

static void attend_dispatch(const Args *a, int64_t seq, int64_t j0, int64_t j1, int64_t dim, float *scratch) {
    switch (dim) {  /* common head sizes get fully unrolled inner loops */
        case 64: attend(a, seq, j0, j1, 64, scratch); break;
        case 128: attend(a, seq, j0, j1, 128, scratch); break;
        default: attend(a, seq, j0, j1, dim, scratch);
    }
}

/* q, out: [seqs, heads, dim]; caches: [blocks, block_size, kv_heads, dim]; tables: [seqs, max_blocks].
 * window > 0 attends only to each sequence's last `window` tokens (sliding-window attention).
 * Work items are (sequence, slice of KV heads): whole rows (contiguous reads) when there are enough
 * sequences to keep every thread busy, finer slices for small batches. */
void paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                            const int32_t *block_tables, const int32_t *context_lens, float *out,
                            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t dim,
                            int64_t block_size, int64_t max_blocks, int64_t window, int64_t num_threads,
                            float scale) {
    const Args a = {q, k_cache, v_cache, block_tables, context_lens, out, num_heads, num_kv_heads, block_size,
                    max_blocks, window, scale};
    int64_t slices = (4 * num_threads + num_seqs - 1) / num_seqs;
    slices = slices < 1 ? 1 : slices > num_kv_heads ? num_kv_heads : slices;
    const int64_t items = num_seqs * slices;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc(sizeof(float) * num_heads * (dim + CHUNK + 2));
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t seq = item / slices, slice = item % slices;
            attend_dispatch(&a, seq, slice * num_kv_heads / slices, (slice + 1) * num_kv_heads / slices, dim,
                            scratch);
        }
        free(scratch);
    }
}
