/* Fused CPU kernels for the elementwise work and the attention of a Llama-style decoder
 * layer.
 *
 * Each kernel makes one pass over its rows where PyTorch makes one pass per operation.
 * Every kernel exists twice, for bf16 (name_bf16) and float32 (name_f32) tensors (but LoRA's
 * rank-r products on AMX, lora_*_bf16, bf16 only): this
 * file includes itself once per element type ELEM (the second half, KERNEL_BODY). Math is in float32;
 * R(v) in the formulas is the rounding of an intermediate to the tensor type, done
 * exactly where PyTorch's graph of the same computation rounds it, so the results match
 * transformers' modules (forward: bit for bit but for sums taken in another order;
 * backward: to one rounding). Built by ppokit/lm/accel/kernels/__init__.py with the system C
 * compiler; plain C, vectorized by the compiler (`#pragma omp simd`), no PyTorch headers,
 * with AVX-512 and AMX intrinsics where the build targets them (RMSNorm, SwiGLU and rotary
 * on whole vectors, a register transpose, the decoding attention's rows, the LoRA kernels,
 * and the attention kernels' products on the tile units for bf16: attention_group_amx and
 * its backward). With AVX512-BF16 the vector code rounds to bf16 with the CPU's conversion
 * instruction, which flushes values below bf16's smallest normal (1.2e-38) to zero where
 * PyTorch keeps them (narrow_bf16x16).
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

/* s[j] = exp(s[j] - top) for j < n (0 for masked positions, whose scores are -inf or
 * the dtype's minimum); returns their sum: the softmax's numerators and denominator. */
static inline float exp_shifted(float *s, long n, float top) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (long j = 0; j < n; j++) {
        float e = s[j] - top;
        e = e > -87.f ? exp_approx(e) : 0.f;
        s[j] = e;
        sum += e;
    }
    return sum;
}

#define KEY_BLOCK 32         /* keys per block of sums in dots_with_columns (functions.py: KEY_BLOCK) */
#define MAX_HEAD_DIM 256     /* the attention kernels' largest head size (functions.py: MAX_HEAD_DIM) */
/* Masked positions: an additive mask value at or below this is -inf or the dtype's
 * minimum, whose softmax probability is exactly 0 whenever the row has one position
 * above it. */
#define MASKED_BELOW -1e30f
#define LANES 16             /* floats in the widest vector a build uses (AVX-512) */

/* [lo, hi) widened to [lo16, hi16), whole vectors of a loop over all S keys: a loop over it
 * adds each key in the same vector lane as a loop over all S, so that its sums take the
 * same terms in the same order (the keys left out would add exact zeros). */
static inline void whole_vectors(long lo, long hi, long S, long *lo16, long *hi16) {
    long end = (hi + LANES - 1) / LANES * LANES;
    *lo16 = lo / LANES * LANES;
    *hi16 = end < S ? end : S;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_AVX512 1

/* Transpose the 16 x 16 float32 matrix held in r[0..15] (row i -> column i). */
static inline void transpose16x16(__m512 r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(_mm512_castps_si512(r[i]), _mm512_castps_si512(r[i + 1]));
        t[i + 1] = _mm512_unpackhi_epi32(_mm512_castps_si512(r[i]), _mm512_castps_si512(r[i + 1]));
    }
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; j++) {        /* 128-bit lanes: (rows 0-3, 4-7, 8-11, 12-15) of one column */
        __m512i v = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), w = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
        __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        __m512i w2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
        r[j] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(v, v2, 0x88));
        r[8 + j] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(v, v2, 0xDD));
        r[4 + j] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(w, w2, 0x88));
        r[12 + j] = _mm512_castsi512_ps(_mm512_shuffle_i32x4(w, w2, 0xDD));
    }
}

/* Masks of the first n lanes (none for n <= 0, all from the width on). */
static inline __mmask32 mask32(long n) { return n >= 32 ? 0xffffffffu : (n <= 0 ? 0u : (__mmask32)((1u << n) - 1)); }
static inline __mmask16 mask16(long n) { return n >= 16 ? (__mmask16)0xffff : (n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1)); }

/* 16 bf16 values as float32 lanes. */
static inline __m512 widen_bf16x16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#if defined(__AVX512BF16__)
/* v's lanes rounded to bf16 (to nearest even) by the CPU's own conversion. It rounds as
 * f2bf does, except that values below bf16's smallest normal (|v| < 1.2e-38) become 0 and a
 * NaN keeps its sign: one instruction where the integer version below takes six. */
static inline __m256i narrow_bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
/* v's lanes rounded to bf16 (to nearest even; NaN to the quiet NaN), as f2bf rounds. */
static inline __m256i narrow_bf16x16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
#endif

/* v's lanes rounded to bf16 and back. */
static inline __m512 round_bf16x16(__m512 v) { return widen_bf16x16(narrow_bf16x16(v)); }

/* The first min(n, 16) lanes of v stored at p as bf16, rounded. */
static inline void store_bf16x16(bf16 *p, __m512 v, long n) {
    _mm256_mask_storeu_epi16(p, mask16(n), narrow_bf16x16(v));
}

/* exp_approx on 16 lanes: the same reduction and polynomial. */
static inline __m512 exp_approx16(__m512 x) {
    __m512 n = _mm512_floor_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)));
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
    __m512i e = _mm512_cvttps_epi32(n);
    e = _mm512_min_epi32(_mm512_max_epi32(e, _mm512_set1_epi32(-126)), _mm512_set1_epi32(127));
    return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(127)), 23)));
}

/* Two rows a, b of 32 bf16 interleaved into pairs (a_i, b_i), the VNNI layout of a B tile's row:
 * pairs 0-15 (lo) and 16-31 (hi). */
static inline void interleave_pairs(__m512i a, __m512i b, __m512i *lo, __m512i *hi) {
    const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                           39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    *lo = _mm512_permutex2var_epi16(a, first, b);
    *hi = _mm512_permutex2var_epi16(a, _mm512_add_epi16(first, _mm512_set1_epi16(16)), b);
}

#else
#define HAVE_AVX512 0
#endif

/* ------------------------------------------------------------ AVX2 (CPUs without AVX-512)
 * Builds for CPUs with AVX2 and FMA but no AVX-512 (most laptops; PPOKIT_CPU_KERNELS=avx2 builds
 * them on any x86-64 CPU that has AVX2, for the tests) get hand-written 8-lane versions of
 * what the compiler does not vectorize well on its own: the attention kernels' transposes of
 * keys and values into columns (a scalar loop otherwise) and their dot products with those
 * columns (blocks of 8 keys, no more than the keys asked for, the sums in registers). The
 * elementwise kernels stay the plain loops below, which the compiler vectorizes with AVX2
 * and FMA as well as hand-written code would (docs/performance.md). */
#if !HAVE_AVX512 && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1

/* Transpose the 8 x 8 float32 matrix held in r[0..7] (row i -> column i). */
static inline void transpose8x8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);       /* a0 b0 a1 b1 | a4 b4 a5 b5 */
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);   /* a2 b2 a3 b3 | a6 b6 a7 b7 */
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);       /* a0 b0 c0 d0 | a4 b4 c4 d4 */
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);   /* a1 b1 c1 d1 | a5 .. */
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
        r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
    }
}

/* All-ones in the first n lanes (none for n <= 0, all from 8 on). */
static inline __m256i mask8(long n) {
    int k = n <= 0 ? 0 : (n >= 8 ? 8 : (int)n);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The first min(n, 8) floats at p, zero beyond (nothing past them is read). */
static inline __m256 load8_f32(const float *p, long n) {
    return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mask8(n));
}

/* The first min(n, 8) bf16 values at p as float32 lanes, zero beyond. */
static inline __m256 load8_bf16(const bf16 *p, long n) {
    __m128i h;
    if (n >= 8) {
        h = _mm_loadu_si128((const __m128i *)p);
    } else {
        uint16_t buf[8] = {0};
        memcpy(buf, p, (n > 0 ? n : 0) * sizeof(bf16));
        h = _mm_loadu_si128((const __m128i *)buf);
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* out[j] = sum_d x[d] xt[d, j] for the keys [first, stop), 8 at a time, xt [D, Sp] float32
 * columns (Sp a multiple of 8, at least stop rounded up to 8); out is written from the
 * vector of key `first` up to key stop - 1. Per vector, four register sums over every
 * fourth d, added at the end (the order of the plain version's sums). */
static void dots_with_columns(const float *x, const float *xt, long D, long first, long stop, long Sp,
                              float *out) {
    for (long j0 = first / 8 * 8; j0 < stop; j0 += 8) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const float *col = xt + j0;
        long d = 0;
        for (; d + 4 <= D; d += 4) {  /* then D % 4 rows, counted as such: a bound gcc can see */
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(x[d]), _mm256_loadu_ps(col + d * Sp), a0);
            a1 = _mm256_fmadd_ps(_mm256_set1_ps(x[d + 1]), _mm256_loadu_ps(col + (d + 1) * Sp), a1);
            a2 = _mm256_fmadd_ps(_mm256_set1_ps(x[d + 2]), _mm256_loadu_ps(col + (d + 2) * Sp), a2);
            a3 = _mm256_fmadd_ps(_mm256_set1_ps(x[d + 3]), _mm256_loadu_ps(col + (d + 3) * Sp), a3);
        }
        for (long rest = D - d; rest > 0 && rest < 4; rest--, d++)
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(x[d]), _mm256_loadu_ps(col + d * Sp), a0);
        __m256 sum = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
        if (stop - j0 >= 8) _mm256_storeu_ps(out + j0, sum);
        else _mm256_maskstore_ps(out + j0, mask8(stop - j0), sum);
    }
}
#else
#define HAVE_AVX2 0
/* out[j] = sum_d x[d] xt[d, j] for the blocks of KEY_BLOCK keys that hold the keys
 * [first, stop), xt [D, Sp] float32 columns (Sp a multiple of KEY_BLOCK, zero padded);
 * out is written from the block of key `first` up to key stop - 1. Per block, four
 * register sums over every fourth d (four independent chains of vector FMAs), added at
 * the end. */
static void dots_with_columns(const float *x, const float *xt, long D, long first, long stop, long Sp,
                              float *out) {
    for (long j0 = first / KEY_BLOCK * KEY_BLOCK; j0 < stop; j0 += KEY_BLOCK) {
        float a0[KEY_BLOCK], a1[KEY_BLOCK], a2[KEY_BLOCK], a3[KEY_BLOCK];
#pragma omp simd
        for (long j = 0; j < KEY_BLOCK; j++) a0[j] = a1[j] = a2[j] = a3[j] = 0.f;
        const float *col = xt + j0;
        long d = 0;
        for (; d + 4 <= D; d += 4) {
            float v0 = x[d], v1 = x[d + 1], v2 = x[d + 2], v3 = x[d + 3];
            const float *r0 = col + d * Sp, *r1 = r0 + Sp, *r2 = r1 + Sp, *r3 = r2 + Sp;
#pragma omp simd
            for (long j = 0; j < KEY_BLOCK; j++) {
                a0[j] += v0 * r0[j];
                a1[j] += v1 * r1[j];
                a2[j] += v2 * r2[j];
                a3[j] += v3 * r3[j];
            }
        }
        for (long rest = D - d; rest > 0 && rest < 4; rest--, d++) {  /* the D % 4 rows left */
            float v = x[d];
            const float *r = col + d * Sp;
#pragma omp simd
            for (long j = 0; j < KEY_BLOCK; j++) a0[j] += v * r[j];
        }
        long n = stop - j0 < KEY_BLOCK ? stop - j0 : KEY_BLOCK;
        for (long j = 0; j < n; j++) out[j0 + j] = (a0[j] + a1[j]) + (a2[j] + a3[j]);
    }
}

#endif

/* The hand-written vector code a build has: 512 (AVX-512), 256 (AVX2 and FMA) or 0 (none:
 * plain C, vectorized by the compiler alone). */
int kernels_vector_bits(void) { return HAVE_AVX512 ? 512 : (HAVE_AVX2 ? 256 : 0); }

/* ------------------------------------------------------------ LoRA's rank-r products on AMX
 * LoRA's products with its rank-r factors are too thin for oneDNN's matmuls to run well
 * (they take several times as long as reading their data), and r multiply-adds per
 * output element bound any vector code. These three run them on the
 * AMX tile units (bf16 products, float32 sums, one rounding), one pass over the big
 * operand each:
 *   lora_down_bf16     h = R(x m^T)            x [N, d], m [r, d]  ->  h [N, r]
 *   lora_up_add_bf16   y = R(y + s h m)        y [N, d], h [N, r], m [r, d]   (in place)
 *   lora_outer_bf16    out = R(s p^T x)        p [N, r], x [N, d]  ->  out [r, d]
 * for r <= 64 (up_add: r even). Each configures the tiles on entry and releases them on
 * exit, so that oneDNN's AMX kernels in the same thread find them as they left them.
 * lora_amx_available() says whether the build has AMX and Linux granted the tile state.
 * Builds without AMX but with AVX512-BF16 get vector versions of the three instead
 * (lora_vector_available(), below); other builds compile them to nothing, and they are
 * never called. */
#ifndef OUTER_AHEAD
#define OUTER_AHEAD 64       /* rows ahead that lora_outer_bf16 prefetches (both versions) */
#endif
#if HAVE_AVX512 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <unistd.h>
#include <sys/syscall.h>

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

int lora_amx_available(void) {
    static int granted = -1;     /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18), once */
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return granted;
}


/* Tiles 0-7 as `rows` rows of `colsb` bytes each. */
static void configure_tiles(const uint8_t rows[8], const uint16_t colsb[8]) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = rows[t]; cfg.colsb[t] = colsb[t]; }
    _tile_loadconfig(&cfg);
}

static const uint8_t FULL_ROWS[8] = {16, 16, 16, 16, 16, 16, 16, 16};
static const uint16_t FULL_COLSB[8] = {64, 64, 64, 64, 64, 64, 64, 64};

/* Tiles 0-3, four [16, 16] float32 accumulators side by side: zeroed, and stored as c [16, 64]. */
static inline void zero_accumulators(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

static inline void store_accumulators(float *c) {
    _tile_stored(0, c, 256);
    _tile_stored(1, c + 16, 256);
    _tile_stored(2, c + 32, 256);
    _tile_stored(3, c + 48, 256);
}

/* The rows x [n, cols] (row stride sx) as B tiles whose 16 columns are rows of x and whose 16
 * rows are pairs of x's columns: out[(c * tiles + t) * 512], t < tiles a tile of 16 rows
 * (rows 16 t..), c a chunk of 32 columns; rows from n on and columns from cols on are zero.
 * LoRA's down factor (rows = ranks) and the attention's keys (rows = keys) are packed so. */
static void pack_rows_as_columns(const bf16 *x, long sx, long n, long cols, long tiles, bf16 *out) {
    for (long c = 0; c < (cols + 31) / 32; c++)
        for (long t = 0; t < tiles; t++) {
            __m512 rows[16];
            __mmask32 k = mask32(cols - 32 * c);
            for (long i = 0; i < 16; i++)
                rows[i] = 16 * t + i < n ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(k, x + (16 * t + i) * sx + 32 * c))
                                         : _mm512_setzero_ps();
            transpose16x16(rows);                /* -> pair p's 16 rows */
            for (long p = 0; p < 16; p++) _mm512_storeu_ps((float *)(out + (c * tiles + t) * 512 + p * 32), rows[p]);
        }
}

/* h[n, j] = R(sum_c x[n, c] m[j, c]) for j < r (<= 64) and the rows [start, stop): x [N, d] (row
 * stride sx), m [r, d] contiguous, h [N, r] contiguous. 32 rows at a time: x's rows are the A
 * tiles, read in place (a partial last chunk of columns, and the last rows, from zero-padded
 * copies); m, packed once per call into B tiles (pairs of columns x 16 ranks), one per 32 columns
 * and 16 ranks. scratch: Rb * Kc * 512 + 32 * Kc * 32 bf16 + 512 floats (Kc = d rounded up to 32,
 * over 32; Rb = r rounded up to 16, over 16). */
void lora_down_bf16(const bf16 *x, long sx, const bf16 *m, bf16 *h, long start, long stop, long d, long r,
                    void *scratch) {
    long Kc = (d + 31) / 32, dp = Kc * 32, full = d / 32, Rb = (r + 15) / 16;
    bf16 *mp = (bf16 *)scratch;                  /* [Kc][Rb][16 pairs][16 ranks][2] */
    bf16 *xpad = mp + Rb * Kc * 512;             /* [32, dp] */
    float *cbuf = (float *)(xpad + 32 * dp);     /* [32, 16] */
    pack_rows_as_columns(m, d, r, d, Rb, mp);
    configure_tiles(FULL_ROWS, FULL_COLSB);
    for (long n0 = start; n0 < stop; n0 += 32) {
        long rows_here = stop - n0 < 32 ? stop - n0 : 32, lda = sx, in_place = full;
        const bf16 *a = x + n0 * sx;
        if (rows_here < 32) {                    /* the last rows: a zero-padded copy of them all */
            for (long i = 0; i < 32; i++)
                for (long c = 0; c < dp; c += 32)
                    _mm512_storeu_si512(xpad + i * dp + c, i < rows_here ? _mm512_maskz_loadu_epi16(mask32(d - c), a + i * sx + c)
                                                                          : _mm512_setzero_si512());
            a = xpad;
            lda = dp;
            in_place = Kc;
        } else if (full < Kc) {                  /* the partial last chunk, zero padded ([32, 32]) */
            for (long i = 0; i < 32; i++)
                _mm512_storeu_si512(xpad + i * 32, _mm512_maskz_loadu_epi16(mask32(d - 32 * full), a + i * sx + 32 * full));
        }
        for (long jb = 0; jb < Rb; jb++) {
            const bf16 *b = mp + jb * 512;       /* chunk k's tile at b + k Rb 512 */
            _tile_zero(0);
            _tile_zero(1);
            for (long k = 0; k < in_place; k++) {
                _tile_loadd(2, a + 32 * k, lda * sizeof(bf16));
                _tile_loadd(3, a + 16 * lda + 32 * k, lda * sizeof(bf16));
                _tile_loadd(4, b + k * Rb * 512, 64);
                _tile_dpbf16ps(0, 2, 4);
                _tile_dpbf16ps(1, 3, 4);
            }
            if (in_place < Kc) {
                _tile_loadd(2, xpad, 64);
                _tile_loadd(3, xpad + 16 * 32, 64);
                _tile_loadd(4, b + full * Rb * 512, 64);
                _tile_dpbf16ps(0, 2, 4);
                _tile_dpbf16ps(1, 3, 4);
            }
            _tile_stored(0, cbuf, 64);
            _tile_stored(1, cbuf + 256, 64);
            for (long i = 0; i < rows_here; i++)
                _mm256_mask_storeu_epi16(h + (n0 + i) * r + 16 * jb, mask16(r - 16 * jb),
                                         (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(cbuf + i * 16)));
        }
    }
    _tile_release();
}

/* y[n, c] = R(y[n, c] + s sum_j h[n, j] m[j, c]) for the rows [start, stop): y [N, d] (row stride
 * sy), h [N, r] contiguous (r even, <= 64), m [r, d] contiguous. 16 rows at a time: h's rows are
 * the A tiles (ranks 0-31, and 32 on in a second one); m, packed once per call into B tiles of
 * pairs of ranks x 16 columns, four per 64 columns for each A tile; the products go to float32
 * and are added to y there (the sum's one rounding).
 * scratch: Cc * 64 * r + 1024 bf16 + 1024 floats (Cc = d rounded up to 64, over 64). */
void lora_up_add_bf16(bf16 *y, long sy, const bf16 *h, const bf16 *m, long start, long stop, long d, long r,
                      float s, void *scratch) {
    long Cc = (d + 63) / 64, r1 = r < 32 ? r : 32, r2 = r - r1, p1 = r1 / 2, p2 = r2 / 2;
    bf16 *mp = (bf16 *)scratch;                  /* [Cc][4 tiles][p1][16 columns][2], then [4][p2][16][2] */
    bf16 *hpad = mp + Cc * 64 * r;               /* [16, r] */
    float *cbuf = (float *)(hpad + 1024);        /* [16, 64] */
    for (long cc = 0; cc < Cc; cc++)
        for (long q = 0; q < p1 + p2; q++) {
            const bf16 *ra = m + 2 * q * d + 64 * cc, *rb = ra + d;
            __mmask32 k0 = mask32(d - 64 * cc), k1 = mask32(d - 64 * cc - 32);
            __m512i t[4];
            interleave_pairs(_mm512_maskz_loadu_epi16(k0, ra), _mm512_maskz_loadu_epi16(k0, rb), &t[0], &t[1]);
            interleave_pairs(_mm512_maskz_loadu_epi16(k1, ra + 32), _mm512_maskz_loadu_epi16(k1, rb + 32), &t[2], &t[3]);
            long pairs = q < p1 ? p1 : p2, row = q < p1 ? q : q - p1;
            bf16 *base = mp + cc * 64 * r + (q < p1 ? 0 : 4 * p1 * 32);
            for (int u = 0; u < 4; u++) _mm512_storeu_si512(base + (u * pairs + row) * 32, t[u]);
        }
    uint8_t rows[8] = {16, 16, 16, 16, 16, (uint8_t)p1, (uint8_t)p2, (uint8_t)(p2 ? 16 : 0)};
    uint16_t colsb[8] = {64, 64, 64, 64, (uint16_t)(2 * r1), 64, (uint16_t)(p2 ? 64 : 0), (uint16_t)(2 * r2)};
    configure_tiles(rows, colsb);
    const __m512 vs = _mm512_set1_ps(s);
    for (long n0 = start; n0 < stop; n0 += 16) {
        long rows_here = stop - n0 < 16 ? stop - n0 : 16;
        const bf16 *a = h + n0 * r;
        if (rows_here < 16) {                    /* the last rows, zero padded */
            memset(hpad, 0, 16 * r * sizeof(bf16));
            memcpy(hpad, a, rows_here * r * sizeof(bf16));
            a = hpad;
        }
        _tile_loadd(4, a, r * sizeof(bf16));
        if (p2) _tile_loadd(7, a + 32, r * sizeof(bf16));
        for (long cc = 0; cc < Cc; cc++) {
            const bf16 *b1 = mp + cc * 64 * r, *b2 = b1 + 4 * p1 * 32;
            zero_accumulators();
#define UP_ADD_TILE(t)                                        \
            _tile_loadd(5, b1 + (t) * p1 * 32, 64);           \
            _tile_dpbf16ps(t, 4, 5);                          \
            if (p2) {                                         \
                _tile_loadd(6, b2 + (t) * p2 * 32, 64);       \
                _tile_dpbf16ps(t, 7, 6);                      \
            }
            UP_ADD_TILE(0)
            UP_ADD_TILE(1)
            UP_ADD_TILE(2)
            UP_ADD_TILE(3)
#undef UP_ADD_TILE
            store_accumulators(cbuf);
            for (long i = 0; i < rows_here; i++) {
                bf16 *yr = y + (n0 + i) * sy + 64 * cc;
                for (long t = 0; t < 4; t++) {
                    __mmask16 k = mask16(d - 64 * cc - 16 * t);
                    if (!k) break;
                    __m512 yv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, yr + 16 * t)), 16));
                    __m512 o = _mm512_fmadd_ps(_mm512_loadu_ps(cbuf + i * 64 + 16 * t), vs, yv);
                    _mm256_mask_storeu_epi16(yr + 16 * t, k, (__m256i)_mm512_cvtneps_pbh(o));
                }
            }
        }
    }
    _tile_release();
}

/* out[j, c] = R(s sum_n p[n, j] x[n, c]) for j < r (<= 64) and the columns [c0, c1) (c0 a multiple
 * of 64): p [N, r] contiguous, x [N, d] (row stride sx), out [r, d] contiguous. Per 64 columns
 * and 16 ranks, 32 rows at a time: p^T [16, 32] is the A tile, x's rows interleaved in pairs the
 * four B tiles. scratch: Rb * 16 * Np + 2048 bf16 + 1024 floats (Np = N rounded up to 32, Rb = r
 * rounded up to 16, over 16). */
void lora_outer_bf16(const bf16 *p, const bf16 *x, long sx, bf16 *out, long N, long d, long r, long c0, long c1,
                     float s, void *scratch) {
    long Np = (N + 31) / 32 * 32, Rb = (r + 15) / 16;
    bf16 *pt = (bf16 *)scratch;                  /* p^T [16 Rb, Np], zero padded */
    bf16 *vnni = pt + Rb * 16 * Np;              /* [4 tiles][16 pairs of rows][16 columns][2] */
    float *cbuf = (float *)(vnni + 2048);        /* [16, 64] */
    memset(pt, 0, Rb * 16 * Np * sizeof(bf16));
    for (long n = 0; n < N; n++)
        for (long j = 0; j < r; j++) pt[j * Np + n] = p[n * r + j];
    configure_tiles(FULL_ROWS, FULL_COLSB);
    const __m512 vs = _mm512_set1_ps(s);
    for (long c = c0; c < c1; c += 64)
        for (long jb = 0; jb < Rb; jb++) {
            __mmask32 k0 = mask32(c1 - c), k1 = mask32(c1 - c - 32);
            zero_accumulators();
            for (long n0 = 0; n0 < Np; n0 += 32) {
                for (long q = 0; q < 16; q++) {
                    long na = n0 + 2 * q, nb = na + 1;
                    const bf16 *ra = x + na * sx + c, *rb = x + nb * sx + c;
                    if (na + OUTER_AHEAD + 1 < N) {      /* rows further down this column strip */
                        __builtin_prefetch(ra + OUTER_AHEAD * sx);
                        __builtin_prefetch(ra + OUTER_AHEAD * sx + 32);
                        __builtin_prefetch(rb + OUTER_AHEAD * sx);
                        __builtin_prefetch(rb + OUTER_AHEAD * sx + 32);
                    }
                    __m512i a0 = na < N ? _mm512_maskz_loadu_epi16(k0, ra) : _mm512_setzero_si512();
                    __m512i b0 = nb < N ? _mm512_maskz_loadu_epi16(k0, rb) : _mm512_setzero_si512();
                    __m512i a1 = na < N ? _mm512_maskz_loadu_epi16(k1, ra + 32) : _mm512_setzero_si512();
                    __m512i b1 = nb < N ? _mm512_maskz_loadu_epi16(k1, rb + 32) : _mm512_setzero_si512();
                    __m512i t0, t1, t2, t3;
                    interleave_pairs(a0, b0, &t0, &t1);
                    interleave_pairs(a1, b1, &t2, &t3);
                    _mm512_storeu_si512(vnni + q * 32, t0);
                    _mm512_storeu_si512(vnni + 512 + q * 32, t1);
                    _mm512_storeu_si512(vnni + 1024 + q * 32, t2);
                    _mm512_storeu_si512(vnni + 1536 + q * 32, t3);
                }
                _tile_loadd(4, pt + jb * 16 * Np + n0, Np * sizeof(bf16));
                _tile_loadd(5, vnni, 64);
                _tile_loadd(6, vnni + 512, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(5, vnni + 1024, 64);
                _tile_loadd(6, vnni + 1536, 64);
                _tile_dpbf16ps(2, 4, 5);
                _tile_dpbf16ps(3, 4, 6);
            }
            store_accumulators(cbuf);
            for (long j = 16 * jb; j < r && j < 16 * jb + 16; j++)
                for (long t = 0; t < 4; t++) {
                    __mmask16 k = mask16(c1 - c - 16 * t);
                    if (!k) break;
                    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(cbuf + (j - 16 * jb) * 64 + 16 * t), vs);
                    _mm256_mask_storeu_epi16(out + j * d + c + 16 * t, k, (__m256i)_mm512_cvtneps_pbh(v));
                }
        }
    _tile_release();
}

/* ------------------------------------------------------------ attention on AMX
 * The attention kernels' products for bf16 on the AMX tile units, one KV group (b, g) at
 * a time, for up to 64 queries and 64 keys and head sizes a multiple of 32 up to 128:
 * each product a few tile instructions where the vector kernels make a pass per query
 * row. The formulas and roundings are those of attention_group and
 * attention_group_backward (see there); float32 sums of exact bf16 products, in another
 * order than the vector kernels add them. The per-row work (rounding, mask, softmax) runs
 * on whole AVX-512 vectors. The callers configure the tiles once per call. */
#define HAVE_AMX 1
#define ATT_AMX_KEYS 64              /* the most keys (and queries) a group may have here */

/* The rows x [n, D] (row stride sx; D a multiple of 32) as B tiles whose rows are pairs of
 * x's rows (the contraction runs over them) and whose columns are 16 of x's columns:
 * out[(s * (D / 16) + c) * 512], s = step of 32 rows, c = 16 columns; rows from n up to
 * 64 are zero. */
static void pack_row_pairs(const bf16 *x, long sx, long n, long D, bf16 *out) {
    long DT = D / 16;
    for (long s = 0; s < 2; s++)
        for (long p = 0; p < 16; p++) {
            long ra = 32 * s + 2 * p, rb = ra + 1;
            for (long c = 0; c < D; c += 32) {
                __m512i a = ra < n ? _mm512_loadu_si512(x + ra * sx + c) : _mm512_setzero_si512();
                __m512i b = rb < n ? _mm512_loadu_si512(x + rb * sx + c) : _mm512_setzero_si512();
                __m512i lo, hi;
                interleave_pairs(a, b, &lo, &hi);
                _mm512_storeu_si512(out + (s * DT + c / 16) * 512 + p * 32, lo);
                _mm512_storeu_si512(out + (s * DT + c / 16 + 1) * 512 + p * 32, hi);
            }
        }
}

/* The next 16 rows of an A operand: rows [0, n) of x (row stride sx, `cols` bf16 wide) in
 * place when there are 16 of them, else copied into pad [16, cols] with zero rows. */
static const bf16 *a_rows(const bf16 *x, long sx, long n, long cols, bf16 *pad, long *stride) {
    if (n >= 16) {
        *stride = sx;
        return x;
    }
    for (long i = 0; i < 16; i++)
        for (long c = 0; c < cols; c += 32)
            _mm512_storeu_si512(pad + i * cols + c, i < n ? _mm512_loadu_si512(x + i * sx + c) : _mm512_setzero_si512());
    *stride = cols;
    return pad;
}

/* Ask for `rows` rows of `bytes` bytes (row stride `stride` elements of `size` bytes) to be
 * brought into the caches: the next KV group's operands, while this one computes. */
static inline void prefetch_rows(const void *base, long rows, long stride, long size, long bytes) {
    for (long r = 0; r < rows; r++)
        for (long c = 0; c < bytes; c += 64) __builtin_prefetch((const char *)base + r * stride * size + c);
}

/* KV group grp's operands asked into the caches (while the group before it computes): its
 * heads' query rows, its keys and values, and for the backward (go not NULL) the heads'
 * upstream gradient rows and softmax probabilities. */
static void prefetch_group(long grp, long H, long Hkv, long T, long S, long D, const bf16 *q, long sq_b, long sq_h,
                           long sq_t, const bf16 *k, long sk_b, long sk_h, long sk_t, const bf16 *v, long sv_b,
                           long sv_h, long sv_t, const bf16 *go, long sg_b, long sg_h, long sg_t, const float *probs) {
    long b = grp / Hkv, g = grp % Hkv, rep = H / Hkv;
    for (long h = g * rep; h < (g + 1) * rep; h++) {
        prefetch_rows(q + b * sq_b + h * sq_h, T, sq_t, 2, 2 * D);
        if (go) {
            prefetch_rows(go + b * sg_b + h * sg_h, T, sg_t, 2, 2 * D);
            prefetch_rows(probs + (b * H + h) * T * S, 1, 0, 4, 4 * T * S);
        }
    }
    prefetch_rows(k + b * sk_b + g * sk_h, S, sk_t, 2, 2 * D);
    prefetch_rows(v + b * sv_b + g * sv_h, S, sv_t, 2, 2 * D);
}

/* c[16, 64] (float32, row stride 64) = the sum over `heads` x `steps` products of an A tile
 * [16, 32] (at a + h a_head + s a_step, row stride sa bf16) with the B tiles for column
 * tiles t < nt (<= 4) at b[h b_head + (s bstep + t) 512]. */
static inline void tile_products(long heads, const bf16 *a, long a_head, long a_step, long sa, long steps,
                                 const bf16 *b, long b_head, long bstep, long nt, float *c) {
    zero_accumulators();
    for (long h = 0; h < heads; h++)
        for (long s = 0; s < steps; s++) {
            _tile_loadd(4, a + h * a_head + s * a_step, sa * sizeof(bf16));
            const bf16 *bs = b + h * b_head + s * bstep * 512;
            _tile_loadd(5, bs, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (nt > 1) { _tile_loadd(6, bs + 512, 64); _tile_dpbf16ps(1, 4, 6); }
            if (nt > 2) { _tile_loadd(7, bs + 1024, 64); _tile_dpbf16ps(2, 4, 7); }
            if (nt > 3) { _tile_loadd(5, bs + 1536, 64); _tile_dpbf16ps(3, 4, 5); }
        }
    store_accumulators(c);
}

/* c [16, D] float32 (row stride D) = rows of A [16, 32 steps] (row stride sa, in place)
 * times the B tiles b[(step (D / 16) + t) 512], four column tiles at a time (c64: [16, 64]). */
static inline void tile_product_wide(const bf16 *a, long sa, long steps, const bf16 *b, long D, float *c, float *c64) {
    long DT = D / 16;
    for (long t0 = 0; t0 < DT; t0 += 4) {
        long nt = DT - t0 < 4 ? DT - t0 : 4;
        tile_products(1, a, 0, 32, sa, steps, b + t0 * 512, 0, DT, nt, c64);
        for (long i = 0; i < 16; i++)
            for (long t = 0; t < nt; t++) _mm512_storeu_ps(c + i * D + 16 * (t0 + t), _mm512_loadu_ps(c64 + i * 64 + 16 * t));
    }
}


/* attention_group on AMX (see there): T, S <= 64, D a multiple of 32 up to 128. */
static void attention_group_amx(const bf16 *q, const bf16 *kb, const bf16 *vb, const float *mask, bf16 *out,
                                float *probs, float *scratch, long b, long g, long H, long rep, long T, long S, long D,
                                long sq_b, long sq_h, long sq_t, long sk_t, long sv_t, long sm_b, float scale,
                                int round_mask) {
    long DT = D / 16, CT = (S + 15) / 16, KS = D / 32, JS = (S + 31) / 32, nv = (S + 15) / 16;
    bf16 *kp = (bf16 *)scratch;                          /* keys as columns: [KS][4][512] */
    bf16 *vp = kp + KS * 4 * 512;                        /* values in row pairs: [2][DT][512] */
    bf16 *apad = vp + 2 * DT * 512;                      /* [16, D] */
    bf16 *pb = apad + 16 * 128;                          /* R(p) [16, 64] */
    float *sc = (float *)(pb + 16 * 64);                 /* scores [16, 64] */
    float *ob = sc + 16 * 64;                            /* [16, D] */
    pack_rows_as_columns(kb, sk_t, S, D, 4, kp);
    pack_row_pairs(vb, sv_t, S, D, vp);
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    for (long h = g * rep; h < (g + 1) * rep; h++)
        for (long t0 = 0; t0 < T; t0 += 16) {
            long rows = T - t0 < 16 ? T - t0 : 16, sa;
            const bf16 *a = a_rows(q + b * sq_b + h * sq_h + t0 * sq_t, sq_t, rows, D, apad, &sa);
            tile_products(1, a, 0, 32, sa, KS, kp, 0, 4, CT, sc);                               /* q k^T [16, 64] */
            for (long i = 0; i < 16; i++) {
                long t = t0 + i;
                if (i >= rows) {
                    for (long c = 0; c < 2; c++) _mm512_storeu_si512(pb + i * 64 + 32 * c, _mm512_setzero_si512());
                    continue;
                }
                const float *m = mask ? mask + b * sm_b + t * S : 0;
                __m512 x[4];                             /* keys past S: -inf, p = 0 */
                for (long c = 0; c < nv; c++) {
                    __mmask16 k = mask16(S - 16 * c);
                    x[c] = round_bf16x16(_mm512_mul_ps(round_bf16x16(_mm512_loadu_ps(sc + i * 64 + 16 * c)), vscale));
                    if (m) {
                        x[c] = _mm512_add_ps(x[c], _mm512_maskz_loadu_ps(k, m + 16 * c));
                        if (round_mask) x[c] = round_bf16x16(x[c]);
                    }
                    x[c] = _mm512_mask_mov_ps(x[c], ~k, ninf);
                }
                __m512 top = x[0];
                for (long c = 1; c < nv; c++) top = _mm512_max_ps(top, x[c]);
                __m512 vtop = _mm512_set1_ps(_mm512_reduce_max_ps(top)), sum = _mm512_setzero_ps();
                for (long c = 0; c < nv; c++) {
                    __m512 e = _mm512_sub_ps(x[c], vtop);
                    x[c] = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(e, _mm512_set1_ps(-87.f), _CMP_GT_OQ), exp_approx16(e));
                    sum = _mm512_add_ps(sum, x[c]);
                }
                __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
                float *pr = probs + ((b * H + h) * T + t) * S;
                for (long c = 0; c < 4; c++) {
                    __m512 p = c < nv ? _mm512_mul_ps(x[c], inv) : _mm512_setzero_ps();
                    if (c < nv) _mm512_mask_storeu_ps(pr + 16 * c, mask16(S - 16 * c), p);
                    store_bf16x16(pb + i * 64 + 16 * c, _mm512_maskz_mov_ps(mask16(S - 16 * c), p), 16);
                }
            }
            tile_product_wide(pb, 64, JS, vp, D, ob, sc);                         /* R(p) v [16, D] */
            for (long i = 0; i < rows; i++) {
                bf16 *o = out + ((b * T + t0 + i) * H + h) * D;
                for (long c = 0; c < DT; c++) store_bf16x16(o + 16 * c, _mm512_loadu_ps(ob + i * D + 16 * c), 16);
            }
        }
}

/* The 16 x 16 blocks of pairs that pack_row_pairs made of x [n <= 64, 64] (4 column tiles,
 * 2 steps) transposed: aT[(c * 2 + s) * 512] is x^T's rows 16 c.. (x's columns) over x's
 * rows 32 s.., an A tile [16, 32] of row stride 32. */
static void transpose_pairs(const bf16 *pairs, bf16 *aT) {
    for (long s = 0; s < 2; s++)
        for (long c = 0; c < 4; c++) {
            __m512 r[16];
            for (long i = 0; i < 16; i++) r[i] = _mm512_loadu_ps((const float *)(pairs + (s * 4 + c) * 512 + i * 32));
            transpose16x16(r);
            for (long i = 0; i < 16; i++) _mm512_storeu_ps((float *)(aT + (c * 2 + s) * 512 + i * 32), r[i]);
        }
}

/* attention_group_backward on AMX (see there): T, S <= 64, D a multiple of 32 up to 128. */
static void attention_group_backward_amx(const bf16 *q, const bf16 *kb, const bf16 *vb, const float *probs,
                                         const bf16 *go, bf16 *dq, bf16 *dk, bf16 *dv, float *scratch, long b,
                                         long g, long H, long Hkv, long rep, long T, long S, long D, long sq_b,
                                         long sq_h, long sq_t, long sk_t, long sv_t, long sg_b, long sg_t, long sg_h,
                                         float scale) {
    long DT = D / 16, KS = D / 32, CT = (S + 15) / 16, JS = (S + 31) / 32, TS = (T + 31) / 32, nv = (S + 15) / 16;
    long per_head = 4 * DT * 512 + 2 * 4096;
    bf16 *vc = (bf16 *)scratch;                          /* values as columns [KS][4][512] (dP = go v^T) */
    bf16 *kpairs = vc + KS * 4 * 512;                    /* keys in row pairs [2][DT][512] (dq = dz k) */
    bf16 *heads = kpairs + 2 * DT * 512;                 /* per head: q and go in row pairs, dz^T, R(p)^T */
    bf16 *apad = heads + rep * per_head;                 /* [16, D] */
    bf16 *dz = apad + 16 * 128;                          /* dz rows [64, 64] */
    bf16 *pr = dz + 4096;                                /* R(p) rows [64, 64] */
    bf16 *tmp = pr + 4096;                               /* [2][4][512] */
    float *sc = (float *)(tmp + 4096);                   /* [16, 64] */
    float *ob = sc + 16 * 64;                            /* [16, D] */
    pack_rows_as_columns(vb, sv_t, S, D, 4, vc);
    pack_row_pairs(kb, sk_t, S, D, kpairs);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (long hi = 0; hi < rep; hi++) {
        long h = g * rep + hi;
        bf16 *qpairs = heads + hi * per_head, *gpairs = qpairs + 2 * DT * 512, *dzT = gpairs + 2 * DT * 512,
             *prT = dzT + 4096;
        const bf16 *qh = q + b * sq_b + h * sq_h, *gh = go + b * sg_b + h * sg_h;
        pack_row_pairs(qh, sq_t, T, D, qpairs);
        pack_row_pairs(gh, sg_t, T, D, gpairs);
        for (long t0 = 0; t0 < T; t0 += 16) {
            long rows = T - t0 < 16 ? T - t0 : 16, sa;
            const bf16 *a = a_rows(gh + t0 * sg_t, sg_t, rows, D, apad, &sa);
            tile_products(1, a, 0, 32, sa, KS, vc, 0, 4, CT, sc);                 /* go v^T [16, 64] */
            for (long i = 0; i < rows; i++) {
                long t = t0 + i;
                const float *p = probs + ((b * H + h) * T + t) * S;
                __m512 pv[4], dp[4], acc = _mm512_setzero_ps();   /* keys past S: p = 0, dP = 0 */
                for (long c = 0; c < nv; c++) {
                    pv[c] = _mm512_maskz_loadu_ps(mask16(S - 16 * c), p + 16 * c);
                    dp[c] = round_bf16x16(_mm512_loadu_ps(sc + i * 64 + 16 * c));
                    acc = _mm512_fmadd_ps(dp[c], pv[c], acc);
                }
                __m512 dot = _mm512_set1_ps(_mm512_reduce_add_ps(acc));
                for (long c = 0; c < 4; c++) {
                    __m512 z = _mm512_setzero_ps(), r = _mm512_setzero_ps();
                    if (c < nv) {
                        z = round_bf16x16(_mm512_mul_ps(round_bf16x16(_mm512_mul_ps(pv[c], _mm512_sub_ps(dp[c], dot))), vscale));
                        r = pv[c];
                    }
                    store_bf16x16(dz + t * 64 + 16 * c, z, 16);
                    store_bf16x16(pr + t * 64 + 16 * c, r, 16);
                }
            }
            tile_product_wide(dz + t0 * 64, 64, JS, kpairs, D, ob, sc);             /* dz k [16, D] */
            for (long i = 0; i < rows; i++) {
                bf16 *o = dq + ((b * H + h) * T + t0 + i) * D;
                for (long c = 0; c < DT; c++) store_bf16x16(o + 16 * c, _mm512_loadu_ps(ob + i * D + 16 * c), 16);
            }
        }
        pack_row_pairs(dz, 64, T, 64, tmp);
        transpose_pairs(tmp, dzT);
        pack_row_pairs(pr, 64, T, 64, tmp);
        transpose_pairs(tmp, prT);
    }
    /* dk = sum over the heads of dz^T q, dv = sum of R(p)^T go: [16 keys, 64 columns] at a time */
    for (long c = 0; c < CT; c++) {
        long rows = S - 16 * c < 16 ? S - 16 * c : 16;
        for (long t0 = 0; t0 < DT; t0 += 4) {
            long nt = DT - t0 < 4 ? DT - t0 : 4;
            for (long which = 0; which < 2; which++) {
                const bf16 *a = heads + 4 * DT * 512 + (which ? 4096 : 0) + c * 1024;
                const bf16 *bt = heads + (which ? 2 * DT * 512 : 0) + t0 * 512;
                tile_products(rep, a, per_head, 512, 32, TS, bt, per_head, DT, nt, sc);
                for (long i = 0; i < rows; i++) {
                    long j = 16 * c + i;
                    bf16 *o = which ? dv + ((b * S + j) * Hkv + g) * D : dk + ((b * Hkv + g) * S + j) * D;
                    for (long t = 0; t < nt; t++) store_bf16x16(o + 16 * (t0 + t), _mm512_loadu_ps(sc + i * 64 + 16 * t), 16);
                }
            }
        }
    }
}

/* Whether the attention kernels run a call on AMX: the tile state granted, at most 64
 * queries and keys, a head size a multiple of 32 up to 128. */
int attention_on_amx(long T, long S, long D) {
    return T <= ATT_AMX_KEYS && S <= ATT_AMX_KEYS && D % 32 == 0 && D <= 128 && lora_amx_available();
}

/* Floats of scratch attention_group_amx and attention_group_backward_amx need (per
 * thread) for a group of `rep` heads of head size D. */
long attention_amx_scratch_floats(long rep, long D) {
    long DT = D / 16, bf16s = (D / 32) * 4 * 512 + 2 * DT * 512 + rep * (4 * DT * 512 + 2 * 4096) + 16 * 128
                              + 3 * 4096 + 16 * 64;
    return bf16s / 2 + 16 * 64 + 16 * 128 + 64;
}
int lora_vector_available(void) { return 0; }    /* the tile kernels above take their place */
#else
int lora_amx_available(void) { return 0; }
long attention_amx_scratch_floats(long rep, long D) { return 0; }
int attention_on_amx(long T, long S, long D) { return 0; }
#if HAVE_AVX512 && defined(__AVX512BF16__)
/* ------------------------------------------------------------ LoRA's rank-r products on vectors
 * The same three products and roundings as the AMX kernels above, for CPUs with
 * AVX512-BF16 but no tile units (AMD's Zen 4): each vdpbf16ps multiplies 16 pairs of bf16
 * and adds them to float32 sums, one pass over the big operand per call. At a decoding
 * step's few hundred rows oneDNN's bf16 matmuls pay a fixed cost per call that these do
 * not; on the update's thousands of rows oneDNN's addmm_ runs at the memory bound and
 * these do not win, so ppokit calls them for decoding steps only (fused_lora.py). (On
 * Intel's CPUs vdpbf16ps runs at half the rate of float32 FMAs: there the AMX ones run.)
 * r even, at most LORA_VEC_MAX_RANK. */
#define LORA_VEC_MAX_RANK 64

int lora_vector_available(void) { return 1; }

/* The 8 lanes' horizontal sums of a[0..7]. */
static inline __m256 sum_lanes8(const __m512 a[8]) {
    __m256 b[8];
    for (int i = 0; i < 8; i++) b[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm512_extractf32x8_ps(a[i], 1));
    __m256 s01 = _mm256_hadd_ps(b[0], b[1]), s23 = _mm256_hadd_ps(b[2], b[3]);
    __m256 s45 = _mm256_hadd_ps(b[4], b[5]), s67 = _mm256_hadd_ps(b[6], b[7]);
    __m256 s03 = _mm256_hadd_ps(s01, s23), s47 = _mm256_hadd_ps(s45, s67);   /* [0-3 low, 0-3 high] */
    return _mm256_add_ps(_mm256_permute2f128_ps(s03, s47, 0x20), _mm256_permute2f128_ps(s03, s47, 0x31));
}

/* h = R(x m^T) for the rows [start, stop): m copied into scratch as [8 groups, dp] rows
 * zero padded to dp = d rounded up to 32 and to a multiple of 8 rows (scratch: 2 * 8
 * ceil(r / 8) dp bytes). */
void lora_down_bf16(const bf16 *x, long sx, const bf16 *m, bf16 *h, long start, long stop, long d, long r,
                    void *scratch) {
    long dp = (d + 31) / 32 * 32, groups = (r + 7) / 8;
    bf16 *mp = (bf16 *)scratch;
    memset(mp, 0, groups * 8 * dp * sizeof(bf16));
    for (long j = 0; j < r; j++) memcpy(mp + j * dp, m + j * d, d * sizeof(bf16));
    for (long i = start; i < stop; i++) {
        const bf16 *xr = x + i * sx;
        for (long g = 0; g < groups; g++) {
            __m512 acc[8];
            for (int k = 0; k < 8; k++) acc[k] = _mm512_setzero_ps();
            for (long c = 0; c < dp; c += 32) {
                __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask32(d - c), xr + c);
                for (int k = 0; k < 8; k++)
                    acc[k] = _mm512_dpbf16_ps(acc[k], xv, (__m512bh)_mm512_loadu_si512(mp + (g * 8 + k) * dp + c));
            }
            float sums[8];
            _mm256_storeu_ps(sums, sum_lanes8(acc));
            for (long k = 0; k < 8 && g * 8 + k < r; k++) h[i * r + g * 8 + k] = f2bf(sums[k]);
        }
    }
}

/* y = R(y + s h m) in place for the rows [start, stop): m's rows interleaved in pairs into
 * scratch as [r / 2, dp] 32-bit words (m[2k, c], m[2k + 1, c]), dp = d rounded up to 16
 * (scratch: 2 r dp bytes). */
void lora_up_add_bf16(bf16 *y, long sy, const bf16 *h, const bf16 *m, long start, long stop, long d, long r,
                      float s, void *scratch) {
    long dp = (d + 15) / 16 * 16, pairs = r / 2;
    uint32_t *mp = (uint32_t *)scratch;
    for (long k = 0; k < pairs; k++)
        for (long c = 0; c < dp; c++)
            mp[k * dp + c] = c < d ? (uint32_t)m[2 * k * d + c] | (uint32_t)m[(2 * k + 1) * d + c] << 16 : 0u;
    const __m512 vs = _mm512_set1_ps(s);
    for (long i = start; i < stop; i++) {
        uint32_t hp[LORA_VEC_MAX_RANK / 2];
        memcpy(hp, h + i * r, r * sizeof(bf16));
        bf16 *yr = y + i * sy;
        for (long c0 = 0; c0 < d; c0 += 64) {      /* four independent sums in flight */
            __m512 acc[4];
            for (int t = 0; t < 4; t++) acc[t] = _mm512_setzero_ps();
            long nt = (d - c0 + 15) / 16 < 4 ? (d - c0 + 15) / 16 : 4;
            for (long k = 0; k < pairs; k++) {
                __m512bh hv = (__m512bh)_mm512_set1_epi32((int)hp[k]);
                for (int t = 0; t < 4; t++)
                    if (t < nt) acc[t] = _mm512_dpbf16_ps(acc[t], hv, (__m512bh)_mm512_loadu_si512(mp + k * dp + c0 + 16 * t));
            }
            for (int t = 0; t < nt; t++) {
                long c = c0 + 16 * t;
                __mmask16 mk = mask16(d - c);
                __m512 yv = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, yr + c)), 16));
                _mm256_mask_storeu_epi16(yr + c, mk, (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(acc[t], vs, yv)));
            }
        }
    }
}

/* out = R(s p^T x) for the columns [c0, c1): strips of 32 columns, ranks 8 at a time, the
 * rows of x in pairs interleaved as vdpbf16ps takes them (scratch unused). */
void lora_outer_bf16(const bf16 *p, const bf16 *x, long sx, bf16 *out, long N, long d, long r, long c0, long c1,
                     float s, void *scratch) {
    const __m512 vs = _mm512_set1_ps(s);
    for (long c = c0; c < c1; c += 32) {
        __mmask32 kc = mask32(c1 - c);
        for (long g = 0; g < r; g += 8) {
            long nk = r - g < 8 ? r - g : 8;
            __m512 acc[8][2];
            for (int k = 0; k < 8; k++) acc[k][0] = acc[k][1] = _mm512_setzero_ps();
            for (long n = 0; n < N; n += 2) {
                const bf16 *ra = x + n * sx + c, *pa = p + n * r + g;
                int second = n + 1 < N;
                if (n + OUTER_AHEAD + 1 < N) {          /* rows further down this column strip */
                    __builtin_prefetch(ra + OUTER_AHEAD * sx);
                    __builtin_prefetch(ra + (OUTER_AHEAD + 1) * sx);
                }
                __m512i a = _mm512_maskz_loadu_epi16(kc, ra);
                __m512i b = second ? _mm512_maskz_loadu_epi16(kc, ra + sx) : _mm512_setzero_si512();
                __m512i lo, hi;
                interleave_pairs(a, b, &lo, &hi);
                for (int k = 0; k < 8; k++) {
                    if (k >= nk) break;
                    uint32_t w = (uint32_t)pa[k] | (second ? (uint32_t)pa[r + k] << 16 : 0u);
                    __m512bh pw = (__m512bh)_mm512_set1_epi32((int)w);
                    acc[k][0] = _mm512_dpbf16_ps(acc[k][0], pw, (__m512bh)lo);
                    acc[k][1] = _mm512_dpbf16_ps(acc[k][1], pw, (__m512bh)hi);
                }
            }
            for (long k = 0; k < nk; k++)
                for (int t = 0; t < 2; t++) {
                    __mmask16 mk = mask16(c1 - c - 16 * t);
                    if (mk)
                        _mm256_mask_storeu_epi16(out + (g + k) * d + c + 16 * t, mk,
                                                 (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[k][t], vs)));
                }
        }
    }
}
#else
int lora_vector_available(void) { return 0; }
void lora_down_bf16(const bf16 *x, long sx, const bf16 *m, bf16 *h, long start, long stop, long d, long r,
                    void *scratch) {}
void lora_up_add_bf16(bf16 *y, long sy, const bf16 *h, const bf16 *m, long start, long stop, long d, long r,
                      float s, void *scratch) {}
void lora_outer_bf16(const bf16 *p, const bf16 *x, long sx, bf16 *out, long N, long d, long r, long c0, long c1,
                     float s, void *scratch) {}
#endif
#endif

#define KERNEL_BODY
#define ELEM bf16
#define LOAD bf2f
#define STORE f2bf
#define ROUND round_bf
#define NAME(name) name##_bf16
#define ELEM_IS_BF16 1
#include __FILE__
#undef ELEM_IS_BF16
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
#define ELEM_IS_BF16 0
#include __FILE__

#else /* KERNEL_BODY: the kernels, for the element type ELEM */

#if HAVE_AVX512
/* The first min(n, 16) ELEMs at p as float32 lanes, zero beyond. */
static inline __m512 NAME(load16)(const ELEM *p, long n) {
    __mmask16 m = mask16(n);
#if ELEM_IS_BF16
    return widen_bf16x16(_mm256_maskz_loadu_epi16(m, p));
#else
    return _mm512_maskz_loadu_ps(m, p);
#endif
}

/* v's lanes rounded to ELEM (bf16: as narrow_bf16x16 rounds; float32: unchanged). */
static inline __m512 NAME(round16)(__m512 v) {
#if ELEM_IS_BF16
    return round_bf16x16(v);
#else
    return v;
#endif
}

/* The first min(n, 16) lanes of v stored at p as ELEMs, rounded as STORE rounds. */
static inline void NAME(store16)(ELEM *p, __m512 v, long n) {
#if ELEM_IS_BF16
    store_bf16x16(p, v, n);
#else
    _mm512_mask_storeu_ps(p, mask16(n), v);
#endif
}
#endif

#if HAVE_AVX512
/* The elementwise kernels below on whole AVX-512 vectors (16 values at a time, masked at
 * the end of a row): the same formulas and roundings as the plain loops after them, which
 * other builds compile. The compiler vectorizes those loops too, but emulates each bf16
 * rounding with integer operations; here a CPU with AVX512-BF16 rounds with its own
 * conversion instruction (narrow_bf16x16; docs/performance.md). RMSNorm's sum of squares
 * adds its terms in another order. */
void NAME(rms_norm_forward)(const ELEM *x, const ELEM *w, ELEM *y, float *rstd, long rows, long d, float eps) {
    for (long i = 0; i < rows; i++) {
        const ELEM *xr = x + i * d;
        ELEM *yr = y + i * d;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        long j = 0;
        for (; j + 32 <= d; j += 32) {
            __m512 a = NAME(load16)(xr + j, 16), b = NAME(load16)(xr + j + 16, 16);
            acc0 = _mm512_fmadd_ps(a, a, acc0);
            acc1 = _mm512_fmadd_ps(b, b, acc1);
        }
        for (; j < d; j += 16) {
            __m512 a = NAME(load16)(xr + j, d - j);
            acc0 = _mm512_fmadd_ps(a, a, acc0);
        }
        float r = 1.f / sqrtf(_mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) / (float)d + eps);
        const __m512 vr = _mm512_set1_ps(r);
        for (j = 0; j < d; j += 16) {
            __m512 normed = NAME(round16)(_mm512_mul_ps(NAME(load16)(xr + j, d - j), vr));
            NAME(store16)(yr + j, _mm512_mul_ps(NAME(load16)(w + j, d - j), normed), d - j);
        }
        rstd[i] = r;
    }
}

void NAME(rms_norm_backward)(const ELEM *g, const ELEM *x, const ELEM *w, const float *rstd, ELEM *dx, long rows,
                       long d) {
    for (long i = 0; i < rows; i++) {
        const ELEM *gr = g + i * d, *xr = x + i * d;
        ELEM *dr = dx + i * d;
        float r = rstd[i];
        __m512 acc = _mm512_setzero_ps();
        for (long j = 0; j < d; j += 16) {
            __m512 gh = NAME(round16)(_mm512_mul_ps(NAME(load16)(gr + j, d - j), NAME(load16)(w + j, d - j)));
            acc = _mm512_fmadd_ps(gh, NAME(load16)(xr + j, d - j), acc);
        }
        const __m512 vr = _mm512_set1_ps(r), vc = _mm512_set1_ps(r * r * r * _mm512_reduce_add_ps(acc) / (float)d);
        for (long j = 0; j < d; j += 16) {
            __m512 gh = NAME(round16)(_mm512_mul_ps(NAME(load16)(gr + j, d - j), NAME(load16)(w + j, d - j)));
            NAME(store16)(dr + j, _mm512_sub_ps(_mm512_mul_ps(vr, gh), _mm512_mul_ps(vc, NAME(load16)(xr + j, d - j))),
                          d - j);
        }
    }
}

void NAME(silu_mul_forward)(const ELEM *gate, const ELEM *up, ELEM *out, long n) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (long i = 0; i < n; i += 16) {
        __m512 g = NAME(load16)(gate + i, n - i);
        __m512 a = NAME(round16)(_mm512_div_ps(g, _mm512_add_ps(one, exp_approx16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
        NAME(store16)(out + i, _mm512_mul_ps(a, NAME(load16)(up + i, n - i)), n - i);
    }
}

void NAME(silu_mul_backward)(const ELEM *grad, const ELEM *gate, const ELEM *up, ELEM *dgate, ELEM *dup, long n) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (long i = 0; i < n; i += 16) {
        __m512 g = NAME(load16)(gate + i, n - i), go = NAME(load16)(grad + i, n - i);
        __m512 sg = _mm512_div_ps(one, _mm512_add_ps(one, exp_approx16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        NAME(store16)(dup + i, _mm512_mul_ps(go, NAME(round16)(_mm512_mul_ps(g, sg))), n - i);
        __m512 da = NAME(round16)(_mm512_mul_ps(go, NAME(load16)(up + i, n - i)));
        __m512 slope = _mm512_mul_ps(sg, _mm512_fmadd_ps(g, _mm512_sub_ps(one, sg), one));     /* s (1 + g (1 - s)) */
        NAME(store16)(dgate + i, _mm512_mul_ps(da, slope), n - i);
    }
}

void NAME(rotary)(const ELEM *q, const ELEM *cos_, const ELEM *sin_, ELEM *out, long B, long H, long T, long D,
            long sq_b, long sq_h, long sq_t, long sc_b, long sc_t, int backward) {
    long half = D / 2;
    for (long b = 0; b < B; b++)
        for (long h = 0; h < H; h++)
            for (long t = 0; t < T; t++) {
                const ELEM *qr = q + b * sq_b + h * sq_h + t * sq_t;
                const ELEM *cr = cos_ + b * sc_b + t * sc_t, *sr = sin_ + b * sc_b + t * sc_t;
                ELEM *o = out + ((b * H + h) * T + t) * D;
                for (long j = 0; j < half; j += 16) {
                    long n = half - j;
                    __m512 lo = NAME(load16)(qr + j, n), hi = NAME(load16)(qr + half + j, n);
                    __m512 c_lo = NAME(load16)(cr + j, n), c_hi = NAME(load16)(cr + half + j, n);
                    __m512 s_lo = NAME(load16)(sr + j, n), s_hi = NAME(load16)(sr + half + j, n);
                    __m512 lo_c = NAME(round16)(_mm512_mul_ps(lo, c_lo)), hi_c = NAME(round16)(_mm512_mul_ps(hi, c_hi));
                    if (backward) {      /* g[j] c[j] + g[j+half] s[j+half];  g[j+half] c[j+half] - g[j] s[j] */
                        NAME(store16)(o + j, _mm512_add_ps(lo_c, NAME(round16)(_mm512_mul_ps(hi, s_hi))), n);
                        NAME(store16)(o + half + j, _mm512_sub_ps(hi_c, NAME(round16)(_mm512_mul_ps(lo, s_lo))), n);
                    } else {             /* q[j] c[j] - q[j+half] s[j];  q[j+half] c[j+half] + q[j] s[j+half] */
                        NAME(store16)(o + j, _mm512_sub_ps(lo_c, NAME(round16)(_mm512_mul_ps(hi, s_lo))), n);
                        NAME(store16)(o + half + j, _mm512_add_ps(hi_c, NAME(round16)(_mm512_mul_ps(lo, s_hi))), n);
                    }
                }
            }
}
#else
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
#endif

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
    float inv = 1.f / exp_shifted(s, T, top);
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

#if HAVE_AVX512
/* decode_row with AVX-512 (D <= MAX_HEAD_DIM), the same formulas and roundings: the scores
 * 16 keys at a time (one vector of partial sums over d per key, a register transpose, a
 * sum: no horizontal sum per key), the weighted sum of values in registers. The dots add
 * their terms in another order than decode_row's loop, as any two builds may. */
static inline __attribute__((always_inline)) void NAME(decode_row16)(
        const ELEM *qr, const ELEM *kb, const ELEM *vb, const float *m, ELEM *o, float *scratch, long T, long D,
        long sk_t, long sv_t, float scale, int round_mask) {
    long nc = (D + 15) / 16;
    __m512 qv[MAX_HEAD_DIM / 16], acc[MAX_HEAD_DIM / 16];
    for (long c = 0; c < nc; c++) qv[c] = NAME(load16)(qr + 16 * c, D - 16 * c);
    float *s = scratch;
    const __m512 vscale = _mm512_set1_ps(scale);
    __m512 vtop = _mm512_set1_ps(-INFINITY);
    for (long j0 = 0; j0 < T; j0 += 16) {
        long n = T - j0 < 16 ? T - j0 : 16;
        __mmask16 km = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
        __m512 part[16];
        for (long i = 0; i < 16; i++) {
            __m512 a = _mm512_setzero_ps();
            if (i < n) {
                const ELEM *kr = kb + (j0 + i) * sk_t;
                for (long c = 0; c < nc; c++) a = _mm512_fmadd_ps(qv[c], NAME(load16)(kr + 16 * c, D - 16 * c), a);
            }
            part[i] = a;
        }
        transpose16x16(part);               /* part[l]: lane l's partial sums of the 16 keys */
        for (long w = 8; w >= 1; w /= 2)
            for (long l = 0; l < w; l++) part[l] = _mm512_add_ps(part[l], part[l + w]);
        __m512 x = NAME(round16)(_mm512_mul_ps(NAME(round16)(part[0]), vscale));
        if (m) {
            x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(km, m + j0));
            if (round_mask) x = NAME(round16)(x);
        }
        _mm512_mask_storeu_ps(s + j0, km, x);
        vtop = _mm512_mask_max_ps(vtop, km, vtop, x);
    }
    float top = _mm512_reduce_max_ps(vtop);
    float inv = 1.f / exp_shifted(s, T, top);
    for (long c = 0; c < nc; c++) acc[c] = _mm512_setzero_ps();
    for (long j = 0; j < T; j++) {
        const __m512 p = _mm512_set1_ps(ROUND(s[j] * inv));
        const ELEM *vr = vb + j * sv_t;
        for (long c = 0; c < nc; c++) acc[c] = _mm512_fmadd_ps(p, NAME(load16)(vr + 16 * c, D - 16 * c), acc[c]);
    }
    for (long c = 0; c < nc; c++) NAME(store16)(o + 16 * c, acc[c], D - 16 * c);
}
#define DECODE_ROW NAME(decode_row16)
#else
#define DECODE_ROW NAME(decode_row)
#endif

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
            DECODE_ROW(qr, kb, vb, m, o, scratch, T, 32, sk_t, sv_t, scale, round_mask);
        else if (D == 64)
            DECODE_ROW(qr, kb, vb, m, o, scratch, T, 64, sk_t, sv_t, scale, round_mask);
        else if (D == 128)
            DECODE_ROW(qr, kb, vb, m, o, scratch, T, 128, sk_t, sv_t, scale, round_mask);
        else
            DECODE_ROW(qr, kb, vb, m, o, scratch, T, D, sk_t, sv_t, scale, round_mask);
    }
}
#undef DECODE_ROW


/* Rows x [S, D] (row stride sx) as float32 columns xt [D, Sp], zero beyond S (Sp a
 * multiple of 16; an AVX2 build fills the columns up to S rounded up to 8 only, all that
 * its dots_with_columns reads). */
static void NAME(load_columns)(const ELEM *x, long sx, long S, long D, long Sp, float *xt) {
#if HAVE_AVX512
    /* 16 x 16 blocks: 16 rows loaded, transposed in registers, stored as 16 columns */
    for (long j0 = 0; j0 < Sp; j0 += 16)
        for (long d0 = 0; d0 < D; d0 += 16) {
            __m512 r[16];
            for (long i = 0; i < 16; i++)
                r[i] = j0 + i < S ? NAME(load16)(x + (j0 + i) * sx + d0, D - d0) : _mm512_setzero_ps();
            transpose16x16(r);
            for (long i = 0; i < 16 && d0 + i < D; i++) _mm512_storeu_ps(xt + (d0 + i) * Sp + j0, r[i]);
        }
#elif HAVE_AVX2
    /* 8 x 8 blocks, the columns of the first S keys rounded up to 8 only: the AVX2
     * dots_with_columns reads no further */
    for (long j0 = 0; j0 < S; j0 += 8)
        for (long d0 = 0; d0 < D; d0 += 8) {
            __m256 r[8];
            for (long i = 0; i < 8; i++)
#if ELEM_IS_BF16
                r[i] = j0 + i < S ? load8_bf16(x + (j0 + i) * sx + d0, D - d0) : _mm256_setzero_ps();
#else
                r[i] = j0 + i < S ? load8_f32(x + (j0 + i) * sx + d0, D - d0) : _mm256_setzero_ps();
#endif
            transpose8x8(r);
            for (long i = 0; i < 8 && d0 + i < D; i++) _mm256_storeu_ps(xt + (d0 + i) * Sp + j0, r[i]);
        }
#else
    for (long d = 0; d < D; d++)
        for (long j = S; j < Sp; j++) xt[d * Sp + j] = 0.f;
    for (long j = 0; j < S; j++)
        for (long d = 0; d < D; d++) xt[d * Sp + j] = LOAD(x[j * sx + d]);
#endif
}

/* Attention over all T queries of the heads of one KV group (b, g), as eager attention
 * computes it (see decode_row for the roundings):
 *   s_tj = R(R(q_t . k_j) * scale) (+ m_tj),  p_tj = softmax_j(s_t)  (float32),
 *   out_t = R(sum_j R(p_tj) v_j)
 * Keys are read once into float32 columns kt [D, S] and values into rows vf [S, D], so
 * that the scores of a query are D vector updates over the S keys and its output S
 * vector updates over D. Positions a row masks to -inf or the dtype's minimum get p = 0
 * without a score (what the softmax gives them), unless the whole row is masked. */
static inline __attribute__((always_inline)) void NAME(attention_group)(
        const ELEM *q, const ELEM *kb, const ELEM *vb, const float *mask, ELEM *out, float *probs,
        float *scratch, long b, long g, long H, long rep, long T, long S, long D, long sq_b, long sq_h,
        long sq_t, long sk_t, long sv_t, long sm_b, float scale, int round_mask) {
    long Sp = (S + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;     /* key columns, zero padded */
    float *kt = scratch, *vf = kt + D * Sp, *qf = vf + S * D, *pr = qf + D;
    NAME(load_columns)(kb, sk_t, S, D, Sp, kt);
    for (long j = 0; j < S; j++)
#pragma omp simd
        for (long d = 0; d < D; d++) vf[j * D + d] = LOAD(vb[j * sv_t + d]);
    for (long h = g * rep; h < (g + 1) * rep; h++)
        for (long t = 0; t < T; t++) {
            const ELEM *qr = q + b * sq_b + h * sq_h + t * sq_t;
            const float *m = mask ? mask + b * sm_b + t * S : 0;
            float *p = probs + ((b * H + h) * T + t) * S;
#pragma omp simd
            for (long d = 0; d < D; d++) qf[d] = LOAD(qr[d]);
            /* keys [lo, hi) hold every position the row does not mask (all of them when
             * it masks them all): only their blocks get scores */
            long lo = 0, hi = S;
            int skip = 0;                           /* skip masked positions: some are not */
            if (m) {
                while (lo < S && m[lo] <= MASKED_BELOW) lo++;
                if (lo == S) lo = 0;
                else {
                    skip = 1;
                    while (m[hi - 1] <= MASKED_BELOW) hi--;
                }
            }
            long lo16, hi16;                        /* the per-key loops run over these only */
            whole_vectors(lo, hi, S, &lo16, &hi16);
#pragma omp simd
            for (long j = lo16; j < hi16; j++) p[j] = 0.f;
            dots_with_columns(qf, kt, D, lo, hi, Sp, p);
            float top = -INFINITY;
            if (m) {
#pragma omp simd reduction(max : top)
                for (long j = lo16; j < hi16; j++) {
                    float x = ROUND(ROUND(p[j]) * scale), xm = x + m[j];
                    x = round_mask ? ROUND(xm) : xm;
                    x = skip && m[j] <= MASKED_BELOW ? -INFINITY : x;
                    p[j] = x;
                    top = x > top ? x : top;
                }
            } else {
#pragma omp simd reduction(max : top)
                for (long j = 0; j < S; j++) {
                    float x = ROUND(ROUND(p[j]) * scale);
                    p[j] = x;
                    top = x > top ? x : top;
                }
            }
            float inv = 1.f / exp_shifted(p + lo16, hi16 - lo16, top), acc[MAX_HEAD_DIM];
#pragma omp simd
            for (long d = 0; d < D; d++) acc[d] = 0.f;
#pragma omp simd
            for (long j = 0; j < lo16; j++) p[j] = 0.f;
#pragma omp simd
            for (long j = hi16; j < S; j++) p[j] = 0.f;
#pragma omp simd
            for (long j = lo16; j < hi16; j++) {
                p[j] *= inv;
                pr[j] = ROUND(p[j]);
            }
            for (long j = lo; j < hi; j++) {
                if (p[j] == 0.f) continue;
                float pj = pr[j];
                const float *vr = vf + j * D;
#pragma omp simd
                for (long d = 0; d < D; d++) acc[d] += pj * vr[d];
            }
            ELEM *o = out + ((b * T + t) * H + h) * D;
#pragma omp simd
            for (long d = 0; d < D; d++) o[d] = STORE(acc[d]);
        }
}

/* attention_group for the KV groups [start, stop) of B x Hkv (head h reads kv head
 * h / (H / Hkv)): q [B, H, T, D] (strides sq_b, sq_h, sq_t), k and v [B, Hkv, S, D]
 * (strides sk_*, sv_*); mask [B or 1, T, S] float32 (batch stride sm_b, 0 when
 * broadcast) or NULL; out [B, T, H, D] contiguous (eager's layout after its transpose);
 * probs [B, H, T, S] float32 receives the softmax, which the backward needs. scratch
 * holds D (2 S + KEY_BLOCK) + D + S floats; D <= MAX_HEAD_DIM. */
void NAME(attention_forward)(const ELEM *q, const ELEM *k, const ELEM *v, const float *mask, ELEM *out,
                             float *probs, float *scratch, long start, long stop, long H, long Hkv, long T,
                             long S, long D, long sq_b, long sq_h, long sq_t, long sk_b, long sk_h, long sk_t,
                             long sv_b, long sv_h, long sv_t, long sm_b, float scale, int round_mask) {
    long rep = H / Hkv;
#if ELEM_IS_BF16 && defined(HAVE_AMX)
    if (attention_on_amx(T, S, D)) {
        configure_tiles(FULL_ROWS, FULL_COLSB);
        for (long grp = start; grp < stop; grp++) {
            long b = grp / Hkv, g = grp % Hkv;
            if (grp + 1 < stop)
                prefetch_group(grp + 1, H, Hkv, T, S, D, q, sq_b, sq_h, sq_t, k, sk_b, sk_h, sk_t, v, sv_b, sv_h, sv_t,
                               0, 0, 0, 0, 0);
            attention_group_amx(q, k + b * sk_b + g * sk_h, v + b * sv_b + g * sv_h, mask, out, probs, scratch, b, g, H,
                                rep, T, S, D, sq_b, sq_h, sq_t, sk_t, sv_t, sm_b, scale, round_mask);
        }
        _tile_release();
        return;
    }
#endif
    for (long grp = start; grp < stop; grp++) {
        long b = grp / Hkv, g = grp % Hkv;
        const ELEM *kb = k + b * sk_b + g * sk_h, *vb = v + b * sv_b + g * sv_h;
        if (D == 32)
            NAME(attention_group)(q, kb, vb, mask, out, probs, scratch, b, g, H, rep, T, S, 32, sq_b, sq_h, sq_t,
                                  sk_t, sv_t, sm_b, scale, round_mask);
        else if (D == 64)
            NAME(attention_group)(q, kb, vb, mask, out, probs, scratch, b, g, H, rep, T, S, 64, sq_b, sq_h, sq_t,
                                  sk_t, sv_t, sm_b, scale, round_mask);
        else if (D == 128)
            NAME(attention_group)(q, kb, vb, mask, out, probs, scratch, b, g, H, rep, T, S, 128, sq_b, sq_h, sq_t,
                                  sk_t, sv_t, sm_b, scale, round_mask);
        else
            NAME(attention_group)(q, kb, vb, mask, out, probs, scratch, b, g, H, rep, T, S, D, sq_b, sq_h, sq_t,
                                  sk_t, sv_t, sm_b, scale, round_mask);
    }
}

/* The backward of attention_group for one KV group, as autograd differentiates eager
 * attention:
 *   dP_tj = R(go_t . v_j),  ds_tj = R(p_tj (dP_tj - sum_i dP_ti p_ti)),  dz_tj = R(ds_tj * scale),
 *   dq_t = R(sum_j dz_tj k_j),  dk_j = R(sum_{h,t} dz_tj q_t),  dv_j = R(sum_{h,t} R(p_tj) go_t)
 * (summed over the group's heads in float32 before the one rounding). Positions with
 * p = 0 contribute nothing and are skipped. Values are read once into float32 columns
 * vt [D, S], keys into rows kf [S, D]. */
static inline __attribute__((always_inline)) void NAME(attention_group_backward)(
        const ELEM *q, const ELEM *kb, const ELEM *vb, const float *probs, const ELEM *go, ELEM *dq, ELEM *dk,
        ELEM *dv, float *scratch, long b, long g, long H, long Hkv, long rep, long T, long S, long D, long sq_b,
        long sq_h, long sq_t, long sk_t, long sv_t, long sg_b, long sg_t, long sg_h, float scale) {
    long Sp = (S + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;     /* value columns, zero padded */
    float *vt = scratch, *kf = vt + D * Sp, *dk_acc = kf + S * D, *dv_acc = dk_acc + S * D,
          *dp = dv_acc + S * D, *qf = dp + S, *gf = qf + D, *pr = gf + D;
    NAME(load_columns)(vb, sv_t, S, D, Sp, vt);
    for (long j = 0; j < S; j++)
#pragma omp simd
        for (long d = 0; d < D; d++) {
            kf[j * D + d] = LOAD(kb[j * sk_t + d]);
            dk_acc[j * D + d] = 0.f;
            dv_acc[j * D + d] = 0.f;
        }
    for (long h = g * rep; h < (g + 1) * rep; h++)
        for (long t = 0; t < T; t++) {
            const float *p = probs + ((b * H + h) * T + t) * S;
            const ELEM *gr = go + b * sg_b + t * sg_t + h * sg_h;
            const ELEM *qr = q + b * sq_b + h * sq_h + t * sq_t;
            float dq_acc[MAX_HEAD_DIM];
#pragma omp simd
            for (long d = 0; d < D; d++) {
                qf[d] = LOAD(qr[d]);
                gf[d] = LOAD(gr[d]);
                dq_acc[d] = 0.f;
            }
            long lo = 0, hi = S;                    /* the keys [lo, hi) hold every p != 0 */
            while (lo < S && p[lo] == 0.f) lo++;
            while (hi > lo && p[hi - 1] == 0.f) hi--;
            long lo16, hi16;                        /* the per-key loops run over these only */
            whole_vectors(lo, hi, S, &lo16, &hi16);
#pragma omp simd
            for (long j = lo16; j < hi16; j++) dp[j] = 0.f;
            dots_with_columns(gf, vt, D, lo, hi, Sp, dp);
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (long j = lo16; j < hi16; j++) {
                dp[j] = ROUND(dp[j]);
                dot += p[j] == 0.f ? 0.f : dp[j] * p[j];
            }
            /* the per-key factors, vectorized over the keys: dz (in dp) and R(p) */
#pragma omp simd
            for (long j = lo; j < hi; j++) {
                dp[j] = ROUND(ROUND(p[j] * (dp[j] - dot)) * scale);
                pr[j] = ROUND(p[j]);
            }
            for (long j = lo; j < hi; j++) {
                if (p[j] == 0.f) continue;
                float z = dp[j], pj = pr[j];
                const float *kr = kf + j * D;
                float *dkr = dk_acc + j * D, *dvr = dv_acc + j * D;
#pragma omp simd
                for (long d = 0; d < D; d++) {
                    dq_acc[d] += z * kr[d];
                    dkr[d] += z * qf[d];
                    dvr[d] += pj * gf[d];
                }
            }
            ELEM *dqr = dq + ((b * H + h) * T + t) * D;
#pragma omp simd
            for (long d = 0; d < D; d++) dqr[d] = STORE(dq_acc[d]);
        }
    ELEM *dkb = dk + (b * Hkv + g) * S * D;
    for (long j = 0; j < S; j++) {
        ELEM *dkr = dkb + j * D, *dvr = dv + ((b * S + j) * Hkv + g) * D;
#pragma omp simd
        for (long d = 0; d < D; d++) {
            dkr[d] = STORE(dk_acc[j * D + d]);
            dvr[d] = STORE(dv_acc[j * D + d]);
        }
    }
}

/* attention_group_backward for the KV groups [start, stop) of B x Hkv: go (the output's
 * gradient) [B, T, H, D] (strides sg_b, sg_t, sg_h); probs as the forward saved them; dq
 * [B, H, T, D] and dk [B, Hkv, S, D] contiguous; dv [B, S, Hkv, D] contiguous (the value
 * projection's layout); scratch holds D (4 S + KEY_BLOCK) + 2 S + 2 D floats; D <= MAX_HEAD_DIM. */
void NAME(attention_backward)(const ELEM *q, const ELEM *k, const ELEM *v, const float *probs, const ELEM *go,
                              ELEM *dq, ELEM *dk, ELEM *dv, float *scratch, long start, long stop, long H,
                              long Hkv, long T, long S, long D, long sq_b, long sq_h, long sq_t, long sk_b,
                              long sk_h, long sk_t, long sv_b, long sv_h, long sv_t, long sg_b, long sg_t,
                              long sg_h, float scale) {
    long rep = H / Hkv;
#if ELEM_IS_BF16 && defined(HAVE_AMX)
    if (attention_on_amx(T, S, D)) {
        configure_tiles(FULL_ROWS, FULL_COLSB);
        for (long grp = start; grp < stop; grp++) {
            long b = grp / Hkv, g = grp % Hkv;
            if (grp + 1 < stop)
                prefetch_group(grp + 1, H, Hkv, T, S, D, q, sq_b, sq_h, sq_t, k, sk_b, sk_h, sk_t, v, sv_b, sv_h, sv_t,
                               go, sg_b, sg_h, sg_t, probs);
            attention_group_backward_amx(q, k + b * sk_b + g * sk_h, v + b * sv_b + g * sv_h, probs, go, dq, dk, dv,
                                         scratch, b, g, H, Hkv, rep, T, S, D, sq_b, sq_h, sq_t, sk_t, sv_t, sg_b,
                                         sg_t, sg_h, scale);
        }
        _tile_release();
        return;
    }
#endif
    for (long grp = start; grp < stop; grp++) {
        long b = grp / Hkv, g = grp % Hkv;
        const ELEM *kb = k + b * sk_b + g * sk_h, *vb = v + b * sv_b + g * sv_h;
        if (D == 32)
            NAME(attention_group_backward)(q, kb, vb, probs, go, dq, dk, dv, scratch, b, g, H, Hkv, rep, T, S, 32,
                                           sq_b, sq_h, sq_t, sk_t, sv_t, sg_b, sg_t, sg_h, scale);
        else if (D == 64)
            NAME(attention_group_backward)(q, kb, vb, probs, go, dq, dk, dv, scratch, b, g, H, Hkv, rep, T, S, 64,
                                           sq_b, sq_h, sq_t, sk_t, sv_t, sg_b, sg_t, sg_h, scale);
        else if (D == 128)
            NAME(attention_group_backward)(q, kb, vb, probs, go, dq, dk, dv, scratch, b, g, H, Hkv, rep, T, S, 128,
                                           sq_b, sq_h, sq_t, sk_t, sv_t, sg_b, sg_t, sg_h, scale);
        else
            NAME(attention_group_backward)(q, kb, vb, probs, go, dq, dk, dv, scratch, b, g, H, Hkv, rep, T, S, D,
                                           sq_b, sq_h, sq_t, sk_t, sv_t, sg_b, sg_t, sg_h, scale);
    }
}

#endif /* KERNEL_BODY */
