/* Fused CPU kernels for the elementwise work of a Llama-style decoder layer.
 *
 * Each kernel makes one pass over its rows where PyTorch makes one pass per operation.
 * Every kernel exists twice, for bf16 (name_bf16) and float32 (name_f32) tensors: this
 * file includes itself once per element type ELEM (the second half, KERNEL_BODY). Math is in float32;
 * R(v) in the formulas is the rounding of an intermediate to the tensor type, done
 * exactly where PyTorch's graph of the same computation rounds it, so the results match
 * transformers' modules (forward: bit for bit but for sums taken in another order;
 * backward: to one rounding). Built by ppokit/lm/kernels/__init__.py with the system C
 * compiler; plain C, vectorized by the compiler (`#pragma omp simd`), no PyTorch headers.
 *
 * bf16 values are passed as uint16_t; all arrays are row-major with a contiguous last
 * dimension.
 */
#ifndef KERNEL_BODY
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

static inline float same(float f) { return f; }

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

#define KERNEL_BODY
#define ELEM bf16
#define LOAD bf2f
#define STORE f2bf
#define ROUND round_bf
#define NAME(name) name##_bf16
#include __FILE__
#undef ELEM
#undef LOAD
#undef STORE
#undef ROUND
#undef NAME

#define ELEM float
#define LOAD same
#define STORE same
#define ROUND same
#define NAME(name) name##_f32
#include __FILE__

#else /* KERNEL_BODY: the kernels, for the element type ELEM */

/* RMSNorm forward, per row of x [rows, d]:
 *   rstd = 1 / sqrt(mean(x^2) + eps);   y = w * R(x * rstd)
 * rstd [rows] (float) is kept for the backward. */
void NAME(rms_norm_forward)(const ELEM *x, const ELEM *w, ELEM *y, float *rstd, long rows, long d, float eps) {
    for (long i = 0; i < rows; i++) {
        const ELEM *xr = x + i * d;
        ELEM *yr = y + i * d;
        float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
        for (long j = 0; j < d; j++) {
            float v = LOAD(xr[j]);
            sum_sq += v * v;
        }
        float r = 1.f / sqrtf(sum_sq / (float)d + eps);
#pragma omp simd
        for (long j = 0; j < d; j++) yr[j] = STORE(LOAD(w[j]) * ROUND(LOAD(xr[j]) * r));
        rstd[i] = r;
    }
}

/* RMSNorm backward (frozen weight), per row, with gh = R(g * w):
 *   dx = rstd * gh - rstd^3 / d * (gh . x) * x */
void NAME(rms_norm_backward)(const ELEM *g, const ELEM *x, const ELEM *w, const float *rstd, ELEM *dx, long rows,
                       long d) {
    for (long i = 0; i < rows; i++) {
        const ELEM *gr = g + i * d, *xr = x + i * d;
        ELEM *dr = dx + i * d;
        float r = rstd[i], dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (long j = 0; j < d; j++) dot += ROUND(LOAD(gr[j]) * LOAD(w[j])) * LOAD(xr[j]);
        float c = r * r * r * dot / (float)d;
#pragma omp simd
        for (long j = 0; j < d; j++) dr[j] = STORE(r * ROUND(LOAD(gr[j]) * LOAD(w[j])) - c * LOAD(xr[j]));
    }
}

/* SwiGLU's product, elementwise over n values:  out = R(silu(gate)) * up,
 * silu(g) = g sigmoid(g). */
void NAME(silu_mul_forward)(const ELEM *gate, const ELEM *up, ELEM *out, long n) {
#pragma omp simd
    for (long i = 0; i < n; i++) {
        float g = LOAD(gate[i]);
        float a = ROUND(g / (1.f + exp_approx(-g)));
        out[i] = STORE(a * LOAD(up[i]));
    }
}

/* Its backward for the upstream gradient go:
 *   dup = go * R(silu(gate));  dgate = R(go * up) * s (1 + gate (1 - s)),  s = sigmoid(gate) */
void NAME(silu_mul_backward)(const ELEM *grad, const ELEM *gate, const ELEM *up, ELEM *dgate, ELEM *dup, long n) {
#pragma omp simd
    for (long i = 0; i < n; i++) {
        float g = LOAD(gate[i]), go = LOAD(grad[i]);
        float s = 1.f / (1.f + exp_approx(-g));
        dup[i] = STORE(go * ROUND(g * s));
        float da = ROUND(go * LOAD(up[i]));
        dgate[i] = STORE(da * (s * (1.f + g * (1.f - s))));
    }
}

/* Rotary embedding, for q [B, H, T, D] (strides sq_b, sq_h, sq_t; last dim contiguous) and
 * cos, sin [B, T, D] (strides sc_b, sc_t, shared by both tables):
 *   out = R(q * cos) + R(rotate_half(q) * sin),  rotate_half(q) = (-q[D/2:], q[:D/2])
 * out is contiguous [B, H, T, D]. With `backward` set, q is the upstream gradient and out the
 * input gradient: R(g * cos) + rotate_half^T(R(g * sin)), rotate_half^T(v) = (v[D/2:], -v[:D/2]). */
void NAME(rotary)(const ELEM *q, const ELEM *cos_, const ELEM *sin_, ELEM *out, long B, long H, long T, long D,
            long sq_b, long sq_h, long sq_t, long sc_b, long sc_t, int backward) {
    long half = D / 2;
    float sign = backward ? -1.f : 1.f;
    for (long b = 0; b < B; b++)
        for (long h = 0; h < H; h++)
            for (long t = 0; t < T; t++) {
                const ELEM *qr = q + b * sq_b + h * sq_h + t * sq_t;
                const ELEM *cr = cos_ + b * sc_b + t * sc_t, *sr = sin_ + b * sc_b + t * sc_t;
                ELEM *o = out + ((b * H + h) * T + t) * D;
#pragma omp simd
                for (long j = 0; j < half; j++) {
                    /* forward: out[j] = q[j] c[j] - q[j+half] s[j]; backward: g[j] c[j] + g[j+half] s[j+half] */
                    float rot = backward ? LOAD(qr[j + half]) * LOAD(sr[j + half]) : LOAD(qr[j + half]) * LOAD(sr[j]);
                    o[j] = STORE(ROUND(LOAD(qr[j]) * LOAD(cr[j])) - sign * ROUND(rot));
                }
#pragma omp simd
                for (long j = half; j < D; j++) {
                    /* forward: out[j] = q[j] c[j] + q[j-half] s[j]; backward: g[j] c[j] - g[j-half] s[j-half] */
                    float rot = backward ? LOAD(qr[j - half]) * LOAD(sr[j - half]) : LOAD(qr[j - half]) * LOAD(sr[j]);
                    o[j] = STORE(ROUND(LOAD(qr[j]) * LOAD(cr[j])) + sign * ROUND(rot));
                }
            }
}

/* Attention for one new token per sequence (a decoding step), for one (b, h), as eager
 * attention computes it:
 *   s_j = R(R(q . k_j) * scale)  (+ m_j: rounded when round_mask, as a same-dtype add is),
 *   p_j = R(softmax(s)_j)  (float32),   out = R(sum_j p_j v_j)
 * q [D], k and v T rows of D (row strides sk_t, sv_t), mask [T] float32 or NULL, out [D];
 * scratch holds T + D floats. Inlined with D a constant for the common head sizes. */
static inline __attribute__((always_inline)) void NAME(decode_row)(
        const ELEM *qr, const ELEM *kb, const ELEM *vb, const float *m, ELEM *o, float *scratch, long T, long D,
        long sk_t, long sv_t, float scale, int round_mask) {
    float *s = scratch, *acc = scratch + T;
    float top = -INFINITY;
    for (long j = 0; j < T; j++) {
        const ELEM *kr = kb + j * sk_t;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (long d = 0; d < D; d++) dot += LOAD(qr[d]) * LOAD(kr[d]);
        float x = ROUND(ROUND(dot) * scale);
        if (m) x = round_mask ? ROUND(x + m[j]) : x + m[j];
        s[j] = x;
        top = x > top ? x : top;
    }
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (long j = 0; j < T; j++) {
        float e = s[j] - top;
        e = e > -87.f ? exp_approx(e) : 0.f;    /* masked positions (-inf or the dtype's min) */
        s[j] = e;
        sum += e;
    }
    float inv = 1.f / sum;
#pragma omp simd
    for (long d = 0; d < D; d++) acc[d] = 0.f;
    for (long j = 0; j < T; j++) {
        float p = ROUND(s[j] * inv);
        const ELEM *vr = vb + j * sv_t;
#pragma omp simd
        for (long d = 0; d < D; d++) acc[d] += p * LOAD(vr[d]);
    }
#pragma omp simd
    for (long d = 0; d < D; d++) o[d] = STORE(acc[d]);
}

/* decode_row for the rows [start, stop) of B x H: q [B, H, D] (strides sq_b, sq_h), k and v
 * [B, Hkv, T, D] (strides sk_*, sv_*), head h reads kv head h / (H / Hkv); mask [B, T]
 * float32 (row stride sm_b, 0 when broadcast) or NULL; out contiguous [B, H, D]. */
void NAME(decode_attention)(const ELEM *q, const ELEM *k, const ELEM *v, const float *mask, ELEM *out, float *scratch,
                      long start, long stop, long H, long Hkv, long T, long D, long sq_b, long sq_h,
                      long sk_b, long sk_h, long sk_t, long sv_b, long sv_h, long sv_t, long sm_b,
                      float scale, int round_mask) {
    long rep = H / Hkv;
    for (long row = start; row < stop; row++) {
        long b = row / H, h = row % H, g = h / rep;
        const ELEM *qr = q + b * sq_b + h * sq_h;
        const ELEM *kb = k + b * sk_b + g * sk_h, *vb = v + b * sv_b + g * sv_h;
        const float *m = mask ? mask + b * sm_b : 0;
        ELEM *o = out + row * D;
        if (D == 32)
            NAME(decode_row)(qr, kb, vb, m, o, scratch, T, 32, sk_t, sv_t, scale, round_mask);
        else if (D == 64)
            NAME(decode_row)(qr, kb, vb, m, o, scratch, T, 64, sk_t, sv_t, scale, round_mask);
        else if (D == 128)
            NAME(decode_row)(qr, kb, vb, m, o, scratch, T, 128, sk_t, sv_t, scale, round_mask);
        else
            NAME(decode_row)(qr, kb, vb, m, o, scratch, T, D, sk_t, sv_t, scale, round_mask);
    }
}

#endif /* KERNEL_BODY */
