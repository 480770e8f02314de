/* Decode-sized products of quantized weights on the CPU: y (M, N) = x (M, K) @ W^T for a few rows
 * of x (a decode step's tokens), W stored quantized. Each output row of W is read from memory once
 * for all M rows of x, converted in registers and never written back as floats: the step reads
 * 1 byte a weight (int8) or 4.75 bits (int4 in groups of 32, an fp16 scale and a uint8 zero
 * point each) instead of 4 bytes, and on a CPU whose decode step is limited by memory that is
 * what it costs.
 *
 * Three products, each with an AVX-512 path, an AVX2 path and a portable one (any compiler, any CPU):
 *   q8_f32  int8 weights, per-row scale; fp32 activations (weight-only int8).
 *   q8_i8   W8A8: activations rounded to int8 per token here, integer dot products summed exactly
 *           in int32 (AVX-512 VNNI vpdpbusd, else AVX2 vpmaddubsw/vpmaddwd), then one float
 *           multiply by both scales.
 *   q4_f32  int4 codes two per byte (even column in the low nibble), zero point and scale per group
 *           of g columns; fp32 activations (weight-only int4), with AVX-512 VNNI rounded to 24
 *           bits per block of 32 and multiplied by the codes in integers.
 * Rows of W are shared out over `nt` OpenMP threads. Built by minillm/kernels/native.py.
 *
 * PREFETCH: the AVX-512 loops ask for the weights 2 or 4 KB ahead of where they read (rows lie
 * one after another, so that is the next rows): one core's demand misses alone kept its stream
 * to 7.3 GB/s of int4 on a 2-core Xeon (Sapphire Rapids class), 11-12 GB/s with them. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define MINILLM_AVX512 1
#endif
#if defined(MINILLM_AVX512) && defined(__AVX512VNNI__)
#define MINILLM_VNNI 1
#endif
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#ifdef __AVX2__

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline int32_t sum8_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

/* 8 int8 -> 8 fp32 */
static inline __m256 widen8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
/* 8 uint8 -> 8 fp32 */
static inline __m256 widen8u(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
#endif
#ifdef MINILLM_AVX512
/* 16 int8 -> 16 fp32, 16 uint8 -> 16 fp32 */
static inline __m512 widen16(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
static inline __m512 widen16u(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
#endif

/* an IEEE half (the int4 scales' storage) -> float, exactly: F16C's instruction, else by hand */
static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, bits;
    if (exp == 0) {
        float f = ldexpf((float)mant, -24); /* zero or subnormal */
        return sign ? -f : f;
    }
    bits = exp == 31 ? sign | 0x7f800000u | (mant << 13) : sign | ((exp + 112) << 23) | (mant << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* the widest path this build takes: 0 portable C, 1 AVX2, 2 AVX-512, 3 AVX-512 with VNNI */
int minillm_isa(void) {
#if defined(MINILLM_VNNI)
    return 3;
#elif defined(MINILLM_AVX512)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

/* ---- int8 weights, fp32 activations: y[m, n] = s[n] * sum_k x[m, k] * w[n, k] ---------------- */
static float dot_q8_f32(const float *x, const int8_t *w, int64_t K) {
    int64_t k = 0;
    float acc = 0;
#if defined(MINILLM_AVX512)
    /* 16 weights a vector; four chains hide the FMA's latency; the tail is a masked load */
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; k + 64 <= K; k += 64) {
        _mm_prefetch((const char *)((uintptr_t)(w + k) + 2048), _MM_HINT_T0); /* see PREFETCH */
        a0 = _mm512_fmadd_ps(widen16(_mm_loadu_si128((const __m128i *)(w + k))), _mm512_loadu_ps(x + k), a0);
        a1 = _mm512_fmadd_ps(widen16(_mm_loadu_si128((const __m128i *)(w + k + 16))), _mm512_loadu_ps(x + k + 16), a1);
        a2 = _mm512_fmadd_ps(widen16(_mm_loadu_si128((const __m128i *)(w + k + 32))), _mm512_loadu_ps(x + k + 32), a2);
        a3 = _mm512_fmadd_ps(widen16(_mm_loadu_si128((const __m128i *)(w + k + 48))), _mm512_loadu_ps(x + k + 48), a3);
    }
    for (; k < K; k += 16) {
        __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
        a0 = _mm512_fmadd_ps(widen16(_mm_maskz_loadu_epi8(m, w + k)), _mm512_maskz_loadu_ps(m, x + k), a0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(__AVX2__)
    /* four chains hide the FMA's latency; each load widens 8 bytes straight from memory */
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; k + 32 <= K; k += 32) {
        a0 = _mm256_fmadd_ps(widen8(_mm_loadl_epi64((const __m128i *)(w + k))), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(widen8(_mm_loadl_epi64((const __m128i *)(w + k + 8))), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(widen8(_mm_loadl_epi64((const __m128i *)(w + k + 16))), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(widen8(_mm_loadl_epi64((const __m128i *)(w + k + 24))), _mm256_loadu_ps(x + k + 24), a3);
    }
    acc = sum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
    for (; k < K; k++) acc += x[k] * (float)w[k];
    return acc;
}

void q8_f32(const float *x, int64_t M, int64_t K, const int8_t *w, const float *s, int64_t N,
            float *y, int nt) {
#pragma omp parallel for if (nt > 1) num_threads(nt) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++) y[m * N + n] = s[n] * dot_q8_f32(x + m * K, w + n * K, K);
}

/* ---- W8A8: int8 x int8 summed in int32 ------------------------------------------------------ */
/* a row of x -> int8 codes and one scale t, as minillm.compression.fastpath.quantize_tokens:
 * t = max|x| / 127 (at least 1e-12 / 127), a = round-half-even(x / t) clamped to +-127. */
static float quantize_row(const float *x, int64_t K, int8_t *a) {
    float peak = 0;
    int nan = 0;
    for (int64_t k = 0; k < K; k++) {
        peak = fmaxf(peak, fabsf(x[k])); /* fmaxf passes a NaN over: counted apart */
        nan |= x[k] != x[k];
    }
    if (nan || !(peak <= FLT_MAX)) { /* a NaN or an infinity: the row's outputs are NaN, as the reference's */
        memset(a, 0, (size_t)K);
        return NAN;
    }
    float t = fmaxf(peak, 1e-12f) / 127.0f;
    for (int64_t k = 0; k < K; k++) {
        float r = nearbyintf(x[k] / t);
        a[k] = (int8_t)fminf(fmaxf(r, -127.0f), 127.0f);
    }
    return t;
}

static int32_t dot_i8(const int8_t *a, const int8_t *w, int64_t K) {
    int64_t k = 0;
    int32_t acc = 0;
#if defined(MINILLM_VNNI)
    /* vpdpbusd adds four u8 x s8 products into each 32-bit lane, exactly. It wants one
     * side unsigned: a + 128 (a XOR 0x80, read as u8) is, and sum (a + 128) w equals
     * sum a w + 128 sum w, the last sum one more vpdpbusd (ones by w). 64 bytes a step;
     * the tail is a masked load, whose zeros add nothing. */
    const __m512i flip = _mm512_set1_epi8((char)0x80), ones = _mm512_set1_epi8(1);
    __m512i c0 = _mm512_setzero_si512(), c1 = c0, s0 = c0, s1 = c0;
    for (; k + 128 <= K; k += 128) {
        /* the weights 2 KB ahead: see PREFETCH at the top */
        _mm_prefetch((const char *)((uintptr_t)(w + k) + 2048), _MM_HINT_T0);
        _mm_prefetch((const char *)((uintptr_t)(w + k) + 2048 + 64), _MM_HINT_T0);
        __m512i w0 = _mm512_loadu_si512(w + k), w1 = _mm512_loadu_si512(w + k + 64);
        __m512i a0 = _mm512_xor_si512(_mm512_loadu_si512(a + k), flip);
        __m512i a1 = _mm512_xor_si512(_mm512_loadu_si512(a + k + 64), flip);
        c0 = _mm512_dpbusd_epi32(c0, a0, w0);
        c1 = _mm512_dpbusd_epi32(c1, a1, w1);
        s0 = _mm512_dpbusd_epi32(s0, ones, w0);
        s1 = _mm512_dpbusd_epi32(s1, ones, w1);
    }
    for (; k < K; k += 64) {
        __mmask64 m = K - k >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (K - k)) - 1);
        __m512i w0 = _mm512_maskz_loadu_epi8(m, w + k);
        __m512i a0 = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, a + k), flip);
        c0 = _mm512_dpbusd_epi32(c0, a0, w0);
        s0 = _mm512_dpbusd_epi32(s0, ones, w0);
    }
    int64_t dot = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
    int64_t sum_w = _mm512_reduce_add_epi32(_mm512_add_epi32(s0, s1));
    return (int32_t)(dot - 128 * sum_w);
#elif defined(__AVX2__)
    /* vpmaddubsw multiplies unsigned by signed bytes: |a| times w with a's sign moved onto w. Each
     * pair sums to at most 2 * 127 * 127 < 2^15, so the 16-bit sums never saturate. */
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i c0 = _mm256_setzero_si256(), c1 = c0;
    for (; k + 64 <= K; k += 64) {
        __m256i va = _mm256_loadu_si256((const __m256i *)(a + k));
        __m256i vw = _mm256_loadu_si256((const __m256i *)(w + k));
        __m256i vb = _mm256_loadu_si256((const __m256i *)(a + k + 32));
        __m256i vv = _mm256_loadu_si256((const __m256i *)(w + k + 32));
        __m256i p0 = _mm256_maddubs_epi16(_mm256_sign_epi8(va, va), _mm256_sign_epi8(vw, va));
        __m256i p1 = _mm256_maddubs_epi16(_mm256_sign_epi8(vb, vb), _mm256_sign_epi8(vv, vb));
        c0 = _mm256_add_epi32(c0, _mm256_madd_epi16(p0, ones));
        c1 = _mm256_add_epi32(c1, _mm256_madd_epi16(p1, ones));
    }
    for (; k + 32 <= K; k += 32) {
        __m256i va = _mm256_loadu_si256((const __m256i *)(a + k));
        __m256i vw = _mm256_loadu_si256((const __m256i *)(w + k));
        __m256i p0 = _mm256_maddubs_epi16(_mm256_sign_epi8(va, va), _mm256_sign_epi8(vw, va));
        c0 = _mm256_add_epi32(c0, _mm256_madd_epi16(p0, ones));
    }
    acc = sum8_i32(_mm256_add_epi32(c0, c1));
#endif
    for (; k < K; k++) acc += (int32_t)a[k] * (int32_t)w[k];
    return acc;
}

int q8_i8(const float *x, int64_t M, int64_t K, const int8_t *w, const float *s, int64_t N, float *y,
          int nt) {
    int8_t *a = malloc((size_t)(M * K));
    float *t = malloc((size_t)M * sizeof(float));
    if (!a || !t) {
        free(a);
        free(t);
        return 1;
    }
    for (int64_t m = 0; m < M; m++) t[m] = quantize_row(x + m * K, K, a + m * K);
#pragma omp parallel for if (nt > 1) num_threads(nt) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++)
            y[m * N + n] = (float)dot_i8(a + m * K, w + n * K, K) * t[m] * s[n];
    free(a);
    free(t);
    return 0;
}

#ifndef MINILLM_VNNI
/* ---- int4 weights in groups, fp32 activations ------------------------------------------------
 * w[n, k] = (code - z) * s for k in group j = k / g, so
 *   y[m, n] = sum_j s[n, j] * (sum_{k in j} x[m, k] * code[n, k]) - sum_j s[n, j] z[n, j] X[m, j]
 * with X[m, j] the sum of x over group j: codes enter the inner loop as they are, the zero point
 * once per group. The 16 bytes of 32 columns hold the even columns' codes in their low nibbles
 * and the odd columns' in the high: x is reordered the same way (16 even, then 16 odd) once per
 * call, so that both nibbles meet their activations with plain vector loads. */
static void reorder_row(const float *x, int64_t K, int64_t Kp, int64_t g, float *xp, float *X) {
    for (int64_t c = 0; c < Kp; c += 32)
        for (int j = 0; j < 16; j++) {
            int64_t e = c + 2 * j, o = e + 1;
            xp[c + j] = e < K ? x[e] : 0.0f;
            xp[c + 16 + j] = o < K ? x[o] : 0.0f;
        }
    for (int64_t j = 0; j < Kp / g; j++) {
        float acc = 0;
        for (int64_t k = j * g; k < (j + 1) * g && k < K; k++) acc += x[k];
        X[j] = acc;
    }
}

static float dot_q4_f32(const float *xp, const float *X, const uint8_t *w, const float *s,
                        const float *sz, int64_t G, int64_t g) {
    float acc = 0;
    int64_t j = 0;
#if defined(MINILLM_AVX512)
    /* as the AVX2 path below, 16 columns a vector: the low nibbles of 16 bytes are 16 even
     * columns, the high nibbles the 16 odd ones */
    const __m128i low = _mm_set1_epi8(0x0f);
    __m512 v0 = _mm512_setzero_ps(), v1 = v0;
    for (; j < G; j++) {
        __m512 d0 = _mm512_setzero_ps(), d1 = d0;
        for (int64_t c = j * g; c < (j + 1) * g; c += 32) {
            _mm_prefetch((const char *)((uintptr_t)(w + c / 2) + 4096), _MM_HINT_T0);
            __m128i b = _mm_loadu_si128((const __m128i *)(w + c / 2));
            d0 = _mm512_fmadd_ps(widen16u(_mm_and_si128(b, low)), _mm512_loadu_ps(xp + c), d0);
            d1 = _mm512_fmadd_ps(widen16u(_mm_and_si128(_mm_srli_epi16(b, 4), low)), _mm512_loadu_ps(xp + c + 16), d1);
        }
        if (j & 1)
            v1 = _mm512_fmadd_ps(_mm512_set1_ps(s[j]), _mm512_add_ps(d0, d1), v1);
        else
            v0 = _mm512_fmadd_ps(_mm512_set1_ps(s[j]), _mm512_add_ps(d0, d1), v0);
    }
    __m512 z = _mm512_setzero_ps();
    for (j = 0; j < G; j += 16) {
        __mmask16 m = G - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (G - j)) - 1);
        z = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, sz + j), _mm512_maskz_loadu_ps(m, X + j), z);
    }
    acc = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1)) - _mm512_reduce_add_ps(z);
#elif defined(__AVX2__)
    /* two groups in flight (their scale multiplies chain into two accumulators), and the zero
     * points' term a vector dot product of its own after the loop */
    const __m128i low = _mm_set1_epi8(0x0f);
    __m256 v0 = _mm256_setzero_ps(), v1 = v0;
    for (; j < G; j++) {
        __m256 d0 = _mm256_setzero_ps(), d1 = d0;
        for (int64_t c = j * g; c < (j + 1) * g; c += 32) {
            __m128i b = _mm_loadu_si128((const __m128i *)(w + c / 2));
            __m128i even = _mm_and_si128(b, low), odd = _mm_and_si128(_mm_srli_epi16(b, 4), low);
            d0 = _mm256_fmadd_ps(widen8u(even), _mm256_loadu_ps(xp + c), d0);
            d1 = _mm256_fmadd_ps(widen8u(_mm_srli_si128(even, 8)), _mm256_loadu_ps(xp + c + 8), d1);
            d0 = _mm256_fmadd_ps(widen8u(odd), _mm256_loadu_ps(xp + c + 16), d0);
            d1 = _mm256_fmadd_ps(widen8u(_mm_srli_si128(odd, 8)), _mm256_loadu_ps(xp + c + 24), d1);
        }
        if (j & 1)
            v1 = _mm256_fmadd_ps(_mm256_set1_ps(s[j]), _mm256_add_ps(d0, d1), v1);
        else
            v0 = _mm256_fmadd_ps(_mm256_set1_ps(s[j]), _mm256_add_ps(d0, d1), v0);
    }
    __m256 z = _mm256_setzero_ps();
    for (j = 0; j + 8 <= G; j += 8) z = _mm256_fmadd_ps(_mm256_loadu_ps(sz + j), _mm256_loadu_ps(X + j), z);
    acc = sum8(_mm256_add_ps(v0, v1)) - sum8(z);
    for (; j < G; j++) acc -= sz[j] * X[j];
#else
    float zacc = 0;
    for (; j < G; j++) {
        float d = 0;
        for (int64_t c = j * g; c < (j + 1) * g; c += 32)
            for (int i = 0; i < 16; i++) {
                uint8_t b = w[c / 2 + i];
                d += xp[c + i] * (float)(b & 15) + xp[c + 16 + i] * (float)(b >> 4);
            }
        acc += s[j] * d;
        zacc += sz[j] * X[j];
    }
    acc -= zacc;
#endif
    return acc;
}

#endif

#ifdef MINILLM_VNNI
/* ---- int4 with VNNI: the codes multiplied by integers ------------------------------------------
 * Converting each 4-bit code to a float costs more than reading it. With VNNI the codes stay
 * integers: each block of 32 activations is rounded to 24 bits with a step of its own
 * (t = max|x| / (2^23 - 1): within 2^-24 of the block's largest value, as fine as fp32 is for it),
 * each a written as three bytes a = 65536 h + 256 m + l (h signed, m and l unsigned), and
 * vpdpbusd sums code x h, m x code and l x code exactly in 32-bit lanes (codes are 0..15: a u8
 * and an s8 alike). Per 128 columns (4 blocks, 64 bytes of codes) the row holds h of the even
 * columns, h of the odd ones, then m and l the same way (64 bytes each, block by block, 16
 * columns a block), and 16 floats: each block's t for the 4 lanes that sum its products. */
#define Q4_DIGITS (6 * 64)
#define Q4_LEVELS 8388607.0f /* 2^23 - 1 */

static void digits_row(const float *x, int64_t K, int64_t Kp, int64_t g, uint8_t *d, float *t, float *X) {
    int64_t nb = Kp / 32, nq = (nb + 3) / 4;
    const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1)), bytes = _mm512_set1_epi32(255);
    memset(d, 0, (size_t)(nq * Q4_DIGITS));
    memset(t, 0, (size_t)(nq * 16) * sizeof(float));
    memset(X, 0, (size_t)(Kp / g) * sizeof(float));
    for (int64_t b = 0; b < nb; b++) {
        int64_t left = K - b * 32; /* the columns of x in this block: none past K */
        __mmask16 m0 = left >= 16 ? 0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        __mmask16 m1 = left >= 32 ? 0xffff : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
        __m512 v0 = _mm512_maskz_loadu_ps(m0, x + b * 32), v1 = _mm512_maskz_loadu_ps(m1, x + b * 32 + 16);
        int nan = _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
        float peak = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        int finite = !nan && peak <= FLT_MAX; /* else the outputs are NaN, through t and X */
        float step = finite ? peak / Q4_LEVELS : NAN;
        __m512i a[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        if (finite && step > 0) /* the nearest of the 2^24 - 1 steps, as nearbyintf(v / step) */
            for (int h = 0; h < 2; h++) {
                __m512 r = _mm512_roundscale_ps(_mm512_div_ps(h ? v1 : v0, _mm512_set1_ps(step)),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                r = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-Q4_LEVELS)), _mm512_set1_ps(Q4_LEVELS));
                a[h] = _mm512_cvtps_epi32(r);
            }
        uint8_t *q = d + (b / 4) * Q4_DIGITS + (b % 4) * 16;
        for (int odd = 0; odd < 2; odd++) { /* h signed, then m and l: the bytes of a */
            __m512i v = _mm512_permutex2var_epi32(a[0], odd ? odds : evens, a[1]);
            _mm_storeu_si128((__m128i *)(q + odd * 64), _mm512_cvtepi32_epi8(_mm512_srai_epi32(v, 16)));
            __m512i mid = _mm512_and_si512(_mm512_srli_epi32(v, 8), bytes);
            _mm_storeu_si128((__m128i *)(q + 128 + odd * 64), _mm512_cvtepi32_epi8(mid));
            _mm_storeu_si128((__m128i *)(q + 256 + odd * 64), _mm512_cvtepi32_epi8(_mm512_and_si512(v, bytes)));
        }
        __m512 steps = _mm512_set1_ps(step);
        __m512 rounded = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a[0]), steps),
                                       _mm512_mul_ps(_mm512_cvtepi32_ps(a[1]), steps));
        for (int i = 0; i < 4; i++) t[(b / 4) * 16 + (b % 4) * 4 + i] = step;
        /* the zero points multiply the same rounded activations as the codes: the error is then
         * sum (code - zero) scale e = sum w e, bounded by the weights, not by the codes */
        X[b * 32 / g] += finite ? _mm512_reduce_add_ps(rounded) : NAN;
    }
}

static float dot_q4_vnni(const uint8_t *d, const float *t, const float *X, const uint8_t *w, const uint16_t *s,
                         const uint8_t *z, int64_t G, int64_t g, int64_t Kp) {
    const __m512i low = _mm512_set1_epi8(0x0f), zero = _mm512_setzero_si512();
    const __m512i lane_block = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    int64_t nb = Kp / 32, r = g / 32;
    __m512 v0 = _mm512_setzero_ps(), v1 = v0;
    for (int64_t b = 0; b < nb; b += 4) {
        int64_t left = nb - b;
        __mmask64 m = left >= 4 ? ~(__mmask64)0 : (((__mmask64)1 << (16 * left)) - 1);
        _mm_prefetch((const char *)((uintptr_t)(w + b * 16) + 4096), _MM_HINT_T0); /* see PREFETCH */
        __m512i codes = _mm512_maskz_loadu_epi8(m, w + b * 16);
        __m512i even = _mm512_and_si512(codes, low), odd = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low);
        const uint8_t *q = d + (b / 4) * Q4_DIGITS;
        __m512i h = _mm512_dpbusd_epi32(zero, even, _mm512_loadu_si512((const void *)q));
        h = _mm512_dpbusd_epi32(h, odd, _mm512_loadu_si512((const void *)(q + 64)));
        __m512i mid = _mm512_dpbusd_epi32(zero, _mm512_loadu_si512((const void *)(q + 128)), even);
        mid = _mm512_dpbusd_epi32(mid, _mm512_loadu_si512((const void *)(q + 192)), odd);
        __m512i l = _mm512_dpbusd_epi32(zero, _mm512_loadu_si512((const void *)(q + 256)), even);
        l = _mm512_dpbusd_epi32(l, _mm512_loadu_si512((const void *)(q + 320)), odd);
        /* 8 products a lane: |h| sums below 2^14, m and l sums below 2^15; the total below 2^31 */
        __m512i whole = _mm512_add_epi32(_mm512_slli_epi32(h, 16), _mm512_slli_epi32(mid, 8));
        __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(whole, l));
        __m128 blocks;
        if (r == 1) /* a scale a block */
            blocks = _mm_cvtph_ps(_mm_maskz_loadu_epi16((__mmask8)(left >= 4 ? 15 : (1 << left) - 1), s + b));
        else if (r % 4 == 0) /* the four blocks in one group (b is a multiple of 4) */
            blocks = _mm_set1_ps(half_to_float(s[b / r]));
        else
            blocks = _mm_set_ps(left > 3 ? half_to_float(s[(b + 3) / r]) : 0, left > 2 ? half_to_float(s[(b + 2) / r]) : 0,
                                left > 1 ? half_to_float(s[(b + 1) / r]) : 0, half_to_float(s[b / r]));
        __m512 scale = _mm512_mul_ps(_mm512_permutexvar_ps(lane_block, _mm512_castps128_ps512(blocks)),
                                     _mm512_loadu_ps(t + (b / 4) * 16));
        if ((b / 4) & 1)
            v1 = _mm512_fmadd_ps(sum, scale, v1);
        else
            v0 = _mm512_fmadd_ps(sum, scale, v0);
    }
    __m512 zs = _mm512_setzero_ps(); /* the zero points' term: sum_j s_j z_j X_j */
    for (int64_t j = 0; j < G; j += 16) {
        __mmask16 mz = G - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (G - j)) - 1);
        __m512 sj = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mz, s + j));
        __m512 zj = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mz, z + j)));
        zs = _mm512_fmadd_ps(_mm512_mul_ps(sj, zj), _mm512_maskz_loadu_ps(mz, X + j), zs);
    }
    return _mm512_reduce_add_ps(_mm512_sub_ps(_mm512_add_ps(v0, v1), zs)); /* one sum across lanes */
}
#endif

/* w (N, Kp / 2) packed codes, s fp16 and z (zero points) uint8 (N, G), Kp = G * g, g % 32 == 0:
 * 4 bits a weight and 3 bytes a group, as stored. */
int q4_f32(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *s, const uint8_t *z,
           int64_t N, int64_t Kp, int64_t g, float *y, int nt) {
    int64_t G = Kp / g;
#ifdef MINILLM_VNNI
    int64_t nq = (Kp / 32 + 3) / 4;
    uint8_t *d = malloc((size_t)(M * nq * Q4_DIGITS));
    float *t = malloc((size_t)(M * nq * 16) * sizeof(float)), *X = malloc((size_t)(M * G) * sizeof(float));
    if (!d || !t || !X) {
        free(d);
        free(t);
        free(X);
        return 1;
    }
    for (int64_t m = 0; m < M; m++) digits_row(x + m * K, K, Kp, g, d + m * nq * Q4_DIGITS, t + m * nq * 16, X + m * G);
#pragma omp parallel for if (nt > 1) num_threads(nt) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++)
            y[m * N + n] = dot_q4_vnni(d + m * nq * Q4_DIGITS, t + m * nq * 16, X + m * G, w + n * (Kp / 2),
                                       s + n * G, z + n * G, G, g, Kp);
    free(d);
    free(t);
    free(X);
#else
    float *xp = malloc((size_t)(M * Kp) * sizeof(float)), *X = malloc((size_t)(M * G) * sizeof(float));
    if (!xp || !X) {
        free(xp);
        free(X);
        return 1;
    }
    for (int64_t m = 0; m < M; m++) reorder_row(x + m * K, K, Kp, g, xp + m * Kp, X + m * G);
#pragma omp parallel for if (nt > 1) num_threads(nt) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float sn[G], szn[G]; /* this row's scales, and scales times zero points, as floats */
        for (int64_t j = 0; j < G; j++) {
            sn[j] = half_to_float(s[n * G + j]);
            szn[j] = sn[j] * (float)z[n * G + j];
        }
        for (int64_t m = 0; m < M; m++)
            y[m * N + n] = dot_q4_f32(xp + m * Kp, X + m * G, w + n * (Kp / 2), sn, szn, G, g);
    }
    free(xp);
    free(X);
#endif
    return 0;
}
