/* Fused bf16 kernels for the elementwise work of a Llama-style decoder layer on CPU.
 *
 * Each kernel makes one pass over its rows where PyTorch makes one pass per operation,
 * and rounds every intermediate to bf16 exactly where PyTorch's bf16 graph of the same
 * computation rounds it, so the results match transformers' modules (forward: bit for
 * bit; backward: to one bf16 rounding, since sums are taken in another order).
 * Math is in float32. Built by ppokit/lm/kernels/__init__.py with the system C compiler;
 * plain C, vectorized by the compiler (`#pragma omp simd`), no PyTorch headers.
 *
 * bf16 values are passed as uint16_t; all arrays are row-major with a contiguous last
 * dimension.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float bf2f(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float -> bf16, round to nearest even (NaN stays NaN), as PyTorch rounds. */
static inline bf16 f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (bf16)(((u & 0x7fffffffu) > 0x7f800000u) ? 0x7fc0u : rounded);
}

/* The value a float takes once stored as bf16. */
static inline float round_bf(float f) { return bf2f(f2bf(f)); }

/* exp(x) in float: 2^n p(r) with x = n ln2 + r, |r| <= ln2 / 2 (Cephes' polynomial,
 * relative error about 2e-7); written so that the compiler can vectorize it. Outside
 * |x| < 87 it saturates near 2^-126 and 2^128 instead of reaching 0 and inf. */
static inline float exp_approx(float x) {
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    int32_t e = (int32_t)n;                   /* the exponent stays in the normal range */
    e = e < -126 ? -126 : e;
    e = e > 127 ? 127 : e;
    int32_t bits = (e + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* RMSNorm forward, per row of x [rows, d]:
 *   rstd = 1 / sqrt(mean(x^2) + eps);   y = w * bf16(x * rstd)
 * rstd [rows] (float) is kept for the backward. */
void rms_norm_forward(const bf16 *x, const bf16 *w, bf16 *y, float *rstd, long rows, long d, float eps) {
    for (long i = 0; i < rows; i++) {
        const bf16 *xr = x + i * d;
        bf16 *yr = y + i * d;
        float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
        for (long j = 0; j < d; j++) {
            float v = bf2f(xr[j]);
            sum_sq += v * v;
        }
        float r = 1.f / sqrtf(sum_sq / (float)d + eps);
#pragma omp simd
        for (long j = 0; j < d; j++) yr[j] = f2bf(bf2f(w[j]) * round_bf(bf2f(xr[j]) * r));
        rstd[i] = r;
    }
}

/* RMSNorm backward (frozen weight), per row, with gh = bf16(g * w):
 *   dx = rstd * gh - rstd^3 / d * (gh . x) * x */
void rms_norm_backward(const bf16 *g, const bf16 *x, const bf16 *w, const float *rstd, bf16 *dx, long rows,
                       long d) {
    for (long i = 0; i < rows; i++) {
        const bf16 *gr = g + i * d, *xr = x + i * d;
        bf16 *dr = dx + i * d;
        float r = rstd[i], dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (long j = 0; j < d; j++) dot += round_bf(bf2f(gr[j]) * bf2f(w[j])) * bf2f(xr[j]);
        float c = r * r * r * dot / (float)d;
#pragma omp simd
        for (long j = 0; j < d; j++) dr[j] = f2bf(r * round_bf(bf2f(gr[j]) * bf2f(w[j])) - c * bf2f(xr[j]));
    }
}

/* SwiGLU's product, elementwise over n values:  out = bf16(silu(gate)) * up,
 * silu(g) = g sigmoid(g). */
void silu_mul_forward(const bf16 *gate, const bf16 *up, bf16 *out, long n) {
#pragma omp simd
    for (long i = 0; i < n; i++) {
        float g = bf2f(gate[i]);
        float a = round_bf(g / (1.f + exp_approx(-g)));
        out[i] = f2bf(a * bf2f(up[i]));
    }
}

/* Its backward for the upstream gradient go:
 *   dup = go * bf16(silu(gate));  dgate = bf16(go * up) * s (1 + gate (1 - s)),  s = sigmoid(gate) */
void silu_mul_backward(const bf16 *grad, const bf16 *gate, const bf16 *up, bf16 *dgate, bf16 *dup, long n) {
#pragma omp simd
    for (long i = 0; i < n; i++) {
        float g = bf2f(gate[i]), go = bf2f(grad[i]);
        float s = 1.f / (1.f + exp_approx(-g));
        dup[i] = f2bf(go * round_bf(g * s));
        float da = round_bf(go * bf2f(up[i]));
        dgate[i] = f2bf(da * (s * (1.f + g * (1.f - s))));
    }
}

/* Rotary embedding, for q [B, H, T, D] (strides sq_b, sq_h, sq_t; last dim contiguous) and
 * cos, sin [B, T, D] (strides sc_b, sc_t, shared by both tables):
 *   out = bf16(q * cos) + bf16(rotate_half(q) * sin),  rotate_half(q) = (-q[D/2:], q[:D/2])
 * out is contiguous [B, H, T, D]. With `backward` set, q is the upstream gradient and out the
 * input gradient: bf16(g * cos) + rotate_half^T(bf16(g * sin)), rotate_half^T(v) = (v[D/2:], -v[:D/2]). */
void rotary(const bf16 *q, const bf16 *cos_, const bf16 *sin_, bf16 *out, long B, long H, long T, long D,
            long sq_b, long sq_h, long sq_t, long sc_b, long sc_t, int backward) {
    long half = D / 2;
    float sign = backward ? -1.f : 1.f;
    for (long b = 0; b < B; b++)
        for (long h = 0; h < H; h++)
            for (long t = 0; t < T; t++) {
                const bf16 *qr = q + b * sq_b + h * sq_h + t * sq_t;
                const bf16 *cr = cos_ + b * sc_b + t * sc_t, *sr = sin_ + b * sc_b + t * sc_t;
                bf16 *o = out + ((b * H + h) * T + t) * D;
#pragma omp simd
                for (long j = 0; j < half; j++) {
                    /* forward: out[j] = q[j] c[j] - q[j+half] s[j]; backward: g[j] c[j] + g[j+half] s[j+half] */
                    float rot = backward ? bf2f(qr[j + half]) * bf2f(sr[j + half]) : bf2f(qr[j + half]) * bf2f(sr[j]);
                    o[j] = f2bf(round_bf(bf2f(qr[j]) * bf2f(cr[j])) - sign * round_bf(rot));
                }
#pragma omp simd
                for (long j = half; j < D; j++) {
                    /* forward: out[j] = q[j] c[j] + q[j-half] s[j]; backward: g[j] c[j] - g[j-half] s[j-half] */
                    float rot = backward ? bf2f(qr[j - half]) * bf2f(sr[j - half]) : bf2f(qr[j - half]) * bf2f(sr[j]);
                    o[j] = f2bf(round_bf(bf2f(qr[j]) * bf2f(cr[j])) + sign * round_bf(rot));
                }
            }
}
