/* Fused small ops of the CPU path (fp32): each replaces a chain of PyTorch ops, their temporaries and their
 * per-op dispatch with one pass over the rows. At decode batch sizes those ops are a few microseconds of
 * work each, and the chain's overhead, not its arithmetic, is what costs. Rows are strided (in floats), so
 * views such as the q/k/v slices of a fused projection need no copy. */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Below this many floats per call one thread does the work: waking the others costs more. */
#define PARALLEL_MIN 16384

/* exp for x <= 0: 2^n * p(r), |r| <= ln2/2, relative error ~2e-7; vectorisable, unlike libm's expf without
 * -ffast-math (whose startup code would flush denormals for the whole process). */
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = (x * 1.44269504f + 12582912.f) - 12582912.f; /* round to nearest: the 1.5 * 2^23 trick */
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

/* out = weight * x / sqrt(mean(x^2) + eps) over each head (dim floats) of each token, as transformers
 * computes it in fp32; x is [tokens, heads, dim] with tokens x_stride apart, out and residual_out contiguous.
 * With residual given, residual_out = x + residual is normalised instead (the fused add of a pre-norm block). */
void rms_norm(const float *x, int64_t x_stride, const float *residual, int64_t residual_stride,
              float *residual_out, const float *weight, float *out, int64_t tokens, int64_t heads, int64_t dim,
              float eps, int64_t num_threads) {
#pragma omp parallel for num_threads(tokens * heads * dim >= PARALLEL_MIN ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < tokens * heads; ++r) {
        const int64_t t = r / heads, h = r % heads;
        const float *src = x + t * x_stride + h * dim;
        if (residual != NULL) {
            const float *res = residual + t * residual_stride + h * dim;
            float *sum = residual_out + r * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) sum[d] = src[d] + res[d];
            src = sum;
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < dim; ++d) ss += src[d] * src[d];
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        float *o = out + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) o[d] = weight[d] * (src[d] * inv);
    }
}

/* Neox-style rotary embedding of the first 2 * half dims of every head (the rest is copied):
 * out = x * cos + rotate_half(x) * sin with cos/sin tables [positions, half]. x is [tokens, heads, dim] with
 * tokens x_stride apart; out is contiguous. With norm_weight given, each head is first RMS-normalised as in
 * rms_norm (Qwen3's q/k norm), in the same pass. */
void rotary_neox(const float *x, int64_t x_stride, float *out, const int64_t *positions, const float *cos,
                 const float *sin, const float *norm_weight, float eps, int64_t tokens, int64_t heads, int64_t dim,
                 int64_t half, int64_t num_threads) {
#pragma omp parallel for num_threads(tokens * heads * dim >= PARALLEL_MIN ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < tokens * heads; ++r) {
        const int64_t t = r / heads, h = r % heads;
        const float *c = cos + positions[t] * half, *s = sin + positions[t] * half, *xh = x + t * x_stride + h * dim;
        float *o = out + r * dim;
        if (norm_weight != NULL) {
            float ss = 0.f;
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < dim; ++d) ss += xh[d] * xh[d];
            const float inv = 1.f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) o[d] = norm_weight[d] * (xh[d] * inv);
            xh = o;  /* rotated in place below: each i reads its pair before writing it */
        }
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            const float x1 = xh[i], x2 = xh[i + half];
            o[i] = x1 * c[i] - x2 * s[i];
            o[i + half] = x2 * c[i] + x1 * s[i];
        }
        if (xh != o) memcpy(o + 2 * half, xh + 2 * half, sizeof(float) * (dim - 2 * half));
    }
}

/* out[r] = silu(x[r, :n]) * x[r, n:] for x rows of 2n (gate then up), as F.silu(gate) * up. */
void silu_and_mul(const float *x, float *out, int64_t rows, int64_t n, int64_t num_threads) {
#pragma omp parallel for num_threads(rows * n >= PARALLEL_MIN ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *gate = x + r * 2 * n, *up = gate + n;
        float *o = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
            const float g = gate[i], e = exp_nonpositive(-fabsf(g));  /* exp(-|g|): never overflows */
            const float sigmoid = g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
            o[i] = g * sigmoid * up[i];
        }
    }
}

/* The paged cache's rows at `slots` = this step's k and v rows (row floats each, strided); slot < 0 skips;
 * v == NULL stores k alone (a cache whose values are its keys' prefix). */
void store_kvcache(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *k_cache,
                   float *v_cache, const int64_t *slots, int64_t tokens, int64_t row, int64_t num_threads) {
#pragma omp parallel for num_threads(tokens * row >= PARALLEL_MIN ? num_threads : 1) schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row, k + t * k_stride, sizeof(float) * row);
        if (v != NULL) memcpy(v_cache + slots[t] * row, v + t * v_stride, sizeof(float) * row);
    }
}

/* The largest of x[0..n) and whether any is NaN, in one vectorised pass. */
static inline float max_and_nan(const float *x, int64_t n, int *nan) {
    float mx = x[0];
    int any_nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : any_nan)
    for (int64_t i = 0; i < n; ++i) {
        mx = x[i] > mx ? x[i] : mx;
        any_nan |= x[i] != x[i];
    }
    *nan = any_nan;
    return mx;
}

/* The first index of max_and_nan's result in x (a NaN counts as the largest, as in torch.argmax). */
static inline int64_t first_index_of(const float *x, float mx, int nan) {
    int64_t at = 0;
    if (nan)
        while (x[at] == x[at]) ++at;
    else
        while (x[at] != mx) ++at;
    return at;
}

/* out[r] = the first index of the largest value of row r: a vectorised max, then a scan for its first
 * occurrence, while the row is still in L2. */
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int64_t num_threads) {
#pragma omp parallel for num_threads(rows * n >= PARALLEL_MIN ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        int nan;
        const float mx = max_and_nan(x + r * n, n, &nan);
        out[r] = first_index_of(x + r * n, mx, nan);
    }
}

/* The sampler's counter-based noise (nanoinfer.layers.sampler.exponential_noise), in uint32 arithmetic: the
 * int64 torch ops mask every product to 32 bits, which is what uint32 multiplication wraps to. */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x21F0AAADu;
    x ^= x >> 15;
    x *= 0x735A2D97u;
    return x ^ (x >> 15);
}

/* E = -log u for the hash of (row key, token): u = (the hash's top 23 bits + 0.5) * 2^-23, exact in fp32. -log u
 * is evaluated in double and rounded once, so E is the correctly rounded fp32 value (checked against log in
 * float64 for all 2^23 inputs); torch's fp32 log (MKL) is within 1 ulp of it. */
static inline float exponential_of(uint32_t lo, uint32_t hi, uint32_t token) {
    const uint32_t x = mix32(mix32(token ^ lo) ^ hi);
    const float u = ((float)(int32_t)(x >> 9) + 0.5f) * 0x1p-23f;  /* in [2^-24, 1 - 2^-24] */
    uint32_t bits;
    memcpy(&bits, &u, sizeof bits);
    /* u = m * 2^e with m in (sqrt(1/2), sqrt(2)]: |s| <= 0.172 below and no cancellation in e ln 2 + log m. In
     * integers, so that nothing is a branch (a conditional fp multiply would stop the vectoriser). */
    const uint32_t mantissa = bits & 0x7FFFFFu, halve = mantissa > 0x3504F3u;  /* sqrt(2)'s mantissa */
    const int32_t e = (int32_t)(bits >> 23) - 127 + (int32_t)halve;
    bits = mantissa | (0x3F800000u - (halve << 23));
    float m;
    memcpy(&m, &bits, sizeof m);
    /* log m = 2 atanh(s) = 2 (s + s^3 / 3 + s^5 / 5 + ...), truncated where the next term is < 1e-18 of it. */
    const double s = ((double)m - 1.0) / ((double)m + 1.0), s2 = s * s;
    double p = 1.0 / 21;
    p = p * s2 + 1.0 / 19;
    p = p * s2 + 1.0 / 17;
    p = p * s2 + 1.0 / 15;
    p = p * s2 + 1.0 / 13;
    p = p * s2 + 1.0 / 11;
    p = p * s2 + 1.0 / 9;
    p = p * s2 + 1.0 / 7;
    p = p * s2 + 1.0 / 5;
    p = p * s2 + 1.0 / 3;
    const double log_u = (double)e * 0.69314718055994530942 + 2.0 * s * (1.0 + p * s2);
    return -(float)log_u;
}

/* out[r, t] = E of (row r's key, token t) for keys [rows, 2] (the halves of each row's key, in int64). */
void exponential_noise(const int64_t *keys, int64_t rows, int64_t vocab, float *out, int64_t num_threads) {
#pragma omp parallel for num_threads(rows * vocab >= PARALLEL_MIN ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const uint32_t lo = (uint32_t)keys[2 * r], hi = (uint32_t)keys[2 * r + 1];
        float *o = out + r * vocab;
#pragma omp simd
        for (int64_t t = 0; t < vocab; ++t) o[t] = exponential_of(lo, hi, (uint32_t)t);
    }
}

/* Tokens the exponential race computes per block: the block's p / E stay in L1 for the argmax. */
#define RACE_BLOCK 1024

/* out[r] = argmax over t of probs[r, t] / E[r, t], the sampler's exponential race, without materialising E: the
 * same fp32 quotients and the same first-index-of-the-largest (NaN first) rule as torch's div_ then argmax, block
 * by block; a later block wins only with a strictly larger quotient, or the row's first NaN. */
void exponential_race(const float *probs, int64_t stride, const int64_t *keys, int64_t rows, int64_t vocab,
                      int64_t *out, int64_t num_threads) {
#pragma omp parallel for num_threads(rows * vocab >= PARALLEL_MIN ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const uint32_t lo = (uint32_t)keys[2 * r], hi = (uint32_t)keys[2 * r + 1];
        const float *p = probs + r * stride;
        float q[RACE_BLOCK], best = 0.f;
        int64_t at = -1;
        for (int64_t start = 0; start < vocab; start += RACE_BLOCK) {
            const int64_t n = vocab - start < RACE_BLOCK ? vocab - start : RACE_BLOCK;
#pragma omp simd
            for (int64_t i = 0; i < n; ++i) q[i] = p[start + i] / exponential_of(lo, hi, (uint32_t)(start + i));
            int nan;
            const float mx = max_and_nan(q, n, &nan);
            if (nan) {
                at = start + first_index_of(q, mx, 1);
                break;
            }
            if (at < 0 || mx > best) {
                best = mx;
                at = start + first_index_of(q, mx, 0);
            }
        }
        out[r] = at;
    }
}
