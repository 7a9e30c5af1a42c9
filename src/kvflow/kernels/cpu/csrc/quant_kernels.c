/* kvflow's linear layers on quantized weights, read as they are stored:
 *
 *   kvflow_q_linear      y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), bf16 x and y, w quantized
 *                        (kvflow_q_linear_f32: float32 x and y); codes widened in registers
 *   kvflow_q_linear_amx  the same on AMX-INT8 tiles, activations quantized to int8 per 32
 *                        columns (below; returns 0 where the CPU or OS has no AMX)
 *   kvflow_q_linear_vnni the same quantization on int8 dot products, AVX512-VNNI's or (no
 *                        AVX-512) AVX2's: a few rows (kvflow_q_vnni_built says whether it
 *                        was built; kvflow_q_linear_vnni_f32: float32 y, the logits head's)
 *   kvflow_q_gemm_amx    the same on AMX-BF16 tiles, the weight dequantized to bf16 32 rows at
 *                        a time inside the kernel (batches); optionally silu(gate) * up
 *   kvflow_q_dequant     w[N, K] -> bf16 (long prompts: the bf16 matmul runs on it)
 *
 * The weight layout (made once by kvflow/model/quant_format.py from GGUF blocks or a float
 * checkpoint): K is cut in groups of `group` columns (a multiple of 16; K a multiple of 32);
 * w[n, k] = scales[n, k / group] * code[n, k] + mins[n, k / group], scales and mins float32,
 * or both float16 (`half` 1) where every one of them is exact in float16.
 *   bits 8: int8 codes [N, K], column k at byte k.
 *   bits 4: unsigned 4-bit codes [N, K / 2]; each 32 columns c .. c + 31 take 16 bytes at
 *           c / 2: byte i holds column c + i in its low nibble and c + 16 + i in its high one.
 * GGUF's Q4_0, Q4_1, Q4_K map to bits 4 (group 32), Q5_K and Q8_0 to bits 8 (group 32), Q6_K
 * to bits 8 (group 16): every scale and min is the product of at most a float16 and a 6- or
 * 8-bit integer, exact in float32, so the weights are the values the file holds; Q8_0, Q4_0 and
 * Q4_1 store theirs as float16 already, and keep them so (fewer bytes a step reads).
 *
 * A row's codes widen to float32 in registers (one fused multiply-add makes the weight) and
 * multiply float32 activations: at a few rows the step reads each weight byte once, which is
 * what bounds it. Rows of w are split among OpenMP threads (torch's runtime, shared).
 * Built by kvflow/model/quant_kernels.py like cpu_kernels.c (-march=native, GCC vectors: AVX-512
 * where the CPU has it; AVX2 intrinsics for the tiles where it has AVX2 alone).
 */
#include <omp.h>
#ifdef __x86_64__
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef int8_t v16c __attribute__((vector_size(16)));

#define MAX_ROWS 8 /* activation rows per pass over a weight row: one accumulator register each */

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Element i of a weight's scales or mins: float16 (`half`) or float32. F16C's conversion, not
 * AVX512-FP16's scalar one (vcvtsh2ss merges into its destination: a dependency through every
 * conversion of a loop; the AMX kernel ran at a third of its speed converting so per row, and
 * now widens a tile's scales once, `as_float`). */
static inline float scale_at(const void *p, long i, int half) {
    if (!half) return ((const float *)p)[i];
    uint16_t h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    _Float16 f;
    memcpy(&f, &h, sizeof f);
    return (float)f;
#endif
}

/* The scales or mins from element i on. */
static inline const void *scales_from(const void *p, long i, int half) {
    return (const char *)p + (i << (half ? 1 : 2));
}

/* `count` scales or mins from element i of `p` as float32: in place when they are float32, else
 * widened into `buf` (a tile's worth at a time, so that the loops over codes read float32). */
static inline const float *as_float(const void *p, long i, long count, int half, float *buf) {
    if (!half) return (const float *)p + i;
    const uint16_t *h = (const uint16_t *)p + i;
    long j = 0;
#ifdef __F16C__
    for (; j + 8 <= count; j += 8)
        _mm256_storeu_ps(buf + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j))));
#endif
    for (; j < count; j++) buf[j] = scale_at(h, j, 1);
    return buf;
}

static inline v16f vload(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum(v16f v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* The float codes of columns c .. c + 15 (lo) and c + 16 .. c + 31 (hi) of one weight row. GCC
 * turns a generic byte -> float vector conversion into one scalar conversion per lane. */
static inline __attribute__((always_inline)) void codes32(const uint8_t *row, int bits, int c,
                                                          v16f *lo, v16f *hi) {
#ifdef __AVX512F__
    if (bits == 4) {
        __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + c / 2)));
        *lo = (v16f)_mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(15)));
        *hi = (v16f)_mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
    } else {
        *lo = (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + c))));
        *hi = (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + c + 16))));
    }
#else
    float a[16], b[16];
    if (bits == 4) {
        for (int i = 0; i < 16; i++) {
            a[i] = (float)(row[c / 2 + i] & 15);
            b[i] = (float)(row[c / 2 + i] >> 4);
        }
    } else {
        for (int i = 0; i < 16; i++) {
            a[i] = (float)(int8_t)row[c + i];
            b[i] = (float)(int8_t)row[c + 16 + i];
        }
    }
    memcpy(lo, a, sizeof a);
    memcpy(hi, b, sizeof b);
#endif
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* AVX2 alone: the tile below in 256-bit registers. GCC's 512-bit vectors there kept the
 * accumulators on the stack and widened codes one lane at a time (a Q8_0 [3072, 576] weight at
 * one row on 2 Zen cores: 1,246 us, bf16 116 us). Columns c .. c + 31 as four runs of 8: the
 * codes of run j widen with one instruction each (4-bit: low nibbles are runs 0-1, high nibbles
 * runs 2-3), and two accumulators per output take alternate runs. */
static inline __attribute__((always_inline)) void codes8x4(const uint8_t *row, int bits, int c,
                                                           __m256 w[4]) {
    __m128i b[4];
    if (bits == 4) {
        __m128i packed = _mm_loadu_si128((const __m128i *)(row + c / 2));
        __m128i lo = _mm_and_si128(packed, _mm_set1_epi8(15));
        __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(15));
        b[0] = lo, b[1] = _mm_srli_si128(lo, 8), b[2] = hi, b[3] = _mm_srli_si128(hi, 8);
        for (int j = 0; j < 4; j++) w[j] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b[j]));
    } else {
        for (int j = 0; j < 4; j++) {
            b[j] = _mm_loadl_epi64((const __m128i *)(row + c + 8 * j));
            w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b[j]));
        }
    }
}

static inline float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}

static inline __attribute__((always_inline)) void tile_dot(const uint8_t *row, long row_bytes,
                                                           int bits, const float *sc,
                                                           const float *mn, int groups,
                                                           int group, const float *x, long ldx,
                                                           int k, int nr, int mb, float *out) {
    __m256 acc[4][MAX_ROWS][2];
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mb; m++) acc[r][m][0] = acc[r][m][1] = _mm256_setzero_ps();
    /* the groups of columns c.. and c + 16.., counted along in halves of 16 (no division) */
    int halves = group / 16, left = halves, g0 = 0, g1 = 0;
    for (int c = 0; c < k; c += 32) {
        if (--left == 0) g1++, left = halves; /* the half at c + 16 */
        for (int r = 0; r < nr; r++) {
            __m256 w[4];
            codes8x4(row + r * row_bytes, bits, c, w);
            const float *s = sc + r * groups, *o = mn + r * groups;
            __m256 s0 = _mm256_set1_ps(s[g0]), o0 = _mm256_set1_ps(o[g0]);
            __m256 s1 = _mm256_set1_ps(s[g1]), o1 = _mm256_set1_ps(o[g1]);
            w[0] = _mm256_fmadd_ps(w[0], s0, o0), w[1] = _mm256_fmadd_ps(w[1], s0, o0);
            w[2] = _mm256_fmadd_ps(w[2], s1, o1), w[3] = _mm256_fmadd_ps(w[3], s1, o1);
            for (int m = 0; m < mb; m++) {
                const float *xm = x + m * ldx + c;
                for (int j = 0; j < 4; j++)
                    acc[r][m][j & 1] =
                        _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xm + 8 * j), acc[r][m][j & 1]);
            }
        }
        g0 = g1;
        if (--left == 0) g0++, g1++, left = halves; /* the half at c + 32 */
    }
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mb; m++)
            out[r * mb + m] = hsum8(_mm256_add_ps(acc[r][m][0], acc[r][m][1]));
}
#else
/* out[r * mb + m] = sum_k w[n + r, k] x[m, k] for r < nr weight rows (of `row_bytes` bytes,
 * `groups` scales each) and m < mb activation rows (float32, stride ldx). Two accumulators per
 * output (columns c.. and c + 16..) and several weight rows at a time at one or two activation
 * rows: independent chains of fused multiply-adds, which a single chain's latency would bound. */
static inline __attribute__((always_inline)) void tile_dot(const uint8_t *row, long row_bytes,
                                                           int bits, const float *sc,
                                                           const float *mn, int groups,
                                                           int group, const float *x, long ldx,
                                                           int k, int nr, int mb, float *out) {
    v16f acc[4][MAX_ROWS][2];
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mb; m++) acc[r][m][0] = acc[r][m][1] = (v16f){0};
    for (int c = 0; c < k; c += 32) {
        int g0 = c / group, g1 = (c + 16) / group;
        for (int r = 0; r < nr; r++) {
            v16f lo, hi;
            codes32(row + r * row_bytes, bits, c, &lo, &hi);
            const float *s = sc + r * groups, *o = mn + r * groups;
            v16f w0 = lo * s[g0] + o[g0];
            v16f w1 = hi * s[g1] + o[g1];
            for (int m = 0; m < mb; m++) {
                acc[r][m][0] += w0 * vload(x + m * ldx + c);
                acc[r][m][1] += w1 * vload(x + m * ldx + c + 16);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mb; m++) out[r * mb + m] = hsum(acc[r][m][0] + acc[r][m][1]);
}
#endif

#define TILE(NR, MB) tile_dot(row, row_bytes, bits, sc, mn, groups, group, x, ldx, k, NR, MB, out)

/* One tile: `nr` weight rows (4 at one activation row, 2 at two, else 1) by `mb` rows of x. */
static void tile(const uint8_t *row, long row_bytes, int bits, const float *sc, const float *mn,
                 int groups, int group, const float *x, long ldx, int k, int nr, int mb,
                 float *out) {
    if (nr == 4) TILE(4, 1);
    else if (nr == 2) TILE(2, 2);
    else switch (mb) { /* a copy per row count: the accumulators stay in registers */
    case 1: TILE(1, 1); break;
    case 2: TILE(1, 2); break;
    case 3: TILE(1, 3); break;
    case 4: TILE(1, 4); break;
    case 5: TILE(1, 5); break;
    case 6: TILE(1, 6); break;
    case 7: TILE(1, 7); break;
    default: TILE(1, MAX_ROWS); break;
    }
}

/* A tile's sums out[r * mb + m] (weight row n + r, activation row m0 + m) plus bias into y[M, N]:
 * y and bias bf16 (f32 == 0) or float32 (f32 == 1; bias may be NULL either way). */
static inline void store_tile_sums(const float *out, int r_n, int mb, long n, int m0,
                                   const void *bias, void *y, int f32, int N) {
    for (int r = 0; r < r_n; r++) {
        float b = bias == NULL ? 0.0f
                  : f32        ? ((const float *)bias)[n + r]
                               : bf16_to_float(((const uint16_t *)bias)[n + r]);
        for (int m = 0; m < mb; m++) {
            long at = (long)(m0 + m) * N + n + r;
            if (f32) ((float *)y)[at] = out[r * mb + m] + b;
            else ((uint16_t *)y)[at] = float_to_bf16(out[r * mb + m] + b);
        }
    }
}

/* y[M, N] (row stride N) = xf[M, K] (float32) @ w^T + bias: y and bias bf16 (f32 == 0) or
 * float32 (f32 == 1; bias may be NULL either way). */
static void q_linear(const float *xf, const uint8_t *codes, const void *scales, const void *mins,
                     int half, int bits, int group, const void *bias, void *y, int f32, int M,
                     int N, int K) {
    long row_bytes = bits == 4 ? K / 2 : K;
    int groups = K / group;
    int nr = M == 1 ? 4 : M == 2 ? 2 : 1; /* weight rows a tile */
    int tiles = (N + nr - 1) / nr;
#pragma omp parallel
    {
        float *wide = half ? malloc(sizeof(float) * 2 * nr * (size_t)groups) : NULL;
#pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            int n0 = t * nr, rows = N - n0 < nr ? N - n0 : nr;
            int r_n = rows == nr ? nr : 1; /* a last partial tile: its rows one by one */
            long first = (long)n0 * groups, count = (long)rows * groups;
            const float *sc = as_float(scales, first, count, half, wide);
            const float *mn = as_float(mins, first, count, half, half ? wide + count : NULL);
            float out[4 * MAX_ROWS];
            for (int m0 = 0; m0 < M; m0 += MAX_ROWS) {
                int mb = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
                for (int r0 = 0; r0 < rows; r0 += r_n) {
                    long n = n0 + r0;
                    tile(codes + n * row_bytes, row_bytes, bits, sc + r0 * groups,
                         mn + r0 * groups, groups, group, xf + (long)m0 * K, K, K, r_n, mb, out);
                    store_tile_sums(out, r_n, mb, n, m0, bias, y, f32, N);
                }
            }
        }
        free(wide);
    }
}

/* y[M, N] (bf16, row stride N) = x[M, K] (bf16) @ w^T + bias (bf16 or NULL). */
void kvflow_q_linear(const uint16_t *x, const uint8_t *codes, const void *scales,
                     const void *mins, int half, int bits, int group, const uint16_t *bias,
                     uint16_t *y, int M, int N, int K) {
    float *xf = (float *)aligned_alloc(64, ((size_t)M * K * sizeof(float) + 63) / 64 * 64);
    if (xf == NULL) return;
    for (long i = 0; i < (long)M * K; i++) xf[i] = bf16_to_float(x[i]);
    q_linear(xf, codes, scales, mins, half, bits, group, bias, y, 0, M, N, K);
    free(xf);
}

/* The same in float32: x, bias (or NULL) and y float32. */
void kvflow_q_linear_f32(const float *x, const uint8_t *codes, const void *scales,
                         const void *mins, int half, int bits, int group, const float *bias,
                         float *y, int M, int N, int K) {
    q_linear(x, codes, scales, mins, half, bits, group, bias, y, 1, M, N, K);
}

/* w[N, K] as bf16 (f32 == 0: rounded to nearest even; exact for codes and scales that fit
 * bf16) or float32 (f32 == 1). */
void kvflow_q_dequant(const uint8_t *codes, const void *scales, const void *mins, int half,
                      int bits, int group, void *w, int f32, int N, int K) {
    long row_bytes = bits == 4 ? K / 2 : K;
    int groups = K / group;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *row = codes + n * row_bytes;
        for (int c = 0; c < K; c += 32) {
            v16f lo, hi;
            codes32(row, bits, c, &lo, &hi);
            long g0 = (long)n * groups + c / group, g1 = (long)n * groups + (c + 16) / group;
            v16f w0 = lo * scale_at(scales, g0, half) + scale_at(mins, g0, half);
            v16f w1 = hi * scale_at(scales, g1, half) + scale_at(mins, g1, half);
            long at = (long)n * K + c;
            if (f32) {
                memcpy((float *)w + at, &w0, sizeof w0);
                memcpy((float *)w + at + 16, &w1, sizeof w1);
                continue;
            }
#ifdef __AVX512BF16__ /* one rounding instruction for 32 values (nearest even, as below) */
            _mm512_storeu_si512((uint16_t *)w + at, (__m512i)_mm512_cvtne2ps_pbh((__m512)w1,
                                                                                (__m512)w0));
#else
            for (int i = 0; i < 16; i++) {
                ((uint16_t *)w)[at + i] = float_to_bf16(w0[i]);
                ((uint16_t *)w)[at + 16 + i] = float_to_bf16(w1[i]);
            }
#endif
        }
    }
}

/* The int8 kernels' entry point where the build lacks their instructions: it refuses (0), and the
 * callers keep the float32 kernel (quant.py asks first, so this is the guard, not the route). */
#define REFUSING_INT8_KERNEL(name, out_t, ...) /* ...: the kernel's parameters after K */      \
    int name(const uint16_t *x, const uint8_t *codes, const void *scales, const void *mins,    \
             int half, int bits, int group, const out_t *bias, out_t *y, int M, int N,          \
             int K, ##__VA_ARGS__) {                                                           \
        (void)x, (void)codes, (void)scales, (void)mins, (void)half, (void)bits, (void)group;   \
        (void)bias, (void)y, (void)M, (void)N, (void)K;                                        \
        return 0;                                                                              \
    }

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* The activations' int8 blocks, as the VNNI and AMX kernels take them: 32 bf16 columns at `at`
 * as float32 (lo: columns 0-15, hi: 16-31) and rounded to int8 (q0, q1) from x / d, d = max |x|
 * / 127, which is returned: NaN when the block holds a NaN or an infinity, so that what it
 * scales is not finite either. */
static inline float quantize_block(const uint16_t *at, __m512 *lo, __m512 *hi, __m128i *q0,
                                   __m128i *q1) {
    *lo = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)at)), 16));
    *hi = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(at + 16))), 16));
    __m512 big = _mm512_set1_ps(3.4e38f); /* above bf16's largest finite value */
    __m512 alo = _mm512_abs_ps(*lo), ahi = _mm512_abs_ps(*hi);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(alo, ahi)); /* max drops NaN: */
    int finite = !(_mm512_cmp_ps_mask(alo, big, _CMP_NLE_UQ) |
                   _mm512_cmp_ps_mask(ahi, big, _CMP_NLE_UQ));
    float inv = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
    __m512 scale = _mm512_set1_ps(inv);
    *q0 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(*lo, scale)));
    *q1 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(*hi, scale)));
    return finite ? amax / 127.0f : __builtin_nanf("");
}

/* Block b's float sums into sums[g * stride] for the weight groups g it covers (the mins' term):
 * two groups of 16, or a part of one group of 32 or more (sums zeroed by the caller). */
static inline void add_block_sums(__m512 lo, __m512 hi, int group, int b, float *sums,
                                  long stride) {
    if (group == 16) {
        sums[2 * b * stride] = _mm512_reduce_add_ps(lo);
        sums[(2 * b + 1) * stride] = _mm512_reduce_add_ps(hi);
    } else {
        sums[(long)(b * 32 / group) * stride] += _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* A few activation rows (decode) on AVX512-VNNI (kvflow_q_linear_vnni): the activations are
 * quantized to int8 once a call, with one float32 scale per row and 32 columns (as for AMX, so
 * the same error bound holds), and each weight row's codes meet them in vpdpbusd, 64 products an
 * instruction, summed in int32 per 4 columns; each int32 lane is then scaled (weight scale x
 * activation scale) into float32 accumulators. Per 64 codes that is a handful of instructions
 * where widening to float32 takes about twenty, so the kernel reads its weights at the speed
 * memory delivers them instead of waiting on arithmetic.
 *
 *   4-bit codes (group 32): 64 bytes are 4 blocks of 32 columns; their low nibbles (columns
 *     c .. c + 15 of each block) and high nibbles (c + 16 ..) are two vectors of unsigned bytes
 *     as loaded, so the activations are laid out to match: per 128 columns, 64 bytes holding
 *     each block's first 16 values, then 64 holding each block's last 16 (`vnni_prepare`).
 *   8-bit codes (signed): vpdpbusd multiplies unsigned by signed bytes, so it takes |code| and
 *     the activation with the code's sign; the activations stay in column order.
 * Mins (Q4_1, Q4_K, Q5_K) add sum_g min[n, g] * (the float sum of x over group g). */
#define VNNI_MAX_ROWS 4 /* activation rows a pass over a weight tile (accumulators in registers) */
#define VNNI_TILE_ROWS(M) ((M) == 1 ? 4 : (M) == 2 ? 2 : 1) /* weight rows a tile */

struct vnni_x {
    const int8_t *q;  /* [M][stride] */
    const float *dl;  /* [M][lanes]: the activation scale of each int32 lane of a product */
    const float *xs;  /* [M][groups]: float sums per weight group (mins only) */
    long stride, lanes;
};

/* Quantizes x [M, K] (bf16) into `X`'s buffers (zeroed by the caller, padding included). */
static void vnni_prepare(const uint16_t *x, int M, int K, int bits, int group, int8_t *q,
                         float *dl, float *xs, long stride, long lanes) {
    int groups = K / group;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < K / 32; b++) {
            const uint16_t *at = x + (long)m * K + b * 32;
            __m512 lo, hi;
            __m128i q0, q1;
            float d = quantize_block(at, &lo, &hi, &q0, &q1);
            int8_t *row = q + (long)m * stride;
            float *lane = dl + (long)m * lanes;
            if (bits == 4) { /* block b: 16 bytes at 128 s + 16 i, and 64 bytes further on */
                long s = b / 4, i = b % 4;
                _mm_storeu_si128((__m128i *)(row + 128 * s + 16 * i), q0);
                _mm_storeu_si128((__m128i *)(row + 128 * s + 64 + 16 * i), q1);
                for (int j = 0; j < 4; j++) lane[16 * s + 4 * i + j] = d;
            } else { /* column order; lanes 8 b .. 8 b + 7 cover the block */
                _mm_storeu_si128((__m128i *)(row + 32 * b), q0);
                _mm_storeu_si128((__m128i *)(row + 32 * b + 16), q1);
                for (int j = 0; j < 8; j++) lane[8 * b + j] = d;
            }
            if (xs != NULL) add_block_sums(lo, hi, group, b, xs + (long)m * groups, 1);
        }
}

/* 64 bytes of codes (a row's last `bytes` < 64: masked, zeros after: they add nothing). Plain
 * loads where whole: a streaming read with masked loads ran at 1.4 GB/s on one thread of the
 * development host against 3-4 GB/s with plain ones. */
static inline __m512i load_codes(const uint8_t *at, long bytes, __mmask64 keep) {
    return bytes == 64 ? _mm512_loadu_si512(at) : _mm512_maskz_loadu_epi8(keep, at);
}

/* Up to 16 scales or mins from `at` (float16 where `half`) in the lanes `used`, zeros after. */
static inline __m512 load_scales16(const void *at, __mmask16 used, int half) {
    if (half) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(used, at));
    return _mm512_maskz_loadu_ps(used, at);
}

/* The `per` scales (4, 2 or 1) of 64 bytes of codes from `at`, in the low lanes (a permutation
 * spreads them over the products' lanes); a row's tail (`bytes` < 64) loads the `used` ones
 * only, not reading past the row. */
static inline __m512 load_scales(const void *at, long bytes, int per, __mmask16 used, int half) {
    if (bytes < 64) return load_scales16(at, used, half);
    if (per == 1) return _mm512_set1_ps(scale_at(at, 0, half));
    if (half) /* 4 or 2 float16 values: 8 or 4 bytes */
        return _mm512_castps128_ps512(
            _mm_cvtph_ps(per == 4 ? _mm_loadl_epi64((const __m128i *)at) : _mm_loadu_si32(at)));
    if (per == 4) return _mm512_castps128_ps512(_mm_loadu_ps(at));
    return _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)at)));
}

/* out[r * mb + m] = row r of the weight tile . activation row m0 + m, for r < nr, m < mb
 * (compile-time constants after inlining: the accumulators stay in registers). */
static inline __attribute__((always_inline)) void vnni_tile(
    const uint8_t *codes, long row_bytes, const void *sc, const void *mn, int half, int group,
    int bits, int K, const struct vnni_x *X, int m0, int nr, int mb, float mf, float *out) {
    int groups = K / group;
    __m512 acc[4][VNNI_MAX_ROWS];
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mb; m++) acc[r][m] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(15);
    if (bits == 4) {
        const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        for (long s = 0; s * 64 < row_bytes; s++) {
            long bytes = row_bytes - s * 64 < 64 ? row_bytes - s * 64 : 64;
            __mmask64 keep = bytes == 64 ? ~0ull : (1ull << bytes) - 1;
            __mmask16 blocks = (__mmask16)((1u << (bytes / 16)) - 1);
            for (int r = 0; r < nr; r++) {
                __m512i v = load_codes(codes + r * row_bytes + s * 64, bytes, keep);
                __m512i lo = _mm512_and_si512(v, low);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                __m512 sv = _mm512_permutexvar_ps(  /* 4 blocks of 32 columns: 4 scales */
                    idx, load_scales(scales_from(sc, r * groups + 4 * s, half), bytes, 4, blocks,
                                     half));
                for (int m = 0; m < mb; m++) {
                    const int8_t *xq = X->q + (long)(m0 + m) * X->stride + 128 * s;
                    __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo,
                                                    _mm512_loadu_si512(xq));
                    d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512(xq + 64));
                    __m512 dl = _mm512_loadu_ps(X->dl + (long)(m0 + m) * X->lanes + 16 * s);
                    acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sv, dl),
                                                acc[r][m]);
                }
            }
        }
    } else {
        int span = group < 64 ? group : 64; /* columns a scale covers within 64 */
        __m512i idx = _mm512_srli_epi32(
            _mm512_slli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
                                               1, 0), 2),
            __builtin_ctz(span)); /* lane j covers columns 4 j .. 4 j + 3 */
        for (long s = 0; s * 64 < K; s++) {
            long bytes = K - s * 64 < 64 ? K - s * 64 : 64;
            __mmask64 keep = bytes == 64 ? ~0ull : (1ull << bytes) - 1;
            __mmask16 used = (__mmask16)((1u << ((bytes + span - 1) / span)) - 1);
            for (int r = 0; r < nr; r++) {
                __m512i w = load_codes(codes + r * row_bytes + s * 64, bytes, keep);
                __m512i aw = _mm512_abs_epi8(w);
                __mmask64 neg = _mm512_movepi8_mask(w);
                __m512 sv = _mm512_permutexvar_ps(
                    idx, load_scales(scales_from(sc, r * groups + s * 64 / group, half), bytes,
                                     64 / span, used, half));
                for (int m = 0; m < mb; m++) {
                    __m512i xv = _mm512_loadu_si512(X->q + (long)(m0 + m) * X->stride + 64 * s);
                    xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
                    __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, xv);
                    __m512 dl = _mm512_loadu_ps(X->dl + (long)(m0 + m) * X->lanes + 16 * s);
                    acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sv, dl),
                                                acc[r][m]);
                }
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mb; m++) {
            float total = _mm512_reduce_add_ps(acc[r][m]);
            if (mn != NULL) { /* X->xs holds the sums exactly when there are mins */
                const float *xs = X->xs + (long)(m0 + m) * groups;
                __m512 t = _mm512_setzero_ps();
                for (int g = 0; g < groups; g += 16) {
                    __mmask16 k = groups - g < 16 ? (__mmask16)((1u << (groups - g)) - 1) : 0xffff;
                    t = _mm512_fmadd_ps(load_scales16(scales_from(mn, r * groups + g, half), k,
                                                      half),
                                        _mm512_maskz_loadu_ps(k, xs + g), t);
                }
                total += mf * _mm512_reduce_add_ps(t);
            }
            out[r * mb + m] = total;
        }
}

#define VNNI_AHEAD 8 /* tiles ahead whose bytes each tile asks the cache for */

static inline void vnni_prefetch(const void *at, long bytes) {
    const char *p = (const char *)((uintptr_t)at & ~(uintptr_t)63);
    for (; p < (const char *)at + bytes; p += 64) _mm_prefetch(p, _MM_HINT_T0);
}

/* Whether the kernel takes `bits`-bit codes in groups of `group` columns (K a multiple of 32
 * and of group), and the activations' buffers per row: bytes (stride) and scales (lanes). */
static int vnni_supports(int bits, int group) {
    return bits == 4 ? group == 32 : group == 16 || group == 32 || group % 64 == 0;
}

static void vnni_layout(int bits, int K, long *stride, long *lanes) {
    *stride = bits == 4 ? (K + 127) / 128 * 128 : (K + 63) / 64 * 64;
    *lanes = bits == 4 ? *stride / 8 : *stride / 4;
}

#define KVFLOW_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
/* The same kernel where the CPU has AVX2 but no AVX-512 (most laptops, older servers): the same
 * int8 activations (one scale per row and 32 columns, rounded as above), products of bytes in
 * vpmaddubsw (unsigned by signed, pairs summed in int16) then vpmaddwd by ones (int32 per 4
 * columns), scaled into float32 accumulators. On 2 Zen cores without AVX-512 a decode row
 * waits on both the instructions per code and the memory's streams, so each instruction is
 * counted and a tile reads one weight row (VNNI_TILE_ROWS):
 *
 *   4-bit codes: two blocks (64 columns) a unit, two units a step (q4_blocks4). A unit's 32
 *     bytes unpack in three instructions to low nibbles (columns 0-15 of block b, then of
 *     b + 1) and high ones (16-31 of each), so the
 *     activations are laid out to match: per pair of blocks 64 bytes, block b's first 16 values,
 *     b + 1's first 16, b's last 16, b + 1's last 16 (`vnni_prepare`). The two products add in
 *     int16 (at most 2 x 2 x 15 x 127), one vpmaddwd makes block b's lanes 0-3 and b + 1's
 *     4-7, and one multiply-add scales both (weight scale x activation scale, per lane).
 *   8-bit codes (signed): a block a step, |code| against the activation given the code's sign
 *     (at most 2 x 128 x 127 a pair, no saturation); the activations in column order.
 *
 * Mins (Q4_0 (made from its scales: `offset`), Q4_1, Q4_K, Q5_K) add sum_g min[n, g] * (the
 * float sum of x over group g), 8 groups an instruction. Widening the codes to float32 (the
 * kernel above) took twice these instructions a code. */
#define VNNI_MAX_ROWS 4
/* One weight row a tile: its codes and scales are then two sequential streams a thread, where
 * 4 rows a tile (4 x 2-3 streams) reached 0.75x the bandwidth (RESULTS.md). */
#define VNNI_TILE_ROWS(M) 1
/* Codes a tile asks the cache for ahead of its loads (past the row: the next row's, which the
 * thread reads next): 1.05-1.1x the bandwidth at 4 KB (1 KB: less; 8 KB: the same). */
#define VNNI_AHEAD_BYTES 4096

struct vnni_x {
    const int8_t *q;  /* [M][stride] */
    const float *dl;  /* [M][lanes]: 4-bit: 8 a pair of blocks (4 each); 8-bit: 1 a block */
    const float *xs;  /* [M][groups]: float sums per weight group (mins only) */
    long stride, lanes;
};

/* Quantizes x [M, K] (bf16) into `X`'s buffers (zeroed by the caller, padding included). */
static void vnni_prepare(const uint16_t *x, int M, int K, int bits, int group, int8_t *q,
                         float *dl, float *xs, long stride, long lanes) {
    int groups = K / group;
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(3.4e38f);
    for (int m = 0; m < M; m++)
        for (int b = 0; b < K / 32; b++) {
            const uint16_t *at = x + (long)m * K + b * 32;
            __m256 v[4], amax = _mm256_setzero_ps();
            int finite = 1;
            for (int j = 0; j < 4; j++) {
                __m128i h = _mm_loadu_si128((const __m128i *)(at + 8 * j));
                v[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
                __m256 a = _mm256_andnot_ps(sign, v[j]);
                finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_NLE_UQ)) == 0;
                amax = _mm256_max_ps(amax, a);
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            float top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            float inv = finite && top > 0.0f ? 127.0f / top : 0.0f;
            float d = finite ? top / 127.0f : __builtin_nanf("");
            __m256i i32[4];
            for (int j = 0; j < 4; j++)
                i32[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));
            /* int32 -> int8 in column order: the packs interleave 128-bit lanes, undone after */
            __m256i i8 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]),
                                            _mm256_packs_epi32(i32[2], i32[3]));
            i8 = _mm256_permutevar8x32_epi32(i8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            int8_t *row = q + (long)m * stride;
            float *lane = dl + (long)m * lanes;
            if (bits == 4) { /* block b: 16 bytes at 64 p + 16 h, and 32 bytes further on */
                long p = b / 2, h = b % 2;
                _mm_storeu_si128((__m128i *)(row + 64 * p + 16 * h), _mm256_castsi256_si128(i8));
                _mm_storeu_si128((__m128i *)(row + 64 * p + 32 + 16 * h),
                                 _mm256_extracti128_si256(i8, 1));
                for (int j = 0; j < 4; j++) lane[8 * p + 4 * h + j] = d;
            } else {
                _mm256_storeu_si256((__m256i *)(row + 32 * b), i8);
                lane[b] = d;
            }
            if (xs != NULL) {
                float *sums = xs + (long)m * groups;
                __m256 lo = _mm256_add_ps(v[0], v[1]), hi = _mm256_add_ps(v[2], v[3]);
                if (group == 16) {
                    sums[2 * b] = hsum8(lo);
                    sums[2 * b + 1] = hsum8(hi);
                } else {
                    sums[b * 32 / group] += hsum8(_mm256_add_ps(lo, hi));
                }
            }
        }
}

/* 8 scales or mins from `at` (float16 where `half`) as float32. */
static inline __m256 load8(const void *at, int half) {
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at));
    return _mm256_loadu_ps((const float *)at);
}

/* sum_g mins[g] * xs[g] over a row's `groups` groups, 8 at a time. */
static inline float mins_term(const void *mn, const float *xs, int groups, int half) {
    __m256 t = _mm256_setzero_ps();
    int g = 0;
    for (; g + 8 <= groups; g += 8)
        t = _mm256_fmadd_ps(load8(scales_from(mn, g, half), half), _mm256_loadu_ps(xs + g), t);
    float total = hsum8(t);
    for (; g < groups; g++) total += scale_at(mn, g, half) * xs[g];
    return total;
}

/* 4-bit codes, four blocks (64 bytes of a row) a step, while four are left: acc[r][m] += the
 * products of blocks 0 .. (returned) - 1. A step loads its four scales at once (`half`: float16,
 * a compile-time constant after inlining) and asks for the codes VNNI_AHEAD_BYTES on; a lone
 * product (one weight row, one activation row) alternates two accumulators, so that no
 * multiply-add waits on the one before. Measured against two blocks a step in RESULTS.md. */
static inline __attribute__((always_inline)) int q4_blocks4(
    const uint8_t *codes, long row_bytes, const void *sc, const int half, int blocks,
    const struct vnni_x *X, int m0, int nr, int mb, __m256 acc[4][VNNI_MAX_ROWS]) {
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256i first = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i second = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    const int lone = nr * mb == 1;
    __m256 odd = _mm256_setzero_ps(); /* the lone product's second accumulator */
    int b = 0;
    for (; b + 4 <= blocks; b += 4)
        for (int r = 0; r < nr; r++) {
            const uint8_t *at = codes + r * row_bytes + 16 * b;
            _mm_prefetch((const char *)at + VNNI_AHEAD_BYTES, _MM_HINT_T0);
            __m256i v0 = _mm256_loadu_si256((const __m256i *)at);
            __m256i v1 = _mm256_loadu_si256((const __m256i *)(at + 32));
            __m256i lo0 = _mm256_and_si256(v0, low);
            __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
            __m256i lo1 = _mm256_and_si256(v1, low);
            __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
            const void *s = scales_from(sc, (long)r * (blocks) + b, half);
            __m256 four = _mm256_castps128_ps256(
                half ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)s)) : _mm_loadu_ps(s));
            __m256 sw0 = _mm256_permutevar8x32_ps(four, first);
            __m256 sw1 = _mm256_permutevar8x32_ps(four, second);
            for (int m = 0; m < mb; m++) {
                const int8_t *xq = X->q + (long)(m0 + m) * X->stride + 32 * b;
                const float *dl = X->dl + (long)(m0 + m) * X->lanes + 4 * b;
                __m256i p0 = _mm256_add_epi16(
                    _mm256_maddubs_epi16(lo0, _mm256_loadu_si256((const __m256i *)xq)),
                    _mm256_maddubs_epi16(hi0, _mm256_loadu_si256((const __m256i *)(xq + 32))));
                __m256i p1 = _mm256_add_epi16(
                    _mm256_maddubs_epi16(lo1, _mm256_loadu_si256((const __m256i *)(xq + 64))),
                    _mm256_maddubs_epi16(hi1, _mm256_loadu_si256((const __m256i *)(xq + 96))));
                acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p0, ones)),
                                            _mm256_mul_ps(sw0, _mm256_loadu_ps(dl)), acc[r][m]);
                __m256 d1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(p1, ones));
                __m256 s1 = _mm256_mul_ps(sw1, _mm256_loadu_ps(dl + 8));
                if (lone) odd = _mm256_fmadd_ps(d1, s1, odd);
                else acc[r][m] = _mm256_fmadd_ps(d1, s1, acc[r][m]);
            }
        }
    if (lone) acc[0][0] = _mm256_add_ps(acc[0][0], odd);
    return b;
}

/* out[r * mb + m] = row r of the weight tile . activation row m0 + m, for r < nr, m < mb
 * (compile-time constants after inlining: the accumulators stay in registers). */
static inline __attribute__((always_inline)) void vnni_tile(
    const uint8_t *codes, long row_bytes, const void *sc, const void *mn, int half, int group,
    int bits, int K, const struct vnni_x *X, int m0, int nr, int mb, float mf, float *out) {
    int groups = K / group, blocks = K / 32;
    __m256 acc[4][VNNI_MAX_ROWS];
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mb; m++) acc[r][m] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    if (bits == 4) { /* group 32: block b's scale is scale b */
        const __m256i low = _mm256_set1_epi8(15), spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
        int b = half ? q4_blocks4(codes, row_bytes, sc, 1, blocks, X, m0, nr, mb, acc)
                     : q4_blocks4(codes, row_bytes, sc, 0, blocks, X, m0, nr, mb, acc);
        for (; b < blocks; b += 2) { /* the last 1-3 blocks */
            int pair = b + 1 < blocks; /* a row's odd last block: alone, its upper lanes zero */
            for (int r = 0; r < nr; r++) {
                const uint8_t *at = codes + r * row_bytes + 16 * b;
                __m256i v = pair ? _mm256_loadu_si256((const __m256i *)at)
                                 : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)at));
                __m256i lo = _mm256_and_si256(v, low);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                const void *s = scales_from(sc, (long)r * groups + b, half);
                __m128 two = half ? _mm_cvtph_ps(pair ? _mm_loadu_si32(s) : _mm_loadu_si16(s))
                                  : pair ? _mm_castpd_ps(_mm_load_sd((const double *)s))
                                         : _mm_load_ss((const float *)s);
                __m256 sw = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), spread);
                for (int m = 0; m < mb; m++) {
                    const int8_t *xq = X->q + (long)(m0 + m) * X->stride + 32 * b;
                    __m256i p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xq)),
                        _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 32))));
                    __m256 dl = _mm256_loadu_ps(X->dl + (long)(m0 + m) * X->lanes + 4 * b);
                    acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)),
                                                _mm256_mul_ps(sw, dl), acc[r][m]);
                }
            }
        }
    } else {
        /* block b's (first) scale: g0, counted along (no division a block) */
        int per = group == 16 ? 1 : group / 32, left = per;
        for (int b = 0, g0 = 0; b < blocks; b++) {
            for (int r = 0; r < nr; r++) {
                const uint8_t *at = codes + r * row_bytes + 32 * b;
                if ((b & 1) == 0) _mm_prefetch((const char *)at + VNNI_AHEAD_BYTES, _MM_HINT_T0);
                __m256i w = _mm256_loadu_si256((const __m256i *)at);
                __m256i aw = _mm256_abs_epi8(w);
                long g = (long)r * groups + g0;
                __m256 sw = group == 16 ? _mm256_set_m128(_mm_set1_ps(scale_at(sc, g + 1, half)),
                                                          _mm_set1_ps(scale_at(sc, g, half)))
                                        : _mm256_set1_ps(scale_at(sc, g, half));
                for (int m = 0; m < mb; m++) {
                    const int8_t *xq = X->q + (long)(m0 + m) * X->stride + 32 * b;
                    __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xq), w);
                    __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones);
                    __m256 dx = _mm256_set1_ps(X->dl[(long)(m0 + m) * X->lanes + b]);
                    acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(sw, dx),
                                                acc[r][m]);
                }
            }
            if (group == 16) g0 += 2;
            else if (--left == 0) g0++, left = per;
        }
    }
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mb; m++) {
            float total = hsum8(acc[r][m]);
            if (mn != NULL) /* X->xs holds the sums exactly when there are mins */
                total += mf * mins_term(scales_from(mn, (long)r * groups, half),
                                        X->xs + (long)(m0 + m) * groups, groups, half);
            out[r * mb + m] = total;
        }
}

static int vnni_supports(int bits, int group) {
    return bits == 4 ? group == 32 : group == 16 || group % 32 == 0;
}

static void vnni_layout(int bits, int K, long *stride, long *lanes) {
    long blocks = K / 32, pairs = (blocks + 1) / 2;
    *stride = bits == 4 ? 64 * pairs : K;
    *lanes = bits == 4 ? 8 * pairs : blocks;
}

#define KVFLOW_VNNI 1
#endif

#ifdef KVFLOW_VNNI /* the entry point over either branch's tile, layout and preparation */
#define VNNI_TILE(NR, MB)                                                                     \
    vnni_tile(codes + n * row_bytes, row_bytes, scales_from(scales, n * groups, half),        \
              mn ? scales_from(mn, n * groups, half) : NULL, half, group, bits, K, &X, m0, NR, \
              MB, mf, out)

/* y[M, N] = x[M, K] (bf16) @ w^T + bias (NULL or y's dtype), y bf16, or float32 where `f32` (the
 * sums as they are: the logits head's). mins NULL when every min is zero; `offset` nonzero when
 * every min is -offset x its scale (GGUF's Q4_0: w = scale x (code - 8)): the mins' term is then
 * made from the scales and the mins are not read (a decode step's bytes: 18 a block, not 20; and
 * a stream fewer, measured at up to 1.3x the bandwidth). Needs K a multiple of 32 and groups
 * `vnni_supports` takes; returns 0 (nothing written) when it cannot run. */
static int q_linear_vnni(const uint16_t *x, const uint8_t *codes, const void *scales,
                         const void *mins, int half, int bits, int group, const void *bias,
                         void *y, int f32, int offset, int M, int N, int K) {
    if (K % 32 || K % group || !vnni_supports(bits, group)) return 0;
    long stride, lanes, groups = K / group;
    vnni_layout(bits, K, &stride, &lanes);
    long row_bytes = bits == 4 ? K / 2 : K;
    /* the mins' term: sum_g mn[g] * xs[g] times mf (-offset: a power of two for Q4_0, so the sum
     * is the one the mins give, exactly) */
    const void *mn = offset ? scales : mins;
    float mf = offset ? (float)-offset : 1.0f;
    int8_t *q = calloc((size_t)M * stride, 1);
    float *dl = calloc((size_t)M * lanes, sizeof(float));
    float *xs = mn ? calloc((size_t)M * groups, sizeof(float)) : NULL;
    if (q == NULL || dl == NULL || (mn && xs == NULL)) return free(q), free(dl), free(xs), 0;
    vnni_prepare(x, M, K, bits, group, q, dl, xs, stride, lanes);
    struct vnni_x X = {q, dl, xs, stride, lanes};
    int nr = VNNI_TILE_ROWS(M); /* weight rows a tile */
    int tiles = (N + nr - 1) / nr;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < tiles; t++) {
        int n0 = t * nr, rows = N - n0 < nr ? N - n0 : nr;
        int r_n = rows == nr ? nr : 1; /* a last partial tile: its rows one by one */
        float out[4 * VNNI_MAX_ROWS];
#ifdef VNNI_AHEAD
        if (t + VNNI_AHEAD < tiles) { /* loads waited on memory more without (RESULTS.md) */
            long ahead = (long)(t + VNNI_AHEAD) * nr;
            int last = ahead + nr > N ? N : (int)ahead + nr;
            vnni_prefetch(codes + ahead * row_bytes, (last - ahead) * row_bytes);
            long scale_bytes = (last - ahead) * groups * (half ? 2 : 4);
            vnni_prefetch(scales_from(scales, ahead * groups, half), scale_bytes);
            if (mins && !offset) vnni_prefetch(scales_from(mins, ahead * groups, half), scale_bytes);
        }
#endif
        for (int m0 = 0; m0 < M; m0 += VNNI_MAX_ROWS) {
            int mb = M - m0 < VNNI_MAX_ROWS ? M - m0 : VNNI_MAX_ROWS;
            for (int r0 = 0; r0 < rows; r0 += r_n) {
                long n = n0 + r0;
                if (r_n == 4) VNNI_TILE(4, 1);
                else if (r_n == 2) VNNI_TILE(2, 2);
                else switch (mb) {
                    case 1: VNNI_TILE(1, 1); break;
                    case 2: VNNI_TILE(1, 2); break;
                    case 3: VNNI_TILE(1, 3); break;
                    default: VNNI_TILE(1, 4); break;
                }
                store_tile_sums(out, r_n, mb, n, m0, bias, y, f32, N);
            }
        }
    }
    free(q);
    free(dl);
    free(xs);
    return 1;
}

int kvflow_q_linear_vnni(const uint16_t *x, const uint8_t *codes, const void *scales,
                         const void *mins, int half, int bits, int group, const uint16_t *bias,
                         uint16_t *y, int M, int N, int K, int offset) {
    return q_linear_vnni(x, codes, scales, mins, half, bits, group, bias, y, 0, offset, M, N, K);
}

/* The same into float32 y (bias float32 or NULL). */
int kvflow_q_linear_vnni_f32(const uint16_t *x, const uint8_t *codes, const void *scales,
                             const void *mins, int half, int bits, int group, const float *bias,
                             float *y, int M, int N, int K, int offset) {
    return q_linear_vnni(x, codes, scales, mins, half, bits, group, bias, y, 1, offset, M, N, K);
}

int kvflow_q_vnni_built(void) { return 1; }
#else
int kvflow_q_vnni_built(void) { return 0; }
REFUSING_INT8_KERNEL(kvflow_q_linear_vnni, uint16_t, int offset)
REFUSING_INT8_KERNEL(kvflow_q_linear_vnni_f32, float, int offset)
#endif

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && \
    defined(__AVX512BW__) && defined(__AVX512BF16__)
/* Batches on AMX's int8 unit (kvflow_q_linear_amx). The codes are the tiles (16 weight rows x 32
 * columns; 8-bit codes as stored, 4-bit ones unpacked to a byte each per tile of 16 rows), the
 * activations are quantized to int8 with one float32 scale per activation row and 32 columns
 * (max |x| -> 127, as llama.cpp's Q8 blocks), and
 *   y[m, n] = sum_b scale[n, g(b)] * dx[m, b] * sum_{k in b} code[n, k] xq[m, k]
 *             (+ sum_g min[n, g] * xsum[m, g], xsum of the bf16 activations, when there are mins)
 * over 32-column blocks b (16-column pieces for groups of 16). The tile unit computes the int32
 * sums of a 16 x 16 output tile (weight rows x activation rows) a block at a time, up to 32
 * activation rows per weight tile; the scaling is float32 vector work per block, which the tile
 * unit overlaps (two pairs of accumulator tiles in turn). The weights are read once a call,
 * ahead of use (software prefetch: the conversion otherwise waits on memory), which is what
 * bounds the step up to 16-32 rows. Linux grants the tile state on request (arch_prctl), once per
 * process: kvflow_q_amx_init asks and says whether the kernel may run. */
#include <sys/syscall.h>
#include <unistd.h>

static int amx_ok = 0;

int kvflow_q_amx_init(void) {
    amx_ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return amx_ok;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Byte ranges to bring into the cache a line at a time while the current tile computes: the
 * next tile's codes, scales and mins (the hardware prefetcher, left alone, leaves the conversion
 * waiting on memory for most of its time). */
struct ahead {
    const char *at[3];
    long left[3];
};

static inline void prefetch_line(struct ahead *p) {
    for (int i = 0; i < 3; i++)
        if (p->left[i] > 0) {
            _mm_prefetch(p->at[i], _MM_HINT_T0);
            p->at[i] += 64, p->left[i] -= 64;
            return;
        }
}

/* Output rows c * 16 .. of the tile (columns n0 .. n0 + rows - 1): acc + bias, rounded. acc is
 * [weight row][activation row]; a gather reads one activation row's 16 outputs across it, so
 * y's rows take one 32-byte store each (scalar stores across y's rows cost more than the
 * products when N is large, as for the logits head). */
static void store_tile(const v16f acc[16], int rows, int mrows, const uint16_t *bias,
                       uint16_t *y, int N, int n0) {
    __mmask16 keep = (__mmask16)((1u << rows) - 1u);
    __m512 b = _mm512_setzero_ps();
    if (bias)
        b = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + n0)), 16));
    __m512i across = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
    for (int m = 0; m < mrows; m++) {
        __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(across, _mm512_set1_epi32(m)),
                                       (const float *)acc, 4);
        __m256bh h = _mm512_cvtneps_pbh(_mm512_add_ps(v, b));
        _mm256_mask_storeu_epi16(y + (long)m * N + n0, keep, (__m256i)h);
    }
}

/* x [M, K] bf16 -> xq[M / 16][K / 4][16][4] int8 (quads of k per activation row, zeros for
 * rows past M), dx[M / 16][K / 32][16]: max |x| / 127 of each row's 32-column blocks (NaN where
 * a block holds a NaN or an infinity, so that the output is not finite either), and, xs not
 * NULL, xs[M / 16][K / group][16]: each row's float sum over each group. The threads of the
 * enclosing parallel region take whole chunks of 16 rows: the rows of a chunk share cache
 * lines, and a line written by both cores moves between them at every write. */
static void quantize_rows(const uint16_t *x, int M, int K, int group, int8_t *xq, float *dx,
                          float *xs) {
    int blocks = K / 32, groups = K / group;
#pragma omp for schedule(static)
    for (int c = 0; c < (M + 15) / 16; c++) {
        int rows = M - c * 16 < 16 ? M - c * 16 : 16;
        int8_t *cq = xq + (long)c * K * 16;
        float *cd = dx + (long)c * blocks * 16, *cs = xs ? xs + (long)c * groups * 16 : NULL;
        if (rows < 16) {
            memset(cq, 0, (size_t)K * 16);
            memset(cd, 0, sizeof(float) * blocks * 16);
        }
        if (cs) memset(cs, 0, sizeof(float) * groups * 16);
        for (int r = 0; r < rows; r++) {
            for (int b = 0; b < blocks; b++) {
                const uint16_t *at = x + ((long)c * 16 + r) * K + b * 32;
                __m512 lo, hi;
                __m128i q0, q1;
                float d = quantize_block(at, &lo, &hi, &q0, &q1);
                uint32_t quads[8];
                memcpy(quads, &q0, 16);
                memcpy(quads + 4, &q1, 16);
                int8_t *to = cq + (long)b * 8 * 64 + r * 4;
                for (int i = 0; i < 8; i++) memcpy(to + i * 64, &quads[i], 4);
                cd[b * 16 + r] = d;
                if (cs) add_block_sums(lo, hi, group, b, cs + r, 16);
            }
        }
    }
}

struct amx_args {
    const int8_t *xq;
    const float *dx, *xs, *sc, *mn; /* sc, mn: the tile's scales and mins, as float32 */
    int group, K, M, c, two, rows, nibbles; /* nibbles: unsigned 4-bit codes, else int8 */
};

/* acc[r] += scale[r, g] * dx * (a block's row of int32 sums, converted) (+ min[r, g] * xsum when
 * the piece starts group g). Up to 8 activation rows in the chunk: 256-bit vectors, which three
 * ports execute where 512-bit ones have two. */
static inline void scale_block(const int32_t cbuf[16][16], const struct amx_args *p, int h, int k,
                               v16f acc[16]) {
    int groups = p->K / p->group, g = k / p->group, ch = p->c + h;
    const float *sc = p->sc + g, *mn = p->mn ? p->mn + g : NULL;
    const float *dx = p->dx + ((long)ch * (p->K / 32) + k / 32) * 16;
    const float *xs = p->xs + ((long)ch * groups + g) * 16;
    int with_min = mn != NULL && k % p->group == 0;
    if (p->M - ch * 16 <= 8) {
        __m256 dxv = _mm256_load_ps(dx), xv = with_min ? _mm256_load_ps(xs) : _mm256_setzero_ps();
        for (int r = 0; r < p->rows; r++) {
            __m256 v = _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i *)cbuf[r]));
            __m256 a = _mm256_load_ps((const float *)&acc[r]);
            a = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(sc[r * groups]), dxv), v, a);
            if (with_min) a = _mm256_fmadd_ps(_mm256_set1_ps(mn[r * groups]), xv, a);
            _mm256_store_ps((float *)&acc[r], a);
        }
        return;
    }
    v16f dxv = vload(dx), xv = with_min ? vload(xs) : (v16f){0};
    for (int r = 0; r < p->rows; r++) {
        v16f v = (v16f)_mm512_cvtepi32_ps(_mm512_load_si512(cbuf[r]));
        acc[r] += (sc[r * groups] * dxv) * v;
        if (with_min) acc[r] += mn[r * groups] * xv;
    }
}

#define PIECE_PRODUCTS(C0, C1)                                                                 \
    do {                                                                                       \
        _tile_zero(C0);                                                                        \
        _tile_zero(C1);                                                                        \
        _tile_loadd(2, a + k, lda);                                                            \
        _tile_loadd(3, b0 + (k / 4) * 64, 64);                                                 \
        if (p->nibbles) _tile_dpbusd(C0, 2, 3);                                                \
        else _tile_dpbssd(C0, 2, 3);                                                           \
        if (p->two) {                                                                          \
            _tile_loadd(4, b1 + (k / 4) * 64, 64);                                             \
            if (p->nibbles) _tile_dpbusd(C1, 2, 4);                                            \
            else _tile_dpbssd(C1, 2, 4);                                                       \
        }                                                                                      \
    } while (0)

#define PIECE_SCALE(C0, C1, K0)                                                                \
    do {                                                                                       \
        _tile_stored(C0, cbuf, 64);                                                            \
        scale_block(cbuf, p, 0, K0, acc[0]);                                                        \
        if (p->two) {                                                                          \
            _tile_stored(C1, cbuf, 64);                                                        \
            scale_block(cbuf, p, 1, K0, acc[1]);                                                    \
        }                                                                                      \
    } while (0)

/* 16 weight rows of int8 codes at `a` (row stride lda) against activation chunks c, c + 1;
 * pieces of kb columns alternate between accumulator tiles 0, 1 and 5, 6. */
static void amx_rows(const int8_t *a, long lda, const struct amx_args *p, v16f acc[2][16],
                      struct ahead *next) {
    int32_t cbuf[16][16] __attribute__((aligned(64)));
    int kb = p->group == 16 ? 16 : 32, K = p->K;
    const int8_t *b0 = p->xq + (long)p->c * (K / 4) * 64, *b1 = b0 + (long)(K / 4) * 64;
    long lines = (next->left[0] + next->left[1] + next->left[2]) / 64;
    int per_piece = (int)(lines / (K / kb)) + 1; /* the next tile's lines, spread over pieces */
    memset(acc, 0, sizeof(v16f) * 32);
    for (int k = 0; k < K; k += kb) {
        for (int i = 0; i < per_piece; i++) prefetch_line(next);
        if ((k / kb) % 2 == 0) {
            PIECE_PRODUCTS(0, 1);
            if (k > 0) PIECE_SCALE(5, 6, k - kb);
        } else {
            PIECE_PRODUCTS(5, 6);
            PIECE_SCALE(0, 1, k - kb);
        }
    }
    if ((K / kb) % 2) PIECE_SCALE(0, 1, K - kb);
    else PIECE_SCALE(5, 6, K - kb);
}

/* Rows of 4-bit codes as bytes in column order: to[r][K] for r < rows, zero rows after. */
static void unpack_nibbles(const uint8_t *codes, int rows, int K, uint8_t *to) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int r = 0; r < 16; r++) {
        uint8_t *out = to + (long)r * K;
        if (r >= rows) {
            memset(out, 0, (size_t)K);
            continue;
        }
        const uint8_t *row = codes + (long)r * (K / 2);
        int c = 0;
        for (; c + 64 <= K; c += 64) { /* two blocks: [low0 high0 low1 high1], 16 bytes each */
            __m256i b = _mm256_loadu_si256((const __m256i *)(row + c / 2));
            __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, low)),
                                           _mm256_and_si256(_mm256_srli_epi16(b, 4), low), 1);
            _mm512_storeu_si512(out + c, _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0)));
        }
        if (c < K) {
            __m128i b = _mm_loadu_si128((const __m128i *)(row + c / 2));
            _mm_storeu_si128((__m128i *)(out + c), _mm_and_si128(b, _mm256_castsi256_si128(low)));
            _mm_storeu_si128((__m128i *)(out + c + 16),
                             _mm_and_si128(_mm_srli_epi16(b, 4), _mm256_castsi256_si128(low)));
        }
    }
}

/* y[M, N] (bf16) = x[M, K] (bf16) @ w^T + bias (bf16 or NULL) on AMX-INT8, the activations
 * quantized per 32 columns; mins NULL when every min is zero (Q8_0, Q6_K, int8).
 * Needs group 16 or a multiple of 32; returns 0 (nothing written) when it cannot run. */
int kvflow_q_linear_amx(const uint16_t *x, const uint8_t *codes, const void *scales,
                         const void *mins, int half, int bits, int group, const uint16_t *bias,
                         uint16_t *y, int M, int N, int K) {
    if (!amx_ok || K % 32 || (group != 16 && group % 32) || K % group) return 0;
    int chunks = (M + 15) / 16, groups = K / group, tiles = (N + 15) / 16;
    int8_t *xq = aligned_alloc(64, (size_t)chunks * K * 16);
    float *dx = aligned_alloc(64, (size_t)chunks * (K / 32) * 64);
    float *xs = aligned_alloc(64, (size_t)chunks * groups * 64);
    if (xq == NULL || dx == NULL || xs == NULL) return free(xq), free(dx), free(xs), 0;
#pragma omp parallel
    {
        quantize_rows(x, M, K, group, xq, dx, mins ? xs : NULL); /* ends in a barrier */
        int kb = group == 16 ? 16 : 32;
        struct tile_config cfg = {.palette = 1};
        for (int i = 0; i < 7; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64; /* C (0, 1, 5, 6) */
        cfg.colsb[2] = (uint16_t)kb;                                      /* A: n x k int8 */
        cfg.rows[3] = cfg.rows[4] = (uint8_t)(kb / 4);                    /* B: k quads x m */
        _tile_loadconfig(&cfg);
        int8_t *pad = calloc(16, (size_t)K); /* a last partial tile, zero rows after N */
        float *wide = half ? malloc(sizeof(float) * 32 * (size_t)groups) : NULL;
        v16f acc[2][16];
        /* guided: each thread starts on a long run of tiles (whose next tile it prefetches)
         * and the runs shrink toward the end, so a thread that falls behind (the cores are
         * shared with the server's other threads, and one core computes a few % slower) hands
         * its last tiles to the other instead of keeping it waiting at the barrier */
#pragma omp for schedule(guided)
        for (int t = 0; t < tiles; t++) {
            int n0 = t * 16, rows = N - n0 < 16 ? N - n0 : 16;
            long row_bytes = bits == 4 ? K / 2 : K;
            const int8_t *a = (const int8_t *)codes + (long)n0 * K;
            if (bits == 4) unpack_nibbles(codes + n0 * row_bytes, rows, K, (uint8_t *)(a = pad));
            else if (rows < 16) a = memcpy(pad, a, (size_t)rows * K);
            long following = t + 1 < tiles ? (N - n0 - 16 < 16 ? N - n0 - 16 : 16) : 0;
            long scale_bytes = following * groups * (half ? 2 : 4);
            struct ahead next = {
                {(const char *)(codes + (n0 + 16) * row_bytes),
                 (const char *)scales_from(scales, (long)(n0 + 16) * groups, half),
                 (const char *)(mins ? scales_from(mins, (long)(n0 + 16) * groups, half) : NULL)},
                {following * row_bytes, scale_bytes, mins ? scale_bytes : 0}};
            long first = (long)n0 * groups, count = (long)rows * groups;
            const float *sc = as_float(scales, first, count, half, wide);
            const float *mn =
                mins ? as_float(mins, first, count, half, half ? wide + 16 * groups : NULL) : NULL;
            for (int c = 0; c < chunks; c += 2) {
                struct amx_args p = {xq, dx, xs, sc, mn, group, K, M, c, c + 1 < chunks, rows,
                                      bits == 4};
                amx_rows(a, K, &p, acc, &next);
                int left = M - c * 16;
                store_tile(acc[0], rows, left < 16 ? left : 16, bias, y + (long)c * 16 * N, N, n0);
                if (p.two) store_tile(acc[1], rows, left - 16 < 16 ? left - 16 : 16, bias,
                                      y + (long)(c + 1) * 16 * N, N, n0);
            }
        }
        free(pad);
        free(wide);
        _tile_release();
    }
    free(xq);
    free(dx);
    free(xs);
    return 1;
}

/* Batches on AMX's bf16 unit (kvflow_q_gemm_amx): y = x @ w^T on the weight dequantized to bf16
 * (the values kvflow_q_dequant gives) 32 rows at a time into the thread's buffer, where the tile
 * unit reads them as they are (weight rows are the A tiles, so dequantizing is one fused
 * multiply-add and one rounding per 16 values, no re-layout); x is laid out once a call as the B
 * tiles (pairs of columns, 16 rows a tile). Against the AMX-INT8 kernel this scales each weight
 * once a call, not once per 16 rows of x, and quantizes no activations; against F.linear on
 * kvflow_q_dequant's output no bf16 copy of the weight goes to memory. With `silu` (w = gate |
 * up, N = 2 H) a tile's 16 gate rows and their 16 up rows meet in the epilogue, which makes
 * silu(gate) * up as kvflow_silu_mul rounds it, so the wide gate | up output never exists. */

/* x [M, K] bf16 -> xv[M / 16][K / 2][16][2]: the pair (k, k + 1) of row 16 c + j at [c][k / 2][j]
 * (zero rows past M). The threads of the enclosing parallel region take whole chunks. */
static void pair_rows(const uint16_t *x, int M, int K, uint16_t *xv) {
    const __m512i across = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(16));
#pragma omp for schedule(static)
    for (int c = 0; c < (M + 15) / 16; c++) {
        int rows = M - c * 16 < 16 ? M - c * 16 : 16;
        uint32_t pairs[16][16] __attribute__((aligned(64))); /* [row][pair] of 32 columns */
        if (rows < 16) memset(pairs[rows], 0, sizeof(pairs[0]) * (16 - rows));
        for (int k = 0; k < K; k += 32) {
            for (int j = 0; j < rows; j++)
                memcpy(pairs[j], x + ((long)c * 16 + j) * K + k, 64);
            for (int p = 0; p < 16; p++)
                _mm512_storeu_si512(xv + ((long)c * K / 2 + k / 2 + p) * 32,
                                    _mm512_i32gather_epi32(
                                        _mm512_add_epi32(across, _mm512_set1_epi32(p)), pairs, 4));
        }
    }
}

/* Weight rows r .. r + rows - 1 (rows <= 16; zero rows after) as bf16 rows of K into `to`, the
 * scales and mins widened to float32 (`wide`: 2 * 16 * groups floats); the rows of the tile that
 * follows (`next`, `next_rows`) are asked of the cache meanwhile. */
static void dequant_rows(const uint8_t *codes, const void *scales, const void *mins, int half,
                         int bits, int group, int K, long r, int rows, long next, int next_rows,
                         float *wide, uint16_t *to) {
    long row_bytes = bits == 4 ? K / 2 : K, groups = K / group;
    const float *sc = as_float(scales, r * groups, rows * groups, half, wide);
    const float *mn = as_float(mins, r * groups, rows * groups, half, wide + 16 * groups);
    for (int j = 0; j < 16; j++) {
        uint16_t *row = to + (long)j * K;
        if (j >= rows) {
            memset(row, 0, (size_t)K * 2);
            continue;
        }
        if (j < next_rows) {
            const char *at = (const char *)(codes + (next + j) * row_bytes);
            for (long b = 0; b < row_bytes; b += 64) _mm_prefetch(at + b, _MM_HINT_T0);
        }
        const uint8_t *w = codes + (r + j) * row_bytes;
        const float *rs = sc + (long)j * groups, *rm = mn + (long)j * groups;
        for (int c = 0, g0 = 0; c < K; c += 32) { /* as kvflow_q_dequant: the same values */
            int g1 = group == 16 ? g0 + 1 : g0; /* groups: 16 columns, or 32 and more */
            v16f lo, hi;
            codes32(w, bits, c, &lo, &hi);
            v16f w0 = lo * rs[g0] + rm[g0], w1 = hi * rs[g1] + rm[g1];
            g0 = group == 16 ? g0 + 2 : (c + 32) / group;
            _mm512_storeu_si512(row + c, (__m512i)_mm512_cvtne2ps_pbh((__m512)w1, (__m512)w0));
        }
    }
}

/* y[M, N] (bf16) = x[M, K] (bf16) @ w^T + bias (bf16 or NULL), or with `silu` (w = gate | up,
 * N even) y[M, N / 2] = silu(gate) * up. Needs K a multiple of 32 and of the group; returns 0
 * (nothing written) when it cannot run. */
int kvflow_q_gemm_amx(const uint16_t *x, const uint8_t *codes, const void *scales,
                      const void *mins, int half, int bits, int group, const uint16_t *bias,
                      uint16_t *y, int M, int N, int K, int silu) {
    if (!amx_ok || K % 32 || K % group || (silu && N % 2)) return 0;
    int H = silu ? N / 2 : N, chunks = (M + 15) / 16, groups = K / group;
    int width = silu ? 16 : 32, tiles = (H + width - 1) / width; /* output columns a tile */
    int threads = omp_get_max_threads();
    /* a thread's two weight buffers of [2][16][K], alternate tiles (writing the one the last
     * tile's loads read stalled the stores: a quarter of the kernel's time at 32 rows), and its
     * scales and mins as float32 */
    uint16_t *xv = aligned_alloc(64, (size_t)chunks * 16 * K * 2);
    uint16_t *wbufs = aligned_alloc(64, (size_t)threads * 64 * K * 2);
    float *wides = malloc(sizeof(float) * 32 * (size_t)groups * threads);
    if (xv == NULL || wbufs == NULL || wides == NULL)
        return free(xv), free(wbufs), free(wides), 0;
#pragma omp parallel num_threads(threads)
    {
        pair_rows(x, M, K, xv); /* ends in a barrier */
        struct tile_config cfg = {.palette = 1};
        for (int i = 0; i < 8; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
        _tile_loadconfig(&cfg);
        int me = omp_get_thread_num();
        uint16_t *mine = wbufs + (long)me * 64 * K;
        float *wide = wides + (long)me * 32 * groups;
        float cbuf[4][16][16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            uint16_t *wbuf = mine + (long)(t % 2) * 32 * K;
            /* the tile's halves: weight rows r[h] .. (rows[h] of them), output columns from n0 */
            long n0 = (long)t * width, r[2] = {n0, silu ? H + n0 : n0 + 16}, end[2] = {H, N};
            int rows[2];
            for (int h = 0; h < 2; h++) {
                long left = end[h] - r[h], after = left - width; /* rows left, and past the tile */
                rows[h] = left < 0 ? 0 : left < 16 ? (int)left : 16;
                int next_rows = t + 1 < tiles && after > 0 ? (after < 16 ? (int)after : 16) : 0;
                dequant_rows(codes, scales, mins, half, bits, group, K, r[h], rows[h],
                             r[h] + width, next_rows, wide, wbuf + (long)h * 16 * K);
            }
            for (int c = 0; c < chunks; c += 2) {
                int two = c + 1 < chunks;
                const uint16_t *b0 = xv + (long)c * 16 * K, *b1 = b0 + (long)16 * K;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int k = 0; k < K; k += 32) {
                    _tile_loadd(4, wbuf + k, K * 2);
                    _tile_loadd(5, wbuf + (long)16 * K + k, K * 2);
                    _tile_loadd(6, b0 + (long)k * 16, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 5, 6);
                    if (two) {
                        _tile_loadd(7, b1 + (long)k * 16, 64);
                        _tile_dpbf16ps(2, 4, 7);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, cbuf[0], 64);
                _tile_stored(1, cbuf[1], 64);
                if (two) {
                    _tile_stored(2, cbuf[2], 64);
                    _tile_stored(3, cbuf[3], 64);
                }
                for (int i = 0; i < 1 + two; i++) { /* chunk c + i: tiles 2 i (+ 2 i + 1) */
                    v16f *lo = (v16f *)cbuf[2 * i], *hi = (v16f *)cbuf[2 * i + 1];
                    int mrows = M - (c + i) * 16 < 16 ? M - (c + i) * 16 : 16;
                    uint16_t *yc = y + (long)(c + i) * 16 * H;
                    if (!silu) {
                        store_tile(lo, rows[0], mrows, bias, yc, H, (int)n0);
                        if (rows[1] > 0) store_tile(hi, rows[1], mrows, bias, yc, H, (int)n0 + 16);
                        continue;
                    }
                    for (int j = 0; j < rows[0]; j++) { /* [weight row][x row]: a row's bias */
                        float bg = bias ? bf16_to_float(bias[n0 + j]) : 0.0f;
                        float bu = bias ? bf16_to_float(bias[H + n0 + j]) : 0.0f;
                        v16f act = vround_bf16(vsilu(vround_bf16(lo[j] + bg)));
                        lo[j] = act * vround_bf16(hi[j] + bu);
                    }
                    store_tile(lo, rows[0], mrows, NULL, yc, H, (int)n0);
                }
            }
        }
        _tile_release();
    }
    free(xv);
    free(wbufs);
    free(wides);
    return 1;
}
#else
int kvflow_q_amx_init(void) { return 0; }
REFUSING_INT8_KERNEL(kvflow_q_linear_amx, uint16_t)
int kvflow_q_gemm_amx(const uint16_t *x, const uint8_t *codes, const void *scales,
                      const void *mins, int half, int bits, int group, const uint16_t *bias,
                      uint16_t *y, int M, int N, int K, int silu) {
    (void)x, (void)codes, (void)scales, (void)mins, (void)half, (void)bits, (void)group;
    (void)bias, (void)y, (void)M, (void)N, (void)K, (void)silu;
    return 0;
}
#endif
