/* kvflow's native CPU kernels, first for the decode steps of small batches, where a step is bound
 * by reading memory (weights, then K/V) once:
 *
 *   kvflow_bf16_linear      y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), bf16 in and out
 *                           (kvflow_bf16_linear_f32: float32 out, for the logits head)
 *   kvflow_paged_attention  any step's tokens (prompts, chunks, decodes) over a paged KV cache;
 *                           prompts on AMX-BF16 tiles where the CPU has them
 *
 * then the small fused ops of a layer (RMSNorm, rotary, SiLU-and-mul) and the greedy argmax of
 * float32 logits. The two above accumulate in float32. bf16 -> float32 is exact (a 16-bit
 * shift); results are rounded to nearest even. Built at run time by kvflow/kernels/cpu/build.py
 * with the system C compiler (-march=native: AVX-512 where the CPU has it, through GCC's vector
 * extensions; the linear kernel's AVX2 intrinsics where it has AVX2 alone) and loaded with ctypes; it links the OpenMP runtime torch already loaded, so both
 * share one thread pool.
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

static inline v16f load_bf16(const uint16_t *p) {
#ifdef __AVX512F__ /* one widening load; GCC splits the generic conversion in halves */
    return (v16f)_mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#else
    v16h h;
    memcpy(&h, p, sizeof h);
    v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

static inline v16f vload(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 16 floats rounded to bf16 (nearest even) and stored. */
static inline void store_bf16(uint16_t *p, v16f f) {
    v16u u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    v16h h = __builtin_convertvector(u >> 16, v16h);
    memcpy(p, &h, sizeof h);
}

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

typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

static inline float hsum(v16f v) {  /* a tree: 4 adds instead of a chain of 15 */
    v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* Linear layer, y[M, N] = x[M, K] @ w[N, K]^T (+ bias), on a weight packed once at load time
 * (kvflow/kernels/cpu/linear.py `pack_linear_weight`) as [N / NB][K / 2][NB][2]: for each tile of
 * NB = 32 output columns, one contiguous run over k in pairs. A tile's MT (<= 8) rows of x keep
 * MT x 2 vectors of 16 float32 accumulators (one per output column) in registers; each k pair
 * loads 2 vectors of weights and broadcasts one (x[m, k], x[m, k + 1]) pair per row, so the
 * weights stream from memory exactly once per call for up to 8 rows (more rows re-read the tile,
 * which stays in L2) and no horizontal sums are needed. Threads split the column tiles.
 *
 * With AVX512_BF16 one instruction does 32 multiply-adds of bf16 pairs into float32 (what oneDNN
 * uses on such CPUs); elsewhere a 32-bit lane holding a pair widens to two floats with a shift
 * and a mask. With AVX2 alone that is written in 256-bit halves and a tile takes MT = 4 rows
 * (16 accumulator registers): GCC's 512-bit vector extensions there kept 8 rows' accumulators
 * on the stack, which made the kernel compute-bound at any row count (a [1536, 576] weight on
 * 2 Zen cores: 0.47 ms for one row, torch's bf16 0.14, now 0.058; 128 rows 47 ms, torch 15,
 * now 2.7). N is padded to a multiple of NB in the packed weight; K must be even. */
#define NB 32

#ifdef __AVX512BF16__
#define MT 8
typedef __m512 acc_t;
static inline acc_t acc_zero(void) { return _mm512_setzero_ps(); }
static inline acc_t pair_fma(acc_t acc, uint32_t xpair, const uint16_t *w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)xpair),
                            (__m512bh)_mm512_loadu_si512(w));
}
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define MT 4
typedef struct {
    __m256 lo, hi; /* columns 0-7 and 8-15 of the 16, in order (read back with memcpy) */
} acc_t;
static inline acc_t acc_zero(void) { return (acc_t){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline __m256 pair_half(__m256 acc, __m256 x0, __m256 x1, const uint16_t *w) {
    __m256i u = _mm256_loadu_si256((const __m256i *)w);
    __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
    __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
    return _mm256_fmadd_ps(x1, odd, _mm256_fmadd_ps(x0, even, acc));
}
static inline acc_t pair_fma(acc_t acc, uint32_t xpair, const uint16_t *w) {
    __m256 x0 = _mm256_set1_ps(bf16_to_float((uint16_t)xpair));
    __m256 x1 = _mm256_set1_ps(bf16_to_float((uint16_t)(xpair >> 16)));
    return (acc_t){pair_half(acc.lo, x0, x1, w), pair_half(acc.hi, x0, x1, w + 16)};
}
#else
#define MT 8
typedef v16f acc_t;
static inline acc_t acc_zero(void) { return (v16f){0}; }
static inline acc_t pair_fma(acc_t acc, uint32_t xpair, const uint16_t *w) {
    v16u u;
    memcpy(&u, w, sizeof u);
    v16u lo = u << 16, hi = u & 0xffff0000u;
    v16f wlo, whi;
    memcpy(&wlo, &lo, sizeof wlo);
    memcpy(&whi, &hi, sizeof whi);
    return acc + bf16_to_float((uint16_t)xpair) * wlo + bf16_to_float((uint16_t)(xpair >> 16)) * whi;
}
#endif

/* Rows m0 .. m0 + rows - 1 of x against column tile `t` (rows <= MT, a constant per call). */
static inline __attribute__((always_inline)) void linear_tile(
    const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y, float *yf, int N,
    int K, int t, int m0, const int rows) {
    acc_t acc[MT][2];
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = acc_zero();
    const uint16_t *w = wp + (size_t)t * K * NB;
    for (int kp = 0; kp < K / 2; kp++, w += 2 * NB) {
        for (int m = 0; m < rows; m++) {
            uint32_t xpair;
            memcpy(&xpair, x + (size_t)(m0 + m) * K + 2 * kp, sizeof xpair);
            acc[m][0] = pair_fma(acc[m][0], xpair, w);
            acc[m][1] = pair_fma(acc[m][1], xpair, w + NB);
        }
    }
    int n0 = t * NB, cols = N - n0 < NB ? N - n0 : NB;
    for (int m = 0; m < rows; m++) {
        float out[NB];
        memcpy(out, &acc[m][0], sizeof(float) * 16);
        memcpy(out + 16, &acc[m][1], sizeof(float) * 16);
        size_t at = (size_t)(m0 + m) * N + n0;
        for (int c = 0; c < cols; c++) {
            float v = out[c] + (bias ? bf16_to_float(bias[n0 + c]) : 0.0f);
            if (yf) yf[at + c] = v;
            else y[at + c] = float_to_bf16(v);
        }
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* AMX: one tile instruction multiplies x rows [M <= 16, 32 k] by a weight tile [16 k pairs,
 * 16 columns, 2] into 16 x 16 float32 accumulators; the packed layout above is exactly two such
 * weight tiles side by side per 16 k pairs (rows 128 bytes apart). Linux hands out the tile
 * state only on request (arch_prctl), so `kvflow_amx_init` asks once; without it the AVX-512
 * path runs. */
#include <sys/syscall.h>
#include <unistd.h>

static int amx_ok = 0;

int kvflow_amx_init(void) {
    amx_ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return amx_ok;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static void tile_rows_out(float out[][NB], int rows, const uint16_t *bias, uint16_t *y, int N,
                          int n0, int cols) {
    if (cols == NB) {  /* the common case: whole tiles, 16 columns per vector */
        v16f b0 = {0}, b1 = {0};
        if (bias) b0 = load_bf16(bias + n0), b1 = load_bf16(bias + n0 + 16);
        for (int m = 0; m < rows; m++) {
            store_bf16(y + (size_t)m * N + n0, vload(out[m]) + b0);
            store_bf16(y + (size_t)m * N + n0 + 16, vload(out[m] + 16) + b1);
        }
        return;
    }
    for (int m = 0; m < rows; m++)
        for (int c = 0; c < cols; c++)
            y[(size_t)m * N + n0 + c] =
                float_to_bf16(out[m][c] + (bias ? bf16_to_float(bias[n0 + c]) : 0.0f));
}

/* M <= 16: tiles 0, 1 accumulate the two 16-column halves of a column tile, tile 2 holds the
 * M rows of x, tiles 3, 4 the two weight halves. */
static void linear_amx_small(const uint16_t *x, const uint16_t *wp, const uint16_t *bias,
                             uint16_t *y, int M, int N, int K) {
    int tiles = (N + NB - 1) / NB;
#pragma omp parallel
    {
        struct tile_config cfg = {.palette = 1};
        for (int i = 0; i < 3; i++) cfg.rows[i] = (uint8_t)M, cfg.colsb[i] = 64;
        for (int i = 3; i < 5; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
        _tile_loadconfig(&cfg);
        float out[16][NB];
#pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            const uint16_t *w = wp + (size_t)t * K * NB;
            _tile_zero(0);
            _tile_zero(1);
            for (int k = 0; k < K; k += 32, w += 32 * NB) {
                _tile_loadd(2, x + k, K * 2);
                _tile_loadd(3, w, NB * 4);
                _tile_loadd(4, w + 32, NB * 4);
                _tile_dpbf16ps(0, 2, 3);
                _tile_dpbf16ps(1, 2, 4);
            }
            _tile_stored(0, out, NB * 4);
            _tile_stored(1, &out[0][16], NB * 4);
            int n0 = t * NB;
            tile_rows_out(out, M, bias, y, N, n0, N - n0 < NB ? N - n0 : NB);
        }
        _tile_release();
    }
}

/* M > 16: x is copied into zero-padded chunks of 32 rows (two row tiles, 6 and 7); tiles 0-3
 * accumulate 2 row halves x 2 column halves of a 32 x 32 output block, tiles 4, 5 hold the
 * weight halves. */
static void linear_amx_large(const uint16_t *x, const uint16_t *wp, const uint16_t *bias,
                             uint16_t *y, int M, int N, int K) {
    int chunks = (M + 31) / 32, tiles = (N + NB - 1) / NB;
    /* Groups of up to 16 column tiles (<= 16 * 32 * K * 2 bytes of weights: L2-sized) split
     * between threads; a thread streams every 32-row chunk of x past its group's weights, so
     * weights come from memory once and x once per group (not once per column tile). */
    int group = (tiles + 2 * omp_get_max_threads() - 1) / (2 * omp_get_max_threads());
    group = group < 1 ? 1 : group > 16 ? 16 : group;
    int groups = (tiles + group - 1) / group;
    uint16_t *xp = calloc((size_t)chunks * 32 * K, sizeof(uint16_t));
    memcpy(xp, x, sizeof(uint16_t) * (size_t)M * K);
#pragma omp parallel
    {
        struct tile_config cfg = {.palette = 1};
        for (int i = 0; i < 8; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
        _tile_loadconfig(&cfg);
        float out[32][NB];
#pragma omp for schedule(dynamic, 1)
        for (int g = 0; g < groups; g++)
        for (int c = 0; c < chunks; c++)
        for (int t = g * group; t < tiles && t < (g + 1) * group; t++) {
            int n0 = t * NB, cols = N - n0 < NB ? N - n0 : NB;
            {
                const uint16_t *w = wp + (size_t)t * K * NB, *xc = xp + (size_t)c * 32 * K;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int k = 0; k < K; k += 32, w += 32 * NB) {
                    _tile_loadd(4, w, NB * 4);
                    _tile_loadd(5, w + 32, NB * 4);
                    _tile_loadd(6, xc + k, K * 2);
                    _tile_loadd(7, xc + (size_t)16 * K + k, K * 2);
                    _tile_dpbf16ps(0, 6, 4);
                    _tile_dpbf16ps(1, 6, 5);
                    _tile_dpbf16ps(2, 7, 4);
                    _tile_dpbf16ps(3, 7, 5);
                }
                _tile_stored(0, out, NB * 4);
                _tile_stored(1, &out[0][16], NB * 4);
                _tile_stored(2, out[16], NB * 4);
                _tile_stored(3, &out[16][16], NB * 4);
                int rows = M - c * 32 < 32 ? M - c * 32 : 32;
                tile_rows_out(out, rows, bias, y + (size_t)c * 32 * N, N, n0, cols);
            }
        }
        _tile_release();
    }
    free(xp);
}
#else
int kvflow_amx_init(void) { return 0; }
#endif

/* The vector path's column tiles split between threads; the result goes to y (bf16) or, where
 * yf is given, to yf (float32, unrounded). */
static void linear_tiles(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y,
                         float *yf, int M, int N, int K) {
    int tiles = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < tiles; t++) {
        for (int m0 = 0; m0 < M; m0 += MT) {
            switch (M - m0 < MT ? M - m0 : MT) {  /* constant row counts: fully unrolled */
                case 8: linear_tile(x, wp, bias, y, yf, N, K, t, m0, 8); break;
                case 7: linear_tile(x, wp, bias, y, yf, N, K, t, m0, 7); break;
                case 6: linear_tile(x, wp, bias, y, yf, N, K, t, m0, 6); break;
                case 5: linear_tile(x, wp, bias, y, yf, N, K, t, m0, 5); break;
                case 4: linear_tile(x, wp, bias, y, yf, N, K, t, m0, 4); break;
                case 3: linear_tile(x, wp, bias, y, yf, N, K, t, m0, 3); break;
                case 2: linear_tile(x, wp, bias, y, yf, N, K, t, m0, 2); break;
                default: linear_tile(x, wp, bias, y, yf, N, K, t, m0, 1); break;
            }
        }
    }
}

void kvflow_bf16_linear(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y,
                        int M, int N, int K) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx_ok && K % 32 == 0) {
        (M <= 16 ? linear_amx_small : linear_amx_large)(x, wp, bias, y, M, N, K);
        return;
    }
#endif
    linear_tiles(x, wp, bias, y, NULL, M, N, K);
}

/* kvflow_bf16_linear with float32 results, the accumulators unrounded: what the logits head
 * takes, so that two logits within a bf16 step of each other keep their order (rounded, they
 * are level and the argmax takes the lower token id). The vector path on every CPU. */
void kvflow_bf16_linear_f32(const uint16_t *x, const uint16_t *wp, const uint16_t *bias,
                            float *y, int M, int N, int K) {
    linear_tiles(x, wp, bias, NULL, y, M, N, K);
}

static inline v16f vselect(v16i mask, v16f a, v16f b) { /* a where mask (all bits), else b */
    return (v16f)(((v16i)a & mask) | ((v16i)b & ~mask));
}

static inline __attribute__((always_inline)) v16f fold2(v16f x, v16f y, int max) {
    return max ? vselect(x > y, x, y) : x + y;
}

/* Lane i of the result = the sum (max: the largest) of a[i]'s 16 lanes: a transposing tree of
 * 15 shuffle-folds in place of 16 separate horizontal ones. */
static inline __attribute__((always_inline)) v16f fold16(const v16f a[16], int max) {
    v16f t[8], u[4], w[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7 fold a[i], 8-15 fold a[i + 8] */
        t[i] = fold2(__builtin_shufflevector(a[i], a[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                             19, 20, 21, 22, 23),
                     __builtin_shufflevector(a[i], a[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                             26, 27, 28, 29, 30, 31),
                     max);
    for (int i = 0; i < 4; i++) /* groups of 4 lanes: a[i], a[i + 4], a[i + 8], a[i + 12] */
        u[i] = fold2(__builtin_shufflevector(t[i], t[i + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10,
                                             11, 24, 25, 26, 27),
                     __builtin_shufflevector(t[i], t[i + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13,
                                             14, 15, 28, 29, 30, 31),
                     max);
    for (int i = 0; i < 2; i++) /* pairs of lanes: a[i], a[i + 2], ..., a[i + 14] */
        w[i] = fold2(__builtin_shufflevector(u[i], u[i + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24,
                                             25, 12, 13, 28, 29),
                     __builtin_shufflevector(u[i], u[i + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26,
                                             27, 14, 15, 30, 31),
                     max);
    return fold2(__builtin_shufflevector(w[0], w[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12,
                                         28, 14, 30),
                 __builtin_shufflevector(w[0], w[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13,
                                         29, 15, 31),
                 max);
}

/* In place: row[j] = e^(row[j] - max) for j < n; returns their sum, *max_out the max. */
static inline float exp_from_max(float *row, int n, float *max_out) {
    float mx = row[0], sum = 0.0f;
    int j = 0;
    if (n >= 16) { /* lane-wise maxima first: a scalar chain waits on each compare */
        v16f vmx = vload(row);
        for (j = 16; j + 16 <= n; j += 16) {
            v16f x = vload(row + j);
            v16i more = x > vmx;
            vmx = (v16f)(((v16i)x & more) | ((v16i)vmx & ~more));
        }
        for (int i = 0; i < 16; i++) mx = vmx[i] > mx ? vmx[i] : mx;
    }
    for (; j < n; j++) mx = row[j] > mx ? row[j] : mx;
    j = 0;
    v16f vsum = {0};
    for (; j + 16 <= n; j += 16) {
        v16f e = vexp(vload(row + j) - mx);
        memcpy(row + j, &e, sizeof e);
        vsum += e;
    }
    for (; j < n; j++) {
        row[j] = __builtin_expf(row[j] - mx);
        sum += row[j];
    }
    *max_out = mx;
    return sum + hsum(vsum);
}

/* In place: row[j] = e^(row[j] - max) / sum over j < n. */
static inline void softmax(float *row, int n) {
    float mx, inv = 1.0f / exp_from_max(row, n, &mx);
    for (int j = 0; j < n; j++) row[j] *= inv;
}

/* acc + the lane-wise products of a[0..32) and b[0..32) (bf16), summed by pairs: exact
 * products, float32 sums (AVX512_BF16: one instruction). */
static inline v16f pairs_dot(v16f acc, const uint16_t *a, const uint16_t *b) {
#ifdef __AVX512BF16__
    return (v16f)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_loadu_si512(a),
                                  (__m512bh)_mm512_loadu_si512(b));
#else
    return acc + load_bf16(a) * load_bf16(b) + load_bf16(a + 16) * load_bf16(b + 16);
#endif
}

/* The cache lines of row j (D bf16 at base + slots[j] * stride) of a pass over n rows: past
 * the pass's end, row j - n of the pass that follows it (at `next`, the same slots; none when
 * NULL). A decode pass prefetches the rows 32 ahead of it; without the next pass's first rows
 * each of a token's passes (K, then V, per KV head) would begin on a wait for memory. */
static inline __attribute__((always_inline)) void prefetch_row(
    const uint16_t *base, const uint16_t *next, const size_t *slots, size_t stride, int j, int n,
    int D) {
    const uint16_t *row = NULL;
    if (j < n) row = base + slots[j] * stride;
    else if (next && j - n < n) row = next + slots[j - n] * stride;
    if (row)
        for (int d = 0; d < D; d += 32) __builtin_prefetch(row + d);
}

/* scores[g * row_len + j] = scale * (q_g . key j) for the G query rows q_g at q + g * D and
 * the keys at base + slots[j] * stride (bf16), j < n: sixteen keys at a time, each in its own
 * accumulator, the G rows in turn while those keys stay in L1; past n a zero row stands in
 * (a row has room up to n rounded up to 16). The products are of the bf16 values as they
 * are (exact), as the prompt tiles take them, and the scale comes after the sum. `next`: the
 * rows read next (`prefetch_row`). */
static void group_scores(const uint16_t *q, int G, int D, const uint16_t *base,
                         const size_t *slots, size_t stride, int n, float scale, float *scores,
                         size_t row_len, const uint16_t *next) {
    static const uint16_t zero[256];
    for (int j0 = 0; j0 < n; j0 += 16) {
        const uint16_t *key[16];
        for (int i = 0; i < 16; i++) key[i] = j0 + i < n ? base + slots[j0 + i] * stride : zero;
        for (int i = j0 + 32; i < j0 + 48; i++) /* the keys two groups ahead */
            prefetch_row(base, next, slots, stride, i, n, D);
        for (int g = 0; g < G; g++) {
            const uint16_t *qg = q + (size_t)g * D;
            v16f acc[16] = {0};
            int d = 0;
            for (; d + 32 <= D; d += 32)
                for (int i = 0; i < 16; i++) acc[i] = pairs_dot(acc[i], qg + d, key[i] + d);
            if (d < D) /* 16 dims left */
                for (int i = 0; i < 16; i++) acc[i] += load_bf16(qg + d) * load_bf16(key[i] + d);
            v16f s = fold16(acc, 0) * scale;
            memcpy(scores + (size_t)g * row_len + j0, &s, sizeof s);
        }
    }
}

/* out[r * D + off ..) for r < rows (16 nv dims) = sum over j < n of p_r[j] * value j (bf16 rows
 * at base + slots[j] * stride), p_r at scores + r * row_len: each value row is widened once for
 * all the rows; rows <= 4 and nv <= 4 keep every accumulator in a register. With outf, the sums
 * go there as float32 instead (row r at outf + r * ldf). `next`: the rows read after these
 * (`prefetch_row`; whole rows of D, past n only). */
static inline __attribute__((always_inline)) void group_values(
    const float *scores, size_t row_len, const uint16_t *base, const size_t *slots,
    size_t stride, int n, int off, const int nv, const int rows, int D, uint16_t *out,
    float *outf, int ldf, const uint16_t *next) {
    v16f acc[4][4] = {{{0}}};
    for (int j = 0; j < n; j++) {
        const uint16_t *row = base + slots[j] * stride + off;
        if (j + 32 < n) /* each 64-byte line of the row 32 ahead */
            for (int c = 0; c < nv; c += 2)
                __builtin_prefetch(base + slots[j + 32] * stride + off + 16 * c);
        else
            prefetch_row(base, next, slots, stride, j + 32, n, D);
        v16f v[4];
        for (int c = 0; c < nv; c++) v[c] = load_bf16(row + 16 * c);
        for (int r = 0; r < rows; r++) {
            float p = scores[(size_t)r * row_len + j];
            for (int c = 0; c < nv; c++) acc[r][c] += p * v[c];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < nv; c++)
            if (outf) memcpy(outf + (size_t)r * ldf + off + 16 * c, &acc[r][c], sizeof acc[r][c]);
            else store_bf16(out + (size_t)r * D + off + 16 * c, acc[r][c]);
}

#define GROUP_VALUES(NV, ROWS)                                                                 \
    group_values(scores + (size_t)r0 * row_len, row_len, vbase, slots, stride, n, off, NV,     \
                 ROWS, D, og ? og + (size_t)r0 * D : NULL,                                   \
                 part ? part + (size_t)r0 * (D + 2) : NULL, D + 2, r0 + 4 >= G ? next : NULL)

/* The slots of positions start .. start + n - 1 of a request (its block table), in order. */
static void fill_slots(const int32_t *table, int block_size, int start, int n, size_t *slots) {
    for (int j = 0, blk = start / block_size, off = start % block_size; j < n; j++) {
        slots[j] = (size_t)table[blk] * block_size + off;
        if (++off == block_size) blk++, off = 0;
    }
}

/* One decode token's G query heads of KV head h (q rows at qb, out rows at ob, Hq heads of D
 * each) over the n keys at `slots`: the G rows share every load of K (`group_scores`) and V
 * (`group_values`, 4 rows at a time), with a float32 softmax per row between; `scores` holds
 * G rows of row_len. With `part` (a share of a longer context's keys, `combine_parts`), row g's
 * unnormalised sums go to part[g * (D + 2) ..), then its max score and its sum of weights.
 * `next`: the keys of the head that follows (same slots), prefetched as the values end. */
static void decode_group(const uint16_t *qb, int G, int h, int D, size_t stride,
                         const uint16_t *kc, const uint16_t *vc, const size_t *slots, int n,
                         float scale, float *scores, size_t row_len, uint16_t *ob, float *part,
                         const uint16_t *next) {
    group_scores(qb + (size_t)h * G * D, G, D, kc + (size_t)h * D, slots, stride, n, scale,
                 scores, row_len, vc + (size_t)h * D);
    for (int g = 0; g < G; g++)
        if (part) {
            float *tail = part + (size_t)g * (D + 2) + D;
            tail[1] = exp_from_max(scores + (size_t)g * row_len, n, &tail[0]);
        } else {
            softmax(scores + (size_t)g * row_len, n);
        }
    const uint16_t *vbase = vc + (size_t)h * D;
    uint16_t *og = ob ? ob + (size_t)h * G * D : NULL;
    for (int r0 = 0; r0 < G; r0 += 4) {
        int rows = G - r0 < 4 ? G - r0 : 4, off = 0;
        for (; off + 64 <= D; off += 64) switch (rows) {
            case 1: GROUP_VALUES(4, 1); break;
            case 2: GROUP_VALUES(4, 2); break;
            case 3: GROUP_VALUES(4, 3); break;
            default: GROUP_VALUES(4, 4); break;
            }
        for (; off < D; off += 16) switch (rows) {
            case 1: GROUP_VALUES(1, 1); break;
            case 2: GROUP_VALUES(1, 2); break;
            case 3: GROUP_VALUES(1, 3); break;
            default: GROUP_VALUES(1, 4); break;
            }
    }
}

/* Query tokens per prefill work item: QT x G query rows share each 16-key chunk of K/V. */
#define QT 16
#define RB 8 /* query rows per block of score accumulators */
#define KCH 32 /* AMX prompt tiles: keys a packed chunk (below) */

/* Packed chunks of a prompt's keys from kbase (a multiple of KCH) to its last, per KV head. */
static inline long key_chunks(int seq_len, int kbase) { return (seq_len - kbase + KCH - 1) / KCH; }

typedef struct { /* one thread's scratch for prefill tiles */
    uint32_t *kp;  /* a 16-key chunk of K as [D / 2][16] bf16 pairs: the linear kernel's layout */
    float *vf;     /* the chunk of V widened to float32, [16][D] (zeros past the last key) */
    float *o, *p;  /* per query row: the unnormalised output [D] and the chunk's weights [16] */
    float *mx, *sum;
    const uint16_t **qrow; /* each query row's q, then RB copies of the first (padding) */
} tile_scratch;

/* x where `visible` is set (all bits), -inf elsewhere: such a key gets weight 0. */
static inline v16f visible_or_ninf(v16f x, v16i visible) {
    return vselect(visible, x, (v16f){0} - __builtin_inff());
}

/* Causal attention of m <= QT consecutive tokens of one request (positions pos0 .. pos0 + m - 1,
 * rows t0 .. of q) for KV head h, over keys kstart .. pos0 + m - 1 at `slots` (slots[0] is
 * position kstart): flash-attention style, 16 keys at a time with a running max and sum per
 * query row. Scores come from bf16 pairs (exact products, float32 sums), the weights and V sum
 * stay float32; a key past a row's position, or outside its window, gets weight 0. */
static void prefill_tile(const uint16_t *q, int q_stride, int t0, int m, int pos0, int h, int G,
                         int D, size_t stride, const uint16_t *kc, const uint16_t *vc,
                         const size_t *slots, int kstart, int window, float scale,
                         tile_scratch *s, uint16_t *out, int Hq) {
    int R = m * G, kend = pos0 + m, DV = D / 16;
    const uint16_t **qrow = s->qrow;
    for (int r = 0; r < R; r++)
        qrow[r] = q + (size_t)(t0 + r / G) * q_stride + (size_t)(h * G + r % G) * D;
    for (int r = R; r < R + RB; r++) qrow[r] = qrow[0]; /* padding rows of the last block */
    for (int r = 0; r < R; r++) s->mx[r] = -__builtin_inff(), s->sum[r] = 0.0f;
    memset(s->o, 0, sizeof(float) * (size_t)R * D);
    v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int j0 = kstart; j0 < kend; j0 += 16) {
        int n = kend - j0 < 16 ? kend - j0 : 16;
        const size_t *cs = slots + (j0 - kstart);
        for (int i = 0; i < 16; i++) {
            const uint16_t *key = kc + cs[i < n ? i : 0] * stride + (size_t)h * D;
            const uint16_t *val = vc + cs[i < n ? i : 0] * stride + (size_t)h * D;
            for (int dp = 0; dp < D / 2; dp++) {
                uint32_t pair;
                memcpy(&pair, key + 2 * dp, sizeof pair);
                s->kp[dp * 16 + i] = i < n ? pair : 0;
            }
            for (int c = 0; c < DV; c++) {
                v16f x = i < n ? load_bf16(val + 16 * c) : (v16f){0};
                memcpy(s->vf + (size_t)i * D + 16 * c, &x, sizeof x);
            }
        }
        for (int r0 = 0; r0 < R; r0 += RB) { /* scores: RB rows share each loaded pair of K */
            acc_t acc[RB];
            for (int i = 0; i < RB; i++) acc[i] = acc_zero();
            for (int dp = 0; dp < D / 2; dp++) {
                for (int i = 0; i < RB; i++) {
                    uint32_t qp;
                    memcpy(&qp, qrow[r0 + i] + 2 * dp, sizeof qp);
                    acc[i] = pair_fma(acc[i], qp, (const uint16_t *)(s->kp + dp * 16));
                }
            }
            for (int i = 0; i < RB && r0 + i < R; i++)
                memcpy(s->p + (size_t)(r0 + i) * 16, &acc[i], 64);
        }
        for (int r = 0; r < R; r++) {
            int pos = pos0 + r / G; /* keys past it (past the chunk's last key too) are hidden */
            v16i key = lane + j0, visible = key <= pos;
            if (window > 0) visible &= key > pos - window;
            v16f sc = visible_or_ninf(vload(s->p + (size_t)r * 16) * scale, visible);
            float cmax = -__builtin_inff();
            for (int i = 0; i < 16; i++) cmax = sc[i] > cmax ? sc[i] : cmax;
            if (cmax == -__builtin_inff()) continue; /* no key of this chunk is visible */
            float *orow = s->o + (size_t)r * D;
            float mnew = cmax > s->mx[r] ? cmax : s->mx[r];
            float alpha = __builtin_expf(s->mx[r] - mnew);
            v16f w = vexp(sc - mnew);
            s->mx[r] = mnew;
            s->sum[r] = s->sum[r] * alpha + hsum(w);
            float wj[16];
            memcpy(wj, &w, sizeof wj);
            for (int c = 0; c < DV; c++) {
                v16f acc = vload(orow + 16 * c) * alpha;
                for (int i = 0; i < n; i++) acc += wj[i] * vload(s->vf + (size_t)i * D + 16 * c);
                memcpy(orow + 16 * c, &acc, sizeof acc);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        uint16_t *ob = out + ((size_t)(t0 + r / G) * Hq + h * G + r % G) * D;
        float inv = 1.0f / s->sum[r];
        for (int c = 0; c < DV; c++)
            store_bf16(ob + 16 * c, vload(s->o + (size_t)r * D + 16 * c) * inv);
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* Prompt attention on AMX-BF16 tiles (where `kvflow_amx_init` got the tile state and D is a
 * multiple of 32): `prefill_tile`'s result to rounding. The tiles multiply bf16 values, so the
 * weights P go in as two bf16 parts, hi = bf16(p) and lo = bf16(p - hi) (16 bits of p between
 * them: rounding P once to bf16 doubled the error against float64 and moved the quantized
 * model's perplexity; benchmarks/RESULTS.md).
 *
 * Each prompt's K/V (each KV head, keys from the first any of its rows sees) is first packed
 * once a step in chunks of 32 keys, 32 x D bf16 each, the layouts the tile products read:
 *   K: [D / 32][2 halves of 16 keys][16 dim pairs][16 keys][2]  (S = Q K^T, B operand)
 *   V: [D / 16][16 key pairs][16 dims][2]                       (O += P V, B operand)
 * then a work item is 16 query rows (row r: token r / G, query head h * G + r % G) of one KV
 * head. Per chunk of 32 keys: S on tiles 0, 1 (Q in tile 6, the K halves in 7); the online
 * softmax in vectors, 16 rows at once (`chunk_softmax`); P's parts into tiles 6 and 0 and P V
 * into the output on tiles 2-5 (16 dims each, V in tile 7). With D <= 64 the output stays in
 * its tiles from the first chunk to the last; a larger D goes through memory, 64 dims at a time.
 */
#define TAU 8.0f /* a row's reference for its weights, when it moves, is this above the max */

typedef struct { /* one thread's scratch for tile items */
    uint16_t *q; /* [16][D] the block's query rows (zeros past the last) */
    float *s;    /* [16][KCH] the chunk's scores */
    uint16_t *p; /* [32][KCH] the chunk's weights: rows 0-15 their hi parts, 16-31 lo */
    float *o;    /* [16][D] the output (when its tiles are rescaled, or D > 64) */
} amx_scratch;

/* Chunk c (keys key0 ..) of KV head h of a prompt into its packed K and V (32 * D each); keys
 * at or past `end` are zeros. */
static void pack_chunk(const uint16_t *kc, const uint16_t *vc, size_t stride, int h, int D,
                       const int32_t *table, int block_size, int key0, int end, uint16_t *kp,
                       uint16_t *vp) {
    static const uint16_t zero[256];
    const uint16_t *key[KCH], *val[KCH];
    for (int i = 0; i < KCH; i++) {
        int j = key0 + i;
        size_t slot = j < end ? (size_t)table[j / block_size] * block_size + j % block_size : 0;
        key[i] = j < end ? kc + slot * stride + (size_t)h * D : zero;
        val[i] = j < end ? vc + slot * stride + (size_t)h * D : zero;
    }
    uint32_t *kp32 = (uint32_t *)kp;
    for (int i = 0; i < KCH; i++)
        for (int dc = 0; dc < D / 32; dc++)
            for (int p = 0; p < 16; p++)
                memcpy(kp32 + ((dc * 2 + i / 16) * 16 + p) * 16 + i % 16,
                       key[i] + 32 * dc + 2 * p, sizeof(uint32_t));
    for (int i = 0; i < KCH; i += 2) /* keys i, i + 1 side by side in each 32-bit lane */
        for (int g = 0; g < D / 16; g++) {
            v16h lo, hi;
            memcpy(&lo, val[i] + 16 * g, sizeof lo);
            memcpy(&hi, val[i + 1] + 16 * g, sizeof hi);
            v16u pair = __builtin_convertvector(lo, v16u);
            pair |= __builtin_convertvector(hi, v16u) << 16;
            memcpy(vp + ((size_t)(g * 16 + i / 2) * 16) * 2, &pair, sizeof pair);
        }
}

/* The chunk's scores (s->s, 16 rows of KCH) -> weights e^(score - ref) (s->p, two bf16 parts),
 * updating each row's reference `ref` and sum of weights `sum` (lane = row). A row's reference
 * moves only when a score exceeds it, and then to TAU above that score, so most chunks leave the
 * output as it is (weights stay <= 1, sums float32); where it moves, alpha (lane = row) is the
 * factor for the output so far. Returns whether some row's output needs it. */
static inline int chunk_softmax(amx_scratch *s, const int pos[16], int j0, int window,
                                float scale, v16f *ref, v16f *sum, v16f *alpha) {
    const float ninf = -__builtin_inff();
    v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16f a[16], b[16], m[16];
    for (int i = 0; i < 16; i++) {
        a[i] = vload(s->s + i * KCH) * scale, b[i] = vload(s->s + i * KCH + 16) * scale;
        int p = pos[i];
        if (j0 + KCH - 1 > p || (window > 0 && j0 <= p - window)) {
            v16i ka = lane + j0, kb = ka + 16, va = ka <= p, vb = kb <= p;
            if (window > 0) va &= ka > p - window, vb &= kb > p - window;
            a[i] = visible_or_ninf(a[i], va);
            b[i] = visible_or_ninf(b[i], vb);
        }
        m[i] = fold2(a[i], b[i], 1);
    }
    v16f cmax = fold16(m, 1), old = *ref;
    v16i grow = cmax > old; /* never where the chunk hides every key from the row */
    v16f now = vselect(grow, cmax + TAU, old);
    v16f sub = vselect(now > ninf, now, (v16f){0}); /* no key seen yet: weights 0 */
    *alpha = vexp(vselect(grow, old - now, (v16f){0})); /* 0 from -inf: no output yet */
    for (int i = 0; i < 16; i++) {
        v16f ea = vexp(a[i] - sub[i]), eb = vexp(b[i] - sub[i]);
        uint16_t *hi = s->p + i * KCH, *lo = s->p + (16 + i) * KCH; /* P = hi + lo */
        store_bf16(hi, ea);
        store_bf16(hi + 16, eb);
        store_bf16(lo, ea - load_bf16(hi));
        store_bf16(lo + 16, eb - load_bf16(hi + 16));
        m[i] = ea + eb;
    }
    *sum = *sum * *alpha + fold16(m, 0);
    *ref = now;
    v16i rescale = grow & (old > ninf);
    for (int i = 0; i < 16; i++)
        if (rescale[i]) return 1;
    return 0;
}

static inline void scale_rows(float *o, int D, v16f alpha) {
    for (int i = 0; i < 16; i++)
        for (int c = 0; c < D; c += 16) {
            v16f x = vload(o + (size_t)i * D + c) * alpha[i];
            memcpy(o + (size_t)i * D + c, &x, sizeof x);
        }
}

/* Tiles 2 .. 1 + n (n <= 4, a constant where inlined) from or to o (rows D floats apart). */
static inline __attribute__((always_inline)) void load_out(const float *o, int D, int n) {
    _tile_loadd(2, o, D * 4);
    _tile_loadd(3, o + 16, D * 4);
    if (n > 2) {
        _tile_loadd(4, o + 32, D * 4);
        _tile_loadd(5, o + 48, D * 4);
    }
}
static inline __attribute__((always_inline)) void store_out(float *o, int D, int n) {
    _tile_stored(2, o, D * 4);
    _tile_stored(3, o + 16, D * 4);
    if (n > 2) {
        _tile_stored(4, o + 32, D * 4);
        _tile_stored(5, o + 48, D * 4);
    }
}

/* Tiles 2 .. 1 + n += P (its bf16 parts: tile 6 + tile 0) x the chunk's V dims 16 g ..
 * 16 (g + n) at vch. */
static inline __attribute__((always_inline)) void add_pv(const uint16_t *vch, int g, int n) {
    _tile_loadd(7, vch + (size_t)g * 512, 64);
    _tile_dpbf16ps(2, 6, 7);
    _tile_dpbf16ps(2, 0, 7);
    _tile_loadd(7, vch + (size_t)(g + 1) * 512, 64);
    _tile_dpbf16ps(3, 6, 7);
    _tile_dpbf16ps(3, 0, 7);
    if (n > 2) {
        _tile_loadd(7, vch + (size_t)(g + 2) * 512, 64);
        _tile_dpbf16ps(4, 6, 7);
        _tile_dpbf16ps(4, 0, 7);
        _tile_loadd(7, vch + (size_t)(g + 3) * 512, 64);
        _tile_dpbf16ps(5, 6, 7);
        _tile_dpbf16ps(5, 0, 7);
    }
}

/* Rows r0 .. r0 + rows - 1 (rows <= 16) of KV head h of a prompt whose token 0 is at position
 * pos0 and row t0 of q; keys from kbase in packed chunks at kp / vp. */
static void prefill_rows_amx(const uint16_t *q, int q_stride, int t0, int r0, int rows, int pos0,
                             int h, int G, int D, const uint16_t *kp, const uint16_t *vp,
                             int kbase, int window, float scale, amx_scratch *s, uint16_t *out,
                             int Hq) {
    int pos[16];
    memset(s->q, 0, sizeof(uint16_t) * 16 * (size_t)D);
    for (int i = 0; i < 16; i++) { /* padding rows: the last row's position, zero queries */
        int r = r0 + (i < rows ? i : rows - 1);
        pos[i] = pos0 + r / G;
        if (i < rows)
            memcpy(s->q + (size_t)i * D,
                   q + (size_t)(t0 + r / G) * q_stride + (size_t)(h * G + r % G) * D,
                   sizeof(uint16_t) * D);
    }
    v16f ref = (v16f){0} - __builtin_inff(), sum = {0}, alpha;
    int resident = D <= 64, n = D == 32 ? 2 : 4; /* output tiles: resident, or a group's */
    memset(s->o, 0, sizeof(float) * 16 * (size_t)D);
    if (resident) load_out(s->o, D, n);
    int first = window > 0 && pos[0] + 1 > window ? pos[0] + 1 - window : 0;
    int c0 = (first - kbase) / KCH, c1 = (pos[15] - kbase) / KCH; /* chunks any row sees */
    size_t chunk = (size_t)KCH * D;
    for (int c = c0; c <= c1; c++) {
        const uint16_t *kch = kp + c * chunk, *vch = vp + c * chunk;
        _tile_zero(0);
        _tile_zero(1);
        for (int dc = 0; dc < D / 32; dc++) {
            _tile_loadd(6, s->q + 32 * dc, D * 2);
            _tile_loadd(7, kch + (size_t)dc * 1024, 64);
            _tile_dpbf16ps(0, 6, 7);
            _tile_loadd(7, kch + (size_t)dc * 1024 + 512, 64);
            _tile_dpbf16ps(1, 6, 7);
        }
        _tile_stored(0, s->s, KCH * 4);
        _tile_stored(1, s->s + 16, KCH * 4);
        if (chunk_softmax(s, pos, kbase + c * KCH, window, scale, &ref, &sum, &alpha)) {
            if (resident) store_out(s->o, D, n);
            scale_rows(s->o, D, alpha);
            if (resident) load_out(s->o, D, n);
        }
        _tile_loadd(6, s->p, KCH * 2);
        _tile_loadd(0, s->p + 16 * KCH, KCH * 2);
        if (resident) {
            add_pv(vch, 0, n);
            continue;
        }
        for (int g = 0; g < D / 16; g += 4) { /* D > 64: a multiple of 32, groups of 2 or 4 */
            int m = D / 16 - g < 4 ? 2 : 4;
            load_out(s->o + 16 * g, D, m);
            add_pv(vch, g, m);
            store_out(s->o + 16 * g, D, m);
        }
    }
    if (resident) store_out(s->o, D, n);
    for (int i = 0; i < rows; i++) {
        int r = r0 + i;
        uint16_t *ob = out + ((size_t)(t0 + r / G) * Hq + h * G + r % G) * D;
        float inv = 1.0f / sum[i];
        for (int c = 0; c < D / 16; c++)
            store_bf16(ob + 16 * c, vload(s->o + (size_t)i * D + 16 * c) * inv);
    }
}
#endif

#define SPLIT_COST 2048 /* query rows x keys from which a few decode items use every thread */
#define PART_KEYS 256  /* a decode head's keys split in parts of at least this many */

typedef struct {
    int b, h0, nh;   /* request, first KV head and how many */
    int t0, m;       /* first token row and count (1 for a decode token) */
    int r0, rows;    /* tile items: the first query row of the prompt and how many (<= 16) */
    long cost;       /* query rows x keys, to hand out the longest items first */
    int part, parts; /* a decode head's keys in `parts` shares (1: whole), this one's index */
    long at;         /* parts > 1: its partial sums' place (`combine_parts`), in units */
} work_item;

/* The keys a token at position seq_len - 1 attends to (all, or the window's). */
static inline int key_span(int seq_len, int window) {
    return window > 0 && seq_len > window ? window : seq_len;
}

/* Parts to split each KV head of a decode token over `keys` keys into: one, unless there are
 * fewer than 4 such items per thread and their count does not divide among the threads (a lone
 * request's 3 heads on 2 threads leave one thread idle a third of the time); then the fewest
 * that make the items a multiple of the threads, each of at least PART_KEYS keys. The parts'
 * partial sums are merged by `combine_parts`. */
static int decode_parts(int decode_items, int keys) {
    int threads = omp_get_max_threads(), a = decode_items, b = threads;
    if (decode_items == 0 || decode_items >= 4 * threads) return 1;
    while (b) {
        int t = a % b;
        a = b, b = t;
    }
    int parts = threads / a, most = keys / PART_KEYS; /* a: gcd(items, threads) */
    return parts < most ? parts : most > 1 ? most : 1;
}

/* Row g of ob (G rows of D, bf16) = the softmax-weighted values over all the parts' keys, from
 * the parts' partial sums (`decode_group` with part: G rows of D sums, their max, their sum of
 * weights each), rescaled to the largest max. */
static void combine_parts(const float *partial, int parts, int G, int D, uint16_t *ob) {
    size_t row = (size_t)D + 2, unit = (size_t)G * row;
    for (int g = 0; g < G; g++) {
        const float *first = partial + (size_t)g * row; /* part p's row: first + p * unit */
        float mx = -__builtin_inff(), sum = 0.0f;
        for (int p = 0; p < parts; p++) mx = first[p * unit + D] > mx ? first[p * unit + D] : mx;
        for (int p = 0; p < parts; p++)
            sum += __builtin_expf(first[p * unit + D] - mx) * first[p * unit + D + 1];
        for (int c = 0; c < D / 16; c++) {
            v16f acc = {0};
            for (int p = 0; p < parts; p++)
                acc += __builtin_expf(first[p * unit + D] - mx) * vload(first + p * unit + 16 * c);
            store_bf16(ob + (size_t)g * D + 16 * c, acc * (1.0f / sum));
        }
    }
}

static int by_cost_desc(const void *a, const void *b) {
    long x = ((const work_item *)a)->cost, y = ((const work_item *)b)->cost;
    return (x < y) - (x > y);
}

static int prompt_tiles = 1; /* kvflow_attention_tiles: prompts on AMX tiles where they run */

/* Whether prompts take the AMX tiles (`want` 0 or 1; -1 only asks): 1 only where the CPU and
 * the OS grant them. The tests run both kernels on such a CPU. */
int kvflow_attention_tiles(int want) {
    if (want >= 0) prompt_tiles = want;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    return prompt_tiles && amx_ok;
#else
    return 0;
#endif
}

/* One step of attention over a paged bf16 KV cache, reading K/V where they lie.
 *
 * Request b has tokens query_start_loc[b] .. query_start_loc[b + 1] - 1 (rows of q: Hq heads of
 * D, rows `q_stride` elements apart; k/v: Hkv heads, rows `kv_stride` apart), the last q_len of
 * its seq_lens[b] positions. Every token's K/V is first written to its slot slot_mapping[t];
 * then the token at position p attends over positions max(0, p - window + 1) .. p. Position p
 * of request b lives in slot block_tables[b][p / block_size] * block_size + p % block_size;
 * head h of slot s starts at cache + (s * Hkv + h) * D (the layout [num_blocks, block_size, Hkv,
 * D]). D must be a multiple of 16, at most 256. out [T, Hq, D].
 *
 * Work items: a decode token (q_len 1) with a range of its KV heads (all of them when the decode
 * tokens alone keep the threads busy, else one, its keys in parts where the heads would not
 * divide among the threads: `decode_parts`); a prompt or chunk (q_len > 1) per KV head and
 * tile of QT tokens, or on AMX tiles per KV head and 16 query rows, after its K/V are packed.
 * The costliest go first, handed out one at a time.
 */
void kvflow_paged_attention(const uint16_t *q, int q_stride, const uint16_t *k,
                            const uint16_t *v, int kv_stride, const int64_t *slot_mapping,
                            uint16_t *kc, uint16_t *vc, const int32_t *block_tables,
                            int max_blocks, const int32_t *query_start_loc,
                            const int32_t *seq_lens, int B, int Hq, int Hkv, int D,
                            int block_size, int window, float scale, uint16_t *out) {
    int G = Hq / Hkv, T = query_start_loc[B], decodes = 0, tiles = 0, max_seq_len = 1;
    int amx = kvflow_attention_tiles(-1) && D % 32 == 0;
    long chunks = 0; /* AMX: packed chunks of K/V, all prompts and heads */
    for (int b = 0; b < B; b++) {
        int len = query_start_loc[b + 1] - query_start_loc[b];
        if (seq_lens[b] > max_seq_len) max_seq_len = seq_lens[b];
        if (len == 1) decodes++;
        else tiles += amx ? (len * G + 15) / 16 : (len + QT - 1) / QT;
    }
    int heads_per_item = decodes >= 4 * omp_get_max_threads() ? Hkv : 1;
    /* decode heads split in parts only when each item is one head */
    int items = tiles * Hkv, decode_items = heads_per_item == 1 ? decodes * Hkv : 0;
    long units = 0, unit = 0; /* split decode heads' partial sums (G rows each): count, next */
    for (int b = 0; b < B; b++)
        if (query_start_loc[b + 1] - query_start_loc[b] == 1) {
            int parts = decode_parts(decode_items, key_span(seq_lens[b], window));
            items += (Hkv / heads_per_item) * parts;
            if (parts > 1) units += (long)Hkv * parts;
        }
    work_item *work = malloc(sizeof(work_item) * (size_t)(items > 0 ? items : 1));
    float *partial = units ? malloc(sizeof(float) * (size_t)units * G * (D + 2)) : NULL;
    /* AMX: prompt b's keys from kbase[b] (a multiple of KCH) are packed at chunk pack_at[b] */
    int *kbase = calloc((size_t)B, sizeof(int));
    long *pack_at = calloc((size_t)B + 1, sizeof(long));
    int w = 0;
    for (int b = 0; b < B; b++) {
        int t0 = query_start_loc[b], len = query_start_loc[b + 1] - t0;
        int pos0 = seq_lens[b] - len, span = key_span(seq_lens[b], window);
        pack_at[b] = chunks;
        if (amx && len > 1) {
            int first = window > 0 && pos0 + 1 > window ? pos0 + 1 - window : 0;
            kbase[b] = first / KCH * KCH;
            chunks += Hkv * key_chunks(seq_lens[b], kbase[b]);
            for (int h = 0; h < Hkv; h++)
                for (int r0 = 0; r0 < len * G; r0 += 16) {
                    int rows = len * G - r0 < 16 ? len * G - r0 : 16;
                    int seen = pos0 + (r0 + rows - 1) / G + 1; /* keys the last row sees */
                    work[w++] = (work_item){b, h, 1, t0, len, r0, rows,
                                            (long)rows * (seen < span ? seen : span), 0, 1, 0};
                }
            continue;
        }
        if (len == 1) {
            int parts = decode_parts(decode_items, span);
            for (int h = 0; h < Hkv; h += heads_per_item)
                for (int p = 0; p < parts; p++)
                    work[w++] = (work_item){b, h, heads_per_item, t0, 1, 0, 0,
                                            (long)G * heads_per_item * span / parts, p, parts,
                                            parts > 1 ? unit++ : 0};
            continue;
        }
        for (int h = 0; h < Hkv; h++)
            for (int i = 0; i < len; i += QT) {
                int m = len - i < QT ? len - i : QT;
                work[w++] = (work_item){b, h, 1, t0 + i, m, 0, 0, (long)m * G * span, 0, 1, 0};
            }
    }
    pack_at[B] = chunks;
    qsort(work, (size_t)items, sizeof(work_item), by_cost_desc);
    size_t row_len = (size_t)max_seq_len + 16, stride = (size_t)Hkv * D;
    size_t rows = (size_t)QT * G, chunk = (size_t)KCH * D;
    uint16_t *kpack = NULL, *vpack = NULL;
    if (chunks > 0) {
        kpack = aligned_alloc(64, sizeof(uint16_t) * chunk * (size_t)chunks);
        vpack = aligned_alloc(64, sizeof(uint16_t) * chunk * (size_t)chunks);
    }
    /* a few short decode items: waking another thread costs more than it saves; a long
     * context's heads (a lone request deep into its context) are worth splitting */
    long cost = 0;
    for (int i = 0; i < items; i++) cost += work[i].cost;
#pragma omp parallel if (items >= 8 || tiles > 0 || (items > 1 && cost >= SPLIT_COST))
    {
        float *scores = malloc(sizeof(float) * row_len * (decodes > 0 ? G : 1));
        size_t *slots = malloc(sizeof(size_t) * row_len);
        tile_scratch s = {NULL, NULL, NULL, NULL, NULL, NULL, NULL};
        if (tiles > 0 && !amx) {
            s.kp = aligned_alloc(64, sizeof(uint32_t) * 8 * (size_t)D);
            s.vf = aligned_alloc(64, sizeof(float) * 16 * (size_t)D);
            s.o = malloc(sizeof(float) * rows * (size_t)D);
            s.p = malloc(sizeof(float) * rows * 16);
            s.mx = malloc(sizeof(float) * rows);
            s.sum = malloc(sizeof(float) * rows);
            s.qrow = malloc(sizeof(uint16_t *) * (rows + RB));
        }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        amx_scratch a = {NULL, NULL, NULL, NULL};
        if (chunks > 0) {
            struct tile_config cfg = {.palette = 1};
            for (int i = 0; i < 8; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
            _tile_loadconfig(&cfg);
            a.q = aligned_alloc(64, sizeof(uint16_t) * 16 * (size_t)D);
            a.s = aligned_alloc(64, sizeof(float) * 16 * KCH);
            a.p = aligned_alloc(64, sizeof(uint16_t) * 32 * KCH);
            a.o = aligned_alloc(64, sizeof(float) * 16 * (size_t)D);
        }
#endif
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            size_t slot = (size_t)slot_mapping[t] * stride, bytes = sizeof(uint16_t) * stride;
            memcpy(kc + slot, k + (size_t)t * kv_stride, bytes);
            memcpy(vc + slot, v + (size_t)t * kv_stride, bytes);
        }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (chunks > 0) {
            int b = 0;
#pragma omp for schedule(static)
            for (long u = 0; u < chunks; u++) { /* unit u: a chunk of one prompt's KV head */
                while (u >= pack_at[b + 1]) b++; /* increasing within a thread's range */
                long per_head = key_chunks(seq_lens[b], kbase[b]);
                long c = (u - pack_at[b]) % per_head, h = (u - pack_at[b]) / per_head;
                pack_chunk(kc, vc, stride, (int)h, D, block_tables + (size_t)b * max_blocks,
                           block_size, kbase[b] + (int)c * KCH, seq_lens[b], kpack + u * chunk,
                           vpack + u * chunk);
            }
        }
#endif
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < items; i++) {
            work_item it = work[i];
            int t0q = query_start_loc[it.b], len = query_start_loc[it.b + 1] - t0q;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
            if (it.rows > 0) {
                long at = pack_at[it.b] + it.h0 * key_chunks(seq_lens[it.b], kbase[it.b]);
                prefill_rows_amx(q, q_stride, t0q, it.r0, it.rows, seq_lens[it.b] - len, it.h0, G,
                                 D, kpack + at * chunk, vpack + at * chunk, kbase[it.b], window,
                                 scale, &a, out, Hq);
                continue;
            }
#endif
            int pos0 = seq_lens[it.b] - len + (it.t0 - t0q); /* the item's first position */
            int start = window > 0 && pos0 + 1 > window ? pos0 + 1 - window : 0;
            int n = pos0 + it.m - start;
            if (it.parts > 1) { /* a share of a decode head's keys: partial sums */
                int k0 = (int)((long)n * it.part / it.parts);
                int k1 = (int)((long)n * (it.part + 1) / it.parts);
                fill_slots(block_tables + (size_t)it.b * max_blocks, block_size, start + k0,
                           k1 - k0, slots);
                decode_group(q + (size_t)it.t0 * q_stride, G, it.h0, D, stride, kc, vc, slots,
                             k1 - k0, scale, scores, row_len, NULL,
                             partial + (size_t)it.at * G * (D + 2), NULL);
                continue;
            }
            fill_slots(block_tables + (size_t)it.b * max_blocks, block_size, start, n, slots);
            if (len == 1) { /* a decode token */
                for (int h = it.h0; h < it.h0 + it.nh; h++)
                    decode_group(q + (size_t)it.t0 * q_stride, G, h, D, stride, kc, vc, slots, n,
                                 scale, scores, row_len, out + (size_t)it.t0 * Hq * D, NULL,
                                 h + 1 < it.h0 + it.nh ? kc + (size_t)(h + 1) * D : NULL);
            } else {
                prefill_tile(q, q_stride, it.t0, it.m, pos0, it.h0, G, D, stride, kc, vc, slots,
                             start, window, scale, &s, out, Hq);
            }
        }
        if (units > 0) { /* the split heads' parts, merged (after the items' barrier) */
#pragma omp for schedule(static)
            for (int i = 0; i < items; i++)
                if (work[i].parts > 1 && work[i].part == 0)
                    combine_parts(partial + (size_t)work[i].at * G * (D + 2), work[i].parts, G, D,
                                  out + ((size_t)work[i].t0 * Hq + (size_t)work[i].h0 * G) * D);
        }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (chunks > 0) _tile_release();
        free(a.q);
        free(a.s);
        free(a.p);
        free(a.o);
#endif
        free(scores);
        free(slots);
        free(s.kp);
        free(s.vf);
        free(s.o);
        free(s.p);
        free(s.mx);
        free(s.sum);
        free(s.qrow);
    }
    free(work);
    free(partial);
    free(kbase);
    free(pack_at);
    free(kpack);
    free(vpack);
}

/* ---- small fused ops: one call instead of a chain of torch ops (each a dispatch) ----------
 * Each rounds to bf16 where transformers' bf16 modules do, so results match torch's path. */

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

/* RMSNorm of T rows of D, as transformers: n = bf16(h * rsqrt(mean(h^2) + eps)), out = bf16(w * n).
 * With `residual`, h = bf16(x + residual) first, and h is written back to `residual` (the
 * residual stream carried between layers). */
void kvflow_rms_norm(const uint16_t *x, uint16_t *residual, const uint16_t *w, float eps,
                     uint16_t *out, int T, int D) {
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int t = 0; t < T; t++) {
        const uint16_t *xr = x + (size_t)t * D;
        uint16_t *rr = residual ? residual + (size_t)t * D : NULL;
        uint16_t *orow = out + (size_t)t * D;
        v16f vsum = {0};
        int d = 0;
        for (; d + 16 <= D; d += 16) {
            v16f h = load_bf16(xr + d);
            if (rr) {
                h = vround_bf16(h + load_bf16(rr + d));
                store_bf16(rr + d, h);
            }
            vsum += h * h;
        }
        float sum = hsum(vsum);
        for (; d < D; d++) {
            float h = bf16_to_float(xr[d]);
            if (rr) {
                h = round_bf16(h + bf16_to_float(rr[d]));
                rr[d] = float_to_bf16(h);
            }
            sum += h * h;
        }
        float inv = 1.0f / __builtin_sqrtf(sum / D + eps);
        const uint16_t *hr = rr ? rr : xr;
        for (d = 0; d + 16 <= D; d += 16)
            store_bf16(orow + d, load_bf16(w + d) * vround_bf16(load_bf16(hr + d) * inv));
        for (; d < D; d++)
            orow[d] = float_to_bf16(bf16_to_float(w[d]) * round_bf16(bf16_to_float(hr[d]) * inv));
    }
}

/* Rotary embedding in place on x [T, H, D] (rows `stride` elements apart, heads packed), as
 * transformers: x * cos + rotate_half(x) * sin with each product and the sum rounded to bf16;
 * cos/sin are [T, D] bf16 (rows `cos_stride` / `sin_stride` elements apart). */
void kvflow_rotary(uint16_t *x, int stride, int T, int H, int D, const uint16_t *cos,
                   int cos_stride, const uint16_t *sin, int sin_stride) {
    int half = D / 2;
#pragma omp parallel for schedule(static) if (T >= 16)
    for (int t = 0; t < T; t++) {
        const uint16_t *c = cos + (size_t)t * cos_stride, *s = sin + (size_t)t * sin_stride;
        for (int h = 0; h < H; h++) {
            uint16_t *v = x + (size_t)t * stride + (size_t)h * D;
            for (int i = 0; i < half; i++) {
                float a = bf16_to_float(v[i]), b = bf16_to_float(v[i + half]);
                float lo = round_bf16(a * bf16_to_float(c[i])) +
                           round_bf16(-b * bf16_to_float(s[i]));
                float hi = round_bf16(b * bf16_to_float(c[i + half])) +
                           round_bf16(a * bf16_to_float(s[i + half]));
                v[i] = float_to_bf16(lo);
                v[i + half] = float_to_bf16(hi);
            }
        }
    }
}

/* out[T, I] = bf16(silu(gate)) * up, rounded, for gate_up [T, 2I] = gate | up per row. */
void kvflow_silu_mul(const uint16_t *gate_up, uint16_t *out, int T, int I) {
#pragma omp parallel for schedule(static) if (T >= 4)
    for (int t = 0; t < T; t++) {
        const uint16_t *g = gate_up + (size_t)t * 2 * I, *u = g + I;
        uint16_t *o = out + (size_t)t * I;
        int i = 0;
        for (; i + 16 <= I; i += 16) {
            v16f act = vround_bf16(vsilu(load_bf16(g + i))); /* rounded first, as torch */
            store_bf16(o + i, act * load_bf16(u + i));
        }
        if (i < I) { /* the tail padded to a vector: the same arithmetic as every column */
            uint16_t gt[16] = {0}, ut[16] = {0}, ot[16];
            memcpy(gt, g + i, sizeof(uint16_t) * (I - i));
            memcpy(ut, u + i, sizeof(uint16_t) * (I - i));
            store_bf16(ot, vround_bf16(vsilu(load_bf16(gt))) * load_bf16(ut));
            memcpy(o + i, ot, sizeof(uint16_t) * (I - i));
        }
    }
}

/* ---- greedy tokens ----------------------------------------------------------------------- */

/* Element i of a row of float32 values, or of bf16 ones where `bf16`, as a float. */
static inline float value_at(const void *row, long i, const int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* The first index of row's maximum over n values (float32, or bf16 where `bf16`), as
 * torch.argmax: a NaN counts as the maximum, so the first NaN wins; *max gets the maximum (NaN
 * then). Each of 16 lanes keeps its first maximum (a strict compare), then the lanes' maximum
 * and, among lanes holding it, the smallest index; NaNs are only flagged in the loop, and looked
 * for again when there are any. bf16 values widen exactly, so both give the same answer. */
static inline __attribute__((always_inline)) long first_argmax(const void *row, long n,
                                                               const int bf16, float *max) {
    const float ninf = -__builtin_inff();
    v16f best = {ninf, ninf, ninf, ninf, ninf, ninf, ninf, ninf,
                 ninf, ninf, ninf, ninf, ninf, ninf, ninf, ninf};
    v16i at = {0}, lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, nan = {0};
    long j = 0;
    for (; j + 16 <= n; j += 16) {
        v16f v = bf16 ? load_bf16((const uint16_t *)row + j) : vload((const float *)row + j);
        v16i more = v > best;
        nan |= v != v;
        best = (v16f)(((v16i)v & more) | ((v16i)best & ~more));
        at = ((lane + (int)j) & more) | (at & ~more);
    }
    float m = ninf;
    long idx = 0;
    for (int i = 0; i < 16; i++) m = best[i] > m ? best[i] : m;
    int any_nan = 0, first = 1;
    for (int i = 0; i < 16; i++) {
        any_nan |= nan[i];
        if (best[i] == m && (first || at[i] < idx)) idx = at[i], first = 0;
    }
    for (; j < n; j++) { /* the tail: its indices follow every lane's */
        float x = value_at(row, j, bf16);
        any_nan |= x != x;
        if (x > m) m = x, idx = j;
    }
    if (any_nan)
        for (j = 0; j < n; j++) {
            float x = value_at(row, j, bf16);
            if (x != x) return *max = x, j;
        }
    *max = m;
    return idx;
}

/* argmax[b] (int64) and max[b] of each row of x [B, V] (float32, or bf16 where `bf16`; rows
 * contiguous): greedy tokens and the row maxima that flag bad rows; rows split among the
 * threads. */
void kvflow_row_argmax(const void *x, int B, long V, int bf16, int64_t *argmax, float *max) {
#pragma omp parallel for schedule(static) if (B > 1)
    for (int b = 0; b < B; b++)
        argmax[b] = bf16 ? first_argmax((const uint16_t *)x + (size_t)b * V, V, 1, max + b)
                         : first_argmax((const float *)x + (size_t)b * V, V, 0, max + b);
}
