/* Paged decode attention on the CPU: one query token per sequence, K/V read in place from the block cache
 * (no gather, no padding), each byte of K/V read from memory once. One pass over the context with an online
 * softmax, a chunk of up to 16 tokens at a time: a chunk's rows are scored, then accumulated while they are
 * still in L1, and each loaded K/V row serves all query heads that share it. Software prefetch runs one
 * pass ahead, which roughly doubles the bandwidth reached (the hardware prefetcher alone leaves the loads
 * waiting on memory). Built with -fopenmp after torch is loaded, so it shares torch's OpenMP threads. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define CHUNK 16 /* tokens scored at once: their scores fit in registers, their K/V rows in L1 */

/* GCC vector extensions: one AVX-512 register where the CPU has them, two AVX2 ones (or four SSE) elsewhere. */
#define W 16
typedef float vf __attribute__((vector_size(4 * W)));
typedef float vf_unaligned __attribute__((vector_size(4 * W), aligned(4)));

typedef int32_t vi __attribute__((vector_size(4 * W)));

INLINE vf load(const float *p) { return *(const vf_unaligned *)p; }
INLINE void store(float *p, vf x) { *(vf_unaligned *)p = x; }
INLINE vf splat(float x) { return (vf){0} + x; }
INLINE vf vmax(vf a, vf b) { return (vf)(((vi)a & (a > b)) | ((vi)b & ~(a > b))); }

/* exp for x <= 0, lane by lane (libm's expf does not vectorise without -ffast-math, whose startup code would
 * flush denormals for the whole process): 2^n * p(r) with |r| <= ln2/2, relative error ~2e-7. */
INLINE vf exp_nonpositive(vf x) {
    x = vmax(x, splat(-87.f));
    const vf n = (x * 1.44269504f + 12582912.f) - 12582912.f; /* round to nearest: the 1.5 * 2^23 trick */
    const vf r = x - n * 0.693145752f - n * 1.42860677e-6f;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    return p * (vf)((__builtin_convertvector(n, vi) + 127) << 23);
}

/* tanh lane by lane, within 2 ulp: an odd polynomial below 0.625 (Cephes' tanhf), where 1 - e^-2|x| would lose
 * the leading bits, else (1 - e) / (1 + e) with e = e^-2|x|. */
INLINE vf tanh_lanes(vf x) {
    const vi sign = (vi){0} + INT32_MIN;
    const vf z = (vf)((vi)x & ~sign), z2 = z * z;  /* |x| */
    const vf e = exp_nonpositive(-2.f * z);
    vf p = splat(-5.70498872745e-3f);
    p = p * z2 + 2.06390887954e-2f;
    p = p * z2 - 5.37397155531e-2f;
    p = p * z2 + 1.33314422036e-1f;
    p = p * z2 - 3.33332819422e-1f;
    const vf small = p * z2 * z + z, large = (1.f - e) / (1.f + e);
    const vi below = z < splat(0.625f);
    return (vf)(((vi)small & below) | ((vi)large & ~below) | ((vi)x & sign));  /* x's sign */
}

/* p[i] -> the vector whose lane i is the sum of p[i]'s lanes: a transposing tree of 15 pairwise folds
 * instead of 16 separate horizontal sums. */
INLINE vf sum_lanes(vf p[W]) {
    for (int i = 0; i < 8; ++i)
        p[i] = __builtin_shufflevector(p[i], p[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(p[i], p[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; ++i)
        p[i] = __builtin_shufflevector(p[i], p[i + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
             + __builtin_shufflevector(p[i], p[i + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)
        p[i] = __builtin_shufflevector(p[i], p[i + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
             + __builtin_shufflevector(p[i], p[i + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    return __builtin_shufflevector(p[0], p[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
         + __builtin_shufflevector(p[0], p[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

INLINE void prefetch(const float *p, int64_t floats) {  /* one cache line at a time */
    for (int64_t i = 0; i < floats; i += 64 / sizeof(float)) __builtin_prefetch(p + i);
}

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int32_t *block_tables, *context_lens;
    const float *sinks; /* per query head, or NULL */
    const float *alibi_slopes; /* per query head, or NULL */
    float *out;
    int64_t num_heads, num_kv_heads, block_size, max_blocks, window, chunk;
    float scale, soft_cap;
} Args;

/* Query heads [j0 * g, j1 * g) of one sequence against KV heads [j0, j1), over context tokens [first, len).
 * Scores are [token][head], heads padded to a multiple of W, so the online softmax runs across heads in
 * vectors. scratch: see scratch_floats. `dim` is a compile-time constant where it matters (see
 * attend_dispatch), so the loops over it unroll; so is `capped` (scores soft-capped: cap * tanh(score / cap)),
 * so that the scores of uncapped models take no extra step. */
INLINE void attend(const Args *a, int64_t seq, int64_t j0, int64_t j1, int64_t dim, bool capped, float *scratch) {
    const int64_t g = a->num_heads / a->num_kv_heads, nkv = j1 - j0, nh = nkv * g, row = a->num_kv_heads * dim;
    const int64_t hp = (nh + W - 1) / W * W, vec_dim = dim / W * W;
    const int64_t len = a->context_lens[seq];
    int64_t first = a->window > 0 && len > a->window ? len - a->window : 0;
    /* Chunked local attention: the query (at len - 1) sees only its own chunk's keys. */
    if (a->chunk > 0 && len > 0 && (len - 1) / a->chunk * a->chunk > first) first = (len - 1) / a->chunk * a->chunk;
    const int32_t *table = a->block_tables + seq * a->max_blocks;
    const float *q = a->q + (seq * a->num_heads + j0 * g) * dim;
    float *acc = scratch, *s = acc + nh * dim, *m = s + CHUNK * hp, *l = m + hp, *slope = l + hp;
    memset(acc, 0, sizeof(float) * nh * dim);
    for (int64_t h = 0; h < hp; ++h) m[h] = -INFINITY, l[h] = 0.f;
    /* ALiBi: the query sits at len - 1, so a key at t scores slope * (t - len + 1) more (padding heads: 0). */
    for (int64_t h = 0; h < hp; ++h) slope[h] = a->alibi_slopes != NULL && h < nh ? a->alibi_slopes[j0 * g + h] : 0.f;
    /* A sink is a key of score sinks[h] and value 0: the softmax starts from it (max = sink, sum = e^0). */
    if (a->sinks != NULL)
        for (int64_t h = 0; h < nh; ++h) m[h] = a->sinks[j0 * g + h], l[h] = 1.f;
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
            const float *kt = k + t * row;
            prefetch(v + t * row, nkv * dim);
            for (int64_t h0 = 0; h0 < nh; h0 += W) {
                vf part[W];
                for (int i = 0; i < W; ++i) {
                    const int64_t h = h0 + i;
                    part[i] = splat(0.f);
                    if (h >= nh) continue;
                    const float *qh = q + h * dim, *kh = kt + h / g * dim;
                    for (int64_t d = 0; d < vec_dim; d += W) part[i] += load(qh + d) * load(kh + d);
                    for (int64_t d = vec_dim; d < dim; ++d) part[i][0] += qh[d] * kh[d];
                }
                vf score = sum_lanes(part) * a->scale;
                if (capped) score = a->soft_cap * tanh_lanes(score / a->soft_cap);
                if (a->alibi_slopes != NULL) score += load(slope + h0) * (float)(t0 + t - len + 1);
                store(s + t * hp + h0, score);
            }
        }
        for (int64_t h0 = 0; h0 < nh; h0 += W) {  /* online softmax, W heads at a time */
            const vf m_old = load(m + h0);
            vf mx = m_old;
            for (int64_t t = 0; t < n; ++t) mx = vmax(mx, load(s + t * hp + h0));
            const vf c = exp_nonpositive(m_old - mx);  /* rescales what was accumulated under the old max */
            vf sum = load(l + h0) * c;
            for (int64_t t = 0; t < n; ++t) {
                const vf p = exp_nonpositive(load(s + t * hp + h0) - mx);
                store(s + t * hp + h0, p);
                sum += p;
            }
            store(m + h0, mx);
            store(l + h0, sum);
            for (int64_t i = 0; i < W && h0 + i < nh; ++i)
                if (c[i] != 1.f)
                    for (int64_t d = 0; d < dim; ++d) acc[(h0 + i) * dim + d] *= c[i];
        }
        for (int64_t t = 0; t < n; ++t) {
            if (k_next != NULL && t1 + t < len && next_off + t < a->block_size) prefetch(k_next + t * row, nkv * dim);
            const float *vt = v + t * row;
            for (int64_t h = 0; h < nh; ++h) {
                const float *vh = vt + h / g * dim;
                float *ah = acc + h * dim;
                const vf p = splat(s[t * hp + h]);
                for (int64_t d = 0; d < vec_dim; d += W) store(ah + d, load(ah + d) + p * load(vh + d));
                for (int64_t d = vec_dim; d < dim; ++d) ah[d] += s[t * hp + h] * vh[d];
            }
        }
        t0 += n;
    }
    float *o = a->out + (seq * a->num_heads + j0 * g) * dim;
    for (int64_t h = 0; h < nh; ++h)
        for (int64_t d = 0; d < dim; ++d) o[h * dim + d] = acc[h * dim + d] / l[h];
}

static int64_t scratch_floats(int64_t num_heads, int64_t dim) {
    const int64_t hp = (num_heads + W - 1) / W * W;
    return num_heads * dim + CHUNK * hp + 3 * hp;
}

INLINE void attend_capped_or_not(const Args *a, int64_t seq, int64_t j0, int64_t j1, int64_t dim, float *scratch) {
    if (a->soft_cap > 0.f) attend(a, seq, j0, j1, dim, true, scratch);
    else attend(a, seq, j0, j1, dim, false, scratch);
}

static void attend_dispatch(const Args *a, int64_t seq, int64_t j0, int64_t j1, int64_t dim, float *scratch) {
    switch (dim) {  /* common head sizes get fully unrolled inner loops */
        case 64: attend_capped_or_not(a, seq, j0, j1, 64, scratch); break;
        case 128: attend_capped_or_not(a, seq, j0, j1, 128, scratch); break;
        default: attend_capped_or_not(a, seq, j0, j1, dim, scratch);
    }
}

/* q, out: [seqs, heads, dim]; caches: [blocks, block_size, kv_heads, dim]; tables: [seqs, max_blocks].
 * window > 0 attends only to each sequence's last `window` tokens (sliding-window attention); chunk > 0 only to
 * the tokens of the query's own `chunk`-token chunk, from (len - 1) / chunk * chunk on (Llama 4's chunked local
 * attention; with a window too, the later of the two starts); soft_cap > 0 caps
 * each scaled score s to soft_cap * tanh(s / soft_cap) (Gemma 2's attention-logit softcapping); sinks, if not
 * NULL, holds a logit per query head that joins each softmax's denominator (GPT-OSS's attention sinks);
 * alibi_slopes, if not NULL, a slope per query head: a key t positions before the query scores slope * -t more
 * (ALiBi: BLOOM, MPT).
 * Work items are (sequence, slice of KV heads): whole rows (contiguous reads) when there are enough
 * sequences to keep every thread busy, finer slices for small batches. */
void paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                            const int32_t *block_tables, const int32_t *context_lens, float *out,
                            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t dim,
                            int64_t block_size, int64_t max_blocks, int64_t window, int64_t chunk,
                            int64_t num_threads,
                            float scale, float soft_cap, const float *sinks, const float *alibi_slopes) {
    const Args a = {q, k_cache, v_cache, block_tables, context_lens, sinks, alibi_slopes, out, num_heads, num_kv_heads,
                    block_size, max_blocks, window, chunk, scale, soft_cap};
    int64_t slices = (4 * num_threads + num_seqs - 1) / num_seqs;
    slices = slices < 1 ? 1 : slices > num_kv_heads ? num_kv_heads : slices;
    const int64_t items = num_seqs * slices;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc(sizeof(float) * scratch_floats(num_heads, dim));
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t seq = item / slices, slice = item % slices;
            attend_dispatch(&a, seq, slice * num_kv_heads / slices, (slice + 1) * num_kv_heads / slices, dim,
                            scratch);
        }
        free(scratch);
    }
}
