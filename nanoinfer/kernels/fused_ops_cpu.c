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

/* The paged cache's rows at `slots` = this step's k and v rows (row floats each, strided); slot < 0 skips. */
void store_kvcache(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *k_cache,
                   float *v_cache, const int64_t *slots, int64_t tokens, int64_t row, int64_t num_threads) {
#pragma omp parallel for num_threads(tokens * row >= PARALLEL_MIN ? num_threads : 1) schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row, k + t * k_stride, sizeof(float) * row);
        memcpy(v_cache + slots[t] * row, v + t * v_stride, sizeof(float) * row);
    }
}

/* out[r] = the first index of the largest value of row r (a NaN counts as the largest, as in torch.argmax):
 * a vectorised max, then a scan for its first occurrence, while the row is still in L2. */
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int64_t num_threads) {
#pragma omp parallel for num_threads(rows * n >= PARALLEL_MIN ? num_threads : 1) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = x + r * n;
        float mx = row[0];
        int nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
        for (int64_t i = 0; i < n; ++i) {
            mx = row[i] > mx ? row[i] : mx;
            nan |= row[i] != row[i];
        }
        int64_t at = 0;
        if (nan)
            while (row[at] == row[at]) ++at;
        else
            while (row[at] != mx) ++at;
        out[r] = at;
    }
}
