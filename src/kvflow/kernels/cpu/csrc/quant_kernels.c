/* kvflow's linear layers on quantized weights, read as they are stored:
 *
 *   kvflow_q_linear   y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), bf16 x and y, w quantized
 *                     (kvflow_q_linear_f32: float32 x and y)
 *   kvflow_q_dequant  w[N, K] -> bf16 (prefill: a large batch runs the bf16 matmul on it)
 *
 * The weight layout (made once by kvflow/model/quant_format.py from GGUF blocks or a float
 * checkpoint): K is cut in groups of `group` columns (a multiple of 16; K a multiple of 32);
 * w[n, k] = scales[n, k / group] * code[n, k] + mins[n, k / group], scales and mins float32.
 *   bits 8: int8 codes [N, K], column k at byte k.
 *   bits 4: unsigned 4-bit codes [N, K / 2]; each 32 columns c .. c + 31 take 16 bytes at
 *           c / 2: byte i holds column c + i in its low nibble and c + 16 + i in its high one.
 * GGUF's Q4_0, Q4_1, Q4_K map to bits 4 (group 32), Q5_K and Q8_0 to bits 8 (group 32), Q6_K
 * to bits 8 (group 16): every scale and min is the product of at most a float16 and a 6- or
 * 8-bit integer, exact in float32, so the weights are the values the file holds.
 *
 * A row's codes widen to float32 in registers (one fused multiply-add makes the weight) and
 * multiply float32 activations: at a few rows the step reads each weight byte once, which is
 * what bounds it. Rows of w are split among OpenMP threads (torch's runtime, shared).
 * Built by kvflow/model/quant_kernels.py like cpu_kernels.c (-march=native, GCC vectors: AVX-512
 * where the CPU has it, AVX2 halves elsewhere).
 */
#include <omp.h>
#ifdef __x86_64__
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
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

/* y[M, N] (row stride N) = xf[M, K] (float32) @ w^T + bias: y and bias bf16 (f32 == 0) or
 * float32 (f32 == 1; bias may be NULL either way). */
static void q_linear(const float *xf, const uint8_t *codes, const float *scales, const float *mins,
                     int bits, int group, const void *bias, void *y, int f32, int M, int N,
                     int K) {
    long row_bytes = bits == 4 ? K / 2 : K;
    int groups = K / group;
    int nr = M == 1 ? 4 : M == 2 ? 2 : 1; /* weight rows a tile */
    int tiles = (N + nr - 1) / nr;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < tiles; t++) {
        int n0 = t * nr, rows = N - n0 < nr ? N - n0 : nr;
        int r_n = rows == nr ? nr : 1; /* a last partial tile: its rows one by one */
        float out[4 * MAX_ROWS];
        for (int m0 = 0; m0 < M; m0 += MAX_ROWS) {
            int mb = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
            for (int r0 = 0; r0 < rows; r0 += r_n) {
                long n = n0 + r0;
                tile(codes + n * row_bytes, row_bytes, bits, scales + n * groups, mins + n * groups,
                     groups, group, xf + (long)m0 * K, K, K, r_n, mb, out);
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
        }
    }
}

/* y[M, N] (bf16, row stride N) = x[M, K] (bf16) @ w^T + bias (bf16 or NULL). */
void kvflow_q_linear(const uint16_t *x, const uint8_t *codes, const float *scales,
                     const float *mins, int bits, int group, const uint16_t *bias, uint16_t *y,
                     int M, int N, int K) {
    float *xf = (float *)aligned_alloc(64, ((size_t)M * K * sizeof(float) + 63) / 64 * 64);
    if (xf == NULL) return;
    for (long i = 0; i < (long)M * K; i++) xf[i] = bf16_to_float(x[i]);
    q_linear(xf, codes, scales, mins, bits, group, bias, y, 0, M, N, K);
    free(xf);
}

/* The same in float32: x, bias (or NULL) and y float32. */
void kvflow_q_linear_f32(const float *x, const uint8_t *codes, const float *scales,
                         const float *mins, int bits, int group, const float *bias, float *y,
                         int M, int N, int K) {
    q_linear(x, codes, scales, mins, bits, group, bias, y, 1, M, N, K);
}

/* w[N, K] as bf16 (f32 == 0: rounded to nearest even; exact for codes and scales that fit
 * bf16) or float32 (f32 == 1). */
void kvflow_q_dequant(const uint8_t *codes, const float *scales, const float *mins, int bits,
                      int group, void *w, int f32, int N, int K) {
    long row_bytes = bits == 4 ? K / 2 : K;
    int groups = K / group;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *row = codes + n * row_bytes;
        const float *sc = scales + (long)n * groups, *mn = mins + (long)n * groups;
        for (int c = 0; c < K; c += 32) {
            v16f lo, hi;
            codes32(row, bits, c, &lo, &hi);
            int g0 = c / group, g1 = (c + 16) / group;
            v16f w0 = lo * sc[g0] + mn[g0];
            v16f w1 = hi * sc[g1] + mn[g1];
            long at = (long)n * K + c;
            if (f32) {
                memcpy((float *)w + at, &w0, sizeof w0);
                memcpy((float *)w + at + 16, &w1, sizeof w1);
                continue;
            }
            for (int i = 0; i < 16; i++) {
                ((uint16_t *)w)[at + i] = float_to_bf16(w0[i]);
                ((uint16_t *)w)[at + 16 + i] = float_to_bf16(w1[i]);
            }
        }
    }
}
