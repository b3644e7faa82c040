/* Native CPU kernels for the target runner's few-row steps (built by native.py with this machine's -march).
 *
 * A decode or verify step multiplies 1-16 rows by every weight: memory-bound, so what matters is reading
 * each weight once at the machine's streaming bandwidth. MKL's one-row fp32 path read weights at a fraction
 * of it on the CPUs measured (native.py's docstring has the figures). Every
 * output is one FMA chain over the inputs in order, whatever the row count: a row's result does not depend
 * on what else the step carries. Weights are packed once (native.py: pack) in blocks of 16 outputs.
 */
#define _GNU_SOURCE /* syscall() for the AMX permission request */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif


/* ---- fp32 GEMM on weights packed in column blocks: wp (out_pad / 16, in, 16), out_pad a multiple of the tile. ----
 * 16 outputs are one vector: y[r, o:o+16] += x[r, i] * wp[o/16, i, :], a plain FMA chain over i per output.
 * No horizontal sums (row-major dot products, tried first, spent ~40% of their time in them at 4-8 rows), the
 * weight tile is read once per TR input rows, and every output is the same chain whatever the row count.
 */
typedef float vf16 __attribute__((vector_size(64), aligned(4)));
/* A tile: TR input rows x NB blocks of 16 outputs. Its accumulators are vectors of the machine's width VW
 * (a vf16 zmm with AVX-512, a vf8 ymm with AVX2: GCC's 64-byte vectors lowered to ymm pairs kept the AVX2
 * accumulators on the stack, ~4 GFLOP/s a core), TR x NV of them held in registers with the NV weight vectors
 * and a broadcast input. AVX-512 (32 zmm): 6 rows x 4 blocks = 24 + 4 + 1. AVX2 (16 ymm): 6 rows x 1 block
 * (2 ymm) = 12 + 2 + 1. Overridable at build time (-DNATIVE_TR=, -DNATIVE_NB=) to measure other shapes. */
#ifdef __AVX512F__
typedef float vfw __attribute__((vector_size(64), aligned(4)));
#define VW 16
#else
typedef float vfw __attribute__((vector_size(32), aligned(4)));
#define VW 8
#endif
#ifndef NATIVE_NB
#ifdef __AVX512F__
#define NATIVE_NB 4
#else
#define NATIVE_NB 1
#endif
#endif
#ifndef NATIVE_TR
#define NATIVE_TR 6
#endif
#define NB NATIVE_NB
#define TR NATIVE_TR
#define NV (NB * 16 / VW) /* vectors per tile row */

/* fn(n, ...) with n the literal 1 .. 6 that `cnt` is (6 for any more): a tile of up to 6 rows whose row count is a
 * compile-time constant in each branch, so its loops unroll and its sums stay in registers (the bf16 GEMM's row
 * tiles, attention's P·V tiles of query heads). */
#define TILE_DISPATCH(fn, cnt, ...)                                                                                  \
  switch (cnt) {                                                                                                     \
    case 1: fn(1, __VA_ARGS__); break;                                                                               \
    case 2: fn(2, __VA_ARGS__); break;                                                                               \
    case 3: fn(3, __VA_ARGS__); break;                                                                               \
    case 4: fn(4, __VA_ARGS__); break;                                                                               \
    case 5: fn(5, __VA_ARGS__); break;                                                                               \
    default: fn(6, __VA_ARGS__); break;                                                                              \
  }

/* Outputs per tile, to which pack() pads the output dimension. */
int64_t native_tile_outputs(void) { return 16 * NB; }

/* R <= TR input rows against NB blocks of 16 outputs, R a constant at each call site (tile_f32's switch), so
 * the loops over rows unroll and the accumulators stay in registers: a remainder of rows costs only its own
 * arithmetic. The inputs are summed in runs of KB, each run's sum added to the output: the rounding error grows
 * with KB + in / KB terms instead of `in` (one chain over 1536 inputs drifted ~1e-5 from PyTorch's log-probs).
 * Every output is the same chain whatever R. Vector v of a tile row is lanes (v * VW) % 16 .. of block
 * (v * VW) / 16. */
#define KB 64
static inline __attribute__((always_inline)) void tile_rows(const float *const xr[TR], const int R, int64_t in,
                                                            const float *restrict b, float *restrict y, int64_t ld) {
  for (int64_t i0 = 0; i0 < in; i0 += KB) {
    int64_t i1 = i0 + KB < in ? i0 + KB : in;
    vfw acc[TR][NV];
    for (int r = 0; r < R; r++)
      for (int v = 0; v < NV; v++) acc[r][v] = (vfw){0};
    for (int64_t i = i0; i < i1; i++) {
      vfw w[NV];
      for (int v = 0; v < NV; v++) w[v] = *(const vfw *)(b + (v * VW / 16) * in * 16 + i * 16 + (v * VW) % 16);
      for (int r = 0; r < R; r++) {
        float xv = xr[r][i];
        for (int v = 0; v < NV; v++) acc[r][v] += xv * w[v];
      }
    }
    for (int r = 0; r < R; r++)
      for (int v = 0; v < NV; v++) {
        vfw *out = (vfw *)(y + r * ld + v * VW);
        *out = i0 == 0 ? acc[r][v] : *out + acc[r][v];
      }
  }
}

static void tile_f32(const float *const xr[TR], int64_t in, const float *restrict b, float *restrict y, int64_t ld,
                     int64_t nr) {
  switch (nr) {
    case 1: tile_rows(xr, 1, in, b, y, ld); break;
    case 2: tile_rows(xr, 2, in, b, y, ld); break;
    case 3: tile_rows(xr, 3, in, b, y, ld); break;
#if TR >= 4
    case 4: tile_rows(xr, 4, in, b, y, ld); break;
#endif
#if TR >= 5
    case 5: tile_rows(xr, 5, in, b, y, ld); break;
#endif
#if TR >= 6
    case 6: tile_rows(xr, 6, in, b, y, ld); break;
#endif
#if TR >= 7
    case 7: tile_rows(xr, 7, in, b, y, ld); break;
#endif
#if TR >= 8
    case 8: tile_rows(xr, 8, in, b, y, ld); break;
#endif
    default: break;
  }
}

/* Tiles [tid * chunk, ...) of y = x @ w^T: the part of thread tid of n (contiguous, for streaming). */
static void gemm_part(const float *restrict x, const float *restrict wp, float *restrict y, int64_t rows, int64_t in,
                      int64_t out, int64_t tid, int64_t n) {
  int64_t width = 16 * NB, num_tiles = (out + width - 1) / width, chunk = (num_tiles + n - 1) / n;
  int64_t lo = tid * chunk, hi = lo + chunk < num_tiles ? lo + chunk : num_tiles;
  float tail[TR * 16 * NB];
  for (int64_t p = lo; p < hi; p++) {
    const float *b = wp + p * NB * in * 16;
    int64_t o = width * p, cols = out - o < width ? out - o : width;
    for (int64_t r = 0; r < rows; r += TR) {
      int64_t nr = rows - r < TR ? rows - r : TR;
      const float *xr[TR];
      for (int64_t k = 0; k < TR; k++) xr[k] = x + (r + (k < nr ? k : 0)) * in;
      if (cols == width) {
        tile_f32(xr, in, b, y + r * out + o, out, nr);
      } else { /* the last, partial tile: through a buffer */
        tile_f32(xr, in, b, tail, width, nr);
        for (int64_t k = 0; k < nr; k++) memcpy(y + (r + k) * out + o, tail + k * width, cols * sizeof(float));
      }
    }
  }
}

void gemm_blocked_f32(const float *restrict x, const float *restrict wp, float *restrict y, int64_t rows, int64_t in,
                      int64_t out, int64_t nt) {
#pragma omp parallel num_threads(nt)
  gemm_part(x, wp, y, rows, in, out, omp_get_thread_num(), omp_get_num_threads());
}

/* ---- bf16 GEMM on AMX tiles (Intel AMX-BF16; compiled only where -march=native has it). ----
 * y (M, N) bf16 = x (M, K) bf16 @ Wᵀ, W packed once (amx_pack_bf16) as (N / 16, K / 32, 16 k-pairs, 16 outputs, 2):
 * each (16-output, 32-input) block is one B tile, contiguous along K. A tile is 16 rows of x (a partial last
 * block is copied, zero-padded, into a scratch block); C tiles hold 16 x 16 fp32 sums. Every output is one
 * TDPBF16PS chain over K in order, then rounded to bf16 (nearest even): a row's result does not depend on how
 * many rows the call carries (on the AMX Xeon it is also bit for bit what F.linear gives that row alone). The
 * oneDNN kernel PyTorch uses is that too only up to ~32 rows, so a verify step of 64-128 rows fell back to
 * slower row-invariant kernels. Threads take runs of 32-output pairs in turn from a shared counter; each thread
 * configures its tiles (2 x 2 C, 2 A, 2 B) and releases them at the end of the call. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 where this build has the AMX kernel and the kernel (Linux) lets this process use the tile registers. */
int64_t amx_ready(void) {
  static int state = -1;
  if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return state;
}

typedef struct {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} amx_tile_config;

static inline void amx_store_rows(const float *c, uint16_t *y, int64_t ldy, int64_t rows) {
  for (int64_t r = 0; r < rows; r++)
    _mm256_storeu_si256((__m256i *)(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c + 16 * r)));
}

/* N % 32 == 0, K % 32 == 0 (native.py: supports_amx). */
void gemm_amx_bf16(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t M, int64_t K, int64_t N, int64_t nt) {
  int64_t kbs = K / 32, npairs = N / 32, mbs = (M + 15) / 16, tail = M % 16;
  /* the partial last block of 16 rows, zero-padded, in a buffer of the calling thread kept across calls (a decode
   * step's every GEMM has one: no allocation per call) */
  static __thread uint16_t *pad = NULL;
  static __thread int64_t pad_cap = 0;
  if (tail) {
    if (pad_cap < 16 * K) {
      free(pad);
      pad = malloc(sizeof(uint16_t) * (size_t)(16 * K));
      pad_cap = 16 * K;
    }
    memcpy(pad, x + (mbs - 1) * 16 * K, sizeof(uint16_t) * (size_t)(tail * K));
    memset(pad + tail * K, 0, sizeof(uint16_t) * (size_t)((16 - tail) * K));
  }
  const uint16_t *last = pad; /* the team's threads read the caller's buffer, not their own (thread-local) one */
  atomic_llong next = 0; /* runs of `chunk` output pairs handed out in turn (see attention_f32 on why) */
#pragma omp parallel num_threads(nt)
  {
    int64_t nth = omp_get_num_threads(), chunk = (npairs + 16 * nth - 1) / (16 * nth);
    float c[4][256] __attribute__((aligned(64)));
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 8; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    _tile_loadconfig(&cfg);
    for (int64_t lo = atomic_fetch_add(&next, chunk); lo < npairs; lo = atomic_fetch_add(&next, chunk))
    for (int64_t np = lo; np < lo + chunk && np < npairs; np++) {
      const uint16_t *b0 = p + 2 * np * kbs * 512, *b1 = b0 + kbs * 512;
      for (int64_t mb = 0; mb < mbs; mb += 2) {
        const uint16_t *a0 = tail && mb == mbs - 1 ? last : x + mb * 16 * K;
        int64_t r0 = M - mb * 16 < 16 ? M - mb * 16 : 16;
        uint16_t *y0 = y + mb * 16 * N + np * 32;
        _tile_zero(0);
        _tile_zero(1);
        if (mb + 1 < mbs) {
          const uint16_t *a1 = tail && mb + 1 == mbs - 1 ? last : a0 + 16 * K;
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t kb = 0; kb < kbs; kb++) {
            _tile_loadd(4, a0 + kb * 32, K * 2);
            _tile_loadd(5, a1 + kb * 32, K * 2);
            _tile_loadd(6, b0 + kb * 512, 64);
            _tile_loadd(7, b1 + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
          _tile_stored(2, c[2], 64);
          _tile_stored(3, c[3], 64);
          int64_t r1 = M - mb * 16 - 16 < 16 ? M - mb * 16 - 16 : 16;
          amx_store_rows(c[2], y0 + 16 * N, N, r1);
          amx_store_rows(c[3], y0 + 16 * N + 16, N, r1);
        } else {
          for (int64_t kb = 0; kb < kbs; kb++) {
            _tile_loadd(4, a0 + kb * 32, K * 2);
            _tile_loadd(6, b0 + kb * 512, 64);
            _tile_loadd(7, b1 + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
          }
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        amx_store_rows(c[0], y0, N, r0);
        amx_store_rows(c[1], y0 + 16, N, r0);
      }
    }
    _tile_release();
  }
}
#else
int64_t amx_ready(void) { return 0; }
void gemm_amx_bf16(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t M, int64_t K, int64_t N, int64_t nt) {
  (void)x, (void)p, (void)y, (void)M, (void)K, (void)N, (void)nt;
}
#endif

/* The bf16 weight (N, K) in blocks of 16 output columns (N % 16 == 0, K % 32 == 0): block nb holds, for each pair j
 * of input columns, the 16 columns' two weights side by side (32 values), pairs in order. The AMX B tile layout
 * (one tile: 16 pairs, so block nb's tile kb starts at (nb * K / 32 + kb) * 512) and, pair by pair, the operand of
 * AVX512-BF16's VDPBF16PS (16 lanes, each two products). */
void amx_pack_bf16(const uint16_t *w, uint16_t *p, int64_t N, int64_t K) {
  int64_t kbs = K / 32;
  for (int64_t nb = 0; nb < N / 16; nb++)
    for (int64_t kb = 0; kb < kbs; kb++) {
      uint16_t *t = p + (nb * kbs + kb) * 512;
      for (int64_t kk = 0; kk < 16; kk++)
        for (int64_t n = 0; n < 16; n++)
          for (int64_t e = 0; e < 2; e++) t[(kk * 16 + n) * 2 + e] = w[(nb * 16 + n) * K + kb * 32 + 2 * kk + e];
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* bf16 GEMM on AVX512-BF16 dot products, for CPUs without AMX (Zen 4 / Zen 5): y (M, N) = x (M, K) @ Wᵀ with W packed
 * by amx_pack_bf16; N % 32 == 0, K % 32 == 0 (native.py: supports_dpbf16). A tile is up to DP_R rows by 32 columns
 * (two packed blocks); each output element sums its input pairs in a fixed order whatever the tile's row count
 * (even pairs and odd pairs in two accumulators, added at the end: four dependency chains per row hide the
 * instruction's latency at one row), so a row's result does not depend on the batch it is in (row-invariant, as
 * verification needs). Each thread takes the column pairs of its own range in order, then helps the others from
 * their ends (gemm_dpbf16). */
int64_t dpbf16_ready(void) { return 1; }

#define DP_R 6 /* rows a tile (TILE_DISPATCH's most) */
#ifndef DP_PF_HINT
#define DP_PF_HINT 2
#endif
#ifndef DP_PF_AHEAD
#define DP_PF_AHEAD DP_KP
#endif
#ifndef DP_KP
#define DP_KP 64
#endif
typedef int32_t dp_i32 __attribute__((may_alias));

/* Pairs j0 .. j1 - 1 of the input (two k values each) for R rows against a column pair's two packed blocks.
 * `blocked` 0 (a compile-time constant): the whole of K, accumulators from zero, bf16 out. `blocked` 1: the
 * accumulators start at zero on the `first` k block, else from `acc` (fp32, per row 64 floats: block 0 even,
 * block 0 odd, block 1 even, block 1 odd), and go back there unless `y` is given (the last k block), where the
 * even and odd sums are added and rounded to bf16; with `pf` > 0 every `pf_every`-th step (the first after
 * `pf_skip` steps) also asks for the weights `pf` pairs ahead into L2 (past the pair's end that is the next column
 * pair's start; a prefetch past the weights' end is dropped, it does not fault). fp32 out and back in is exact: the
 * same sums in the same order as one pass. */
static inline __attribute__((always_inline)) void dp_tile(const int R, const uint16_t *x, int64_t K,
                                                          const uint16_t *b0, const uint16_t *b1, int64_t j0,
                                                          int64_t j1, float *acc, int first, uint16_t *y, int64_t ldy,
                                                          int64_t pf, int pf_every, int pf_skip, const int blocked) {
  __m512 c0[DP_R][2], c1[DP_R][2]; /* [row][even, odd pairs], column block 0 and 1 */
  for (int r = 0; r < R; r++) {
    if (!blocked || first) {
      c0[r][0] = c0[r][1] = c1[r][0] = c1[r][1] = _mm512_setzero_ps();
    } else {
      c0[r][0] = _mm512_loadu_ps(acc + 64 * r), c0[r][1] = _mm512_loadu_ps(acc + 64 * r + 16);
      c1[r][0] = _mm512_loadu_ps(acc + 64 * r + 32), c1[r][1] = _mm512_loadu_ps(acc + 64 * r + 48);
    }
  }
  for (int64_t j = j0; j < j1; j += 2) {
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + 32 * j), w1 = (__m512bh)_mm512_loadu_si512(b1 + 32 * j);
    __m512bh v0 = (__m512bh)_mm512_loadu_si512(b0 + 32 * j + 32), v1 = (__m512bh)_mm512_loadu_si512(b1 + 32 * j + 32);
    if (blocked && pf && --pf_skip < 0) {
      pf_skip = pf_every - 1;
      __builtin_prefetch(b0 + 32 * (j + pf), 0, DP_PF_HINT), __builtin_prefetch(b0 + 32 * (j + pf) + 32, 0, DP_PF_HINT);
      __builtin_prefetch(b1 + 32 * (j + pf), 0, DP_PF_HINT), __builtin_prefetch(b1 + 32 * (j + pf) + 32, 0, DP_PF_HINT);
    }
    for (int r = 0; r < R; r++) {
      const dp_i32 *xr = (const dp_i32 *)(x + r * K);
      __m512bh e = (__m512bh)_mm512_set1_epi32(xr[j]), o = (__m512bh)_mm512_set1_epi32(xr[j + 1]);
      c0[r][0] = _mm512_dpbf16_ps(c0[r][0], e, w0);
      c1[r][0] = _mm512_dpbf16_ps(c1[r][0], e, w1);
      c0[r][1] = _mm512_dpbf16_ps(c0[r][1], o, v0);
      c1[r][1] = _mm512_dpbf16_ps(c1[r][1], o, v1);
    }
  }
  for (int r = 0; r < R; r++) {
    if (!blocked || y) {
      _mm256_storeu_si256((__m256i *)(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c0[r][0], c0[r][1])));
      _mm256_storeu_si256((__m256i *)(y + r * ldy + 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(c1[r][0], c1[r][1])));
    } else {
      _mm512_storeu_ps(acc + 64 * r, c0[r][0]), _mm512_storeu_ps(acc + 64 * r + 16, c0[r][1]);
      _mm512_storeu_ps(acc + 64 * r + 32, c1[r][0]), _mm512_storeu_ps(acc + 64 * r + 48, c1[r][1]);
    }
  }
}

/* One column pair's k block for all M rows, DP_R rows a tile; `blocked` 0: the whole of K in one go (no scratch, no
 * prefetch: the code of a single pass, specialised at compile time). Prefetch: up to DP_SPREAD_ROWS - 1 rows (the
 * weights' streaming outlasts the compute) the first tile asks for the whole next k block as it goes; from
 * DP_SPREAD_ROWS rows (the compute outlasts the streaming) the tiles take turns step by step, each asking for one
 * step's weights of the NEXT column pair in n (tile t: the steps ≡ t mod n, n the tile count): requests go out at an
 * even pace over the whole compute, a column pair ahead, instead of in a burst during the first tile, the other
 * tiles computing while nothing streams. `spread` is +1 or -1, the direction this thread walks its column pairs in
 * (the next pair, up or down: 32K elements on or back), 0 at the end of a range (the next pair is another thread's:
 * asking for it again cost the forward 7-12 % at 16 rows). Zen 4 EPYC, SmolLM2's GEMMs on huge pages
 * (docs/results/suffix/s52/gemm): the kernels alone 0.94-0.97x at 10-24 rows; the forward, three runs, 0.91-0.99x
 * at 4 x 3, 8 x 2, 16 x 1 and 32 x 2 tokens. Spreading from 7 rows rather than 9 came with one range a thread (s53:
 * with runs of a few pairs it was 1.02-1.04x at 8 rows, with a range 0.92-0.96x). */
#ifndef DP_SPREAD_ROWS
#define DP_SPREAD_ROWS 7
#endif
static inline __attribute__((always_inline)) void dp_rows(const uint16_t *x, int64_t M, int64_t K, int64_t N,
                                                          const uint16_t *b0, const uint16_t *b1, int64_t j0,
                                                          int64_t j1, float *acc, int last, uint16_t *y,
                                                          int spread, const int blocked) {
  for (int64_t m = 0; m < M; m += DP_R) {
    const uint16_t *xm = x + m * K;
    float *am = blocked ? acc + 64 * m : NULL;
    uint16_t *ym = last ? y + m * N : NULL;
    const int first = j0 == 0;
    int64_t pf = m == 0 ? DP_PF_AHEAD : 0; /* read only where blocked */
    int pf_every = 1, pf_skip = 0;
    if (spread) { /* K pairs on (or back): the next column pair's block at the same k (its two blocks 32K away) */
      const int tiles = (int)((M + DP_R - 1) / DP_R);
      pf = spread * K, pf_every = tiles, pf_skip = (int)(m / DP_R);
    }
    TILE_DISPATCH(dp_tile, M - m, xm, K, b0, b1, j0, j1, am, first, ym, N, pf, pf_every, pf_skip, blocked);
  }
}

/* From DP_MIN_BLOCKED rows (below) the GEMM takes the column pair's weights a k block at a time (DP_KP pairs, 128 *
 * DP_KP bytes of both blocks) through every row tile before the next block, the tiles' sums parked in `acc` between
 * blocks, and the weights ahead are prefetched into L2 (PREFETCHT1; which and when: dp_rows) while the tiles compute:
 * the weights stream during the compute of every tile. Whole-K passes instead streamed a column pair from DRAM in the
 * first tile's pass, the other tiles then computing from cache with nothing streaming. Measured on a Zen 4 EPYC, all
 * of SmolLM2's GEMMs (docs/results/suffix/s50/gemm): 0.88-0.94x at 8-24 rows, 0.97-1.00 at 32-48; the blocks without
 * the prefetch were 1.03-1.13x (slower), prefetching into L1 (T0) 1.08-1.14x, a block of 32 or 128 pairs or two blocks
 * ahead no better. The macros can be set before the source for such A/B builds. */
#define DP_MAX_BLOCKED 96 /* rows; beyond, compute-bound: whole-K passes (no scratch) */
/* From 3 rows the k blocks (and their prefetch) pay within one tile too: a whole-K pass of 3-6 rows streamed a column
 * pair without a software prefetch and ran below the blocked 8 rows' bandwidth. Zen 4 EPYC, all of SmolLM2's GEMMs in
 * bf16 (25 turns, bit-identical): 2 / 3 / 4 / 5 / 6 rows 9.4-9.5 / 9.9-10.1 / 10.1-10.3 / 10.4-11.0 / 11.0-11.2 ms as
 * one pass against 9.7 / 9.6 / 9.3 / 9.2 / 9.0 blocked (8 rows 9.35 either way); 1 row blocked 10.0 against 8.5-8.9. */
#ifndef DP_MIN_BLOCKED
#define DP_MIN_BLOCKED 3 /* rows; below, a whole-K pass */
#endif

/* Each thread owns a contiguous range of column pairs and walks it upwards, one long stream the hardware prefetcher
 * follows and whose next pair is known (the spread prefetch runs through the whole range); a thread done with its
 * own takes pairs from the others' ends downwards, so a thread the host held up is helped (a claim counter per
 * range keeps owner and thieves apart). Handing out runs of npairs / 32 pairs from one shared counter instead (as
 * gemm_amx_bf16 still does) left 1-3 pairs a run: the qkv, o and down GEMMs (18-30 pairs) never had their next pair
 * prefetched. Zen 4 EPYC, SmolLM2's step (docs/results/suffix/s53/gemm): the kernels alone 0.99 / 0.99 / 0.94 /
 * 0.86 / 0.89 / 0.91 / 0.94x at 1 / 4 / 8 / 12 / 16 / 24 / 32 rows, bit-identical. */
#define DP_MAX_RANGES 64 /* the most threads a GEMM runs on: one range each */

void gemm_dpbf16(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t M, int64_t K, int64_t N, int64_t nt) {
  int64_t kbs = K / 32, npairs = N / 32, P = K / 2;
  int64_t kp = M >= DP_MIN_BLOCKED && M <= DP_MAX_BLOCKED ? DP_KP : P;
  /* per thread's range: pairs claimed (by its owner or a thief), and taken from its back by thieves */
  atomic_llong claims[DP_MAX_RANGES], stolen[DP_MAX_RANGES];
  for (int i = 0; i < DP_MAX_RANGES; i++) claims[i] = stolen[i] = 0;
#pragma omp parallel num_threads(nt < DP_MAX_RANGES ? nt : DP_MAX_RANGES)
  {
    float acc[DP_MAX_BLOCKED * 64] __attribute__((aligned(64)));
    int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
    for (int64_t t = 0; t < nth; t++) { /* its own range first (upwards), then the others' from their ends */
      int64_t r = (me + t) % nth, lo = npairs * r / nth, hi = npairs * (r + 1) / nth, dir = t == 0 ? 1 : -1;
      for (int64_t own = 0; atomic_fetch_add(&claims[r], 1) < hi - lo; own++) {
        int64_t np = dir > 0 ? lo + own : hi - 1 - atomic_fetch_add(&stolen[r], 1);
        const uint16_t *b0 = p + 2 * np * kbs * 512, *b1 = b0 + kbs * 512;
        if (kp == P) {
          dp_rows(x, M, K, N, b0, b1, 0, P, NULL, 1, y + np * 32, 0, 0);
          continue;
        }
        /* spread: the next pair this thread will most likely take (the last one of a range may go to the thief) */
        const int spread = M >= DP_SPREAD_ROWS && np + dir >= lo && np + dir < hi ? (int)dir : 0;
        for (int64_t j0 = 0; j0 < P; j0 += kp) {
          int64_t j1 = j0 + kp < P ? j0 + kp : P;
          dp_rows(x, M, K, N, b0, b1, j0, j1, acc, j1 == P, y + np * 32, spread, 1);
        }
      }
    }
  }
}
#else
int64_t dpbf16_ready(void) { return 0; }
void gemm_dpbf16(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t M, int64_t K, int64_t N, int64_t nt) {
  (void)x, (void)p, (void)y, (void)M, (void)K, (void)N, (void)nt;
}
#endif

/* Attention of T single tokens over their own cache slots, computed in fp32 on fp32 or bf16 tensors.
 * Query t (row t of q, stride q_stride, heads contiguous) reads keys key_row[t] .. key_row[t] + num_keys[t] - 1
 * of the (rows, num_kv_heads, hd) cache. The G query heads sharing a KV head are done together, so each cached
 * key and value is read (and, in bf16, widened) once per token: the CPU SDPA kernel ran at ~1/7 of the read
 * bandwidth on single-query rows. probs: scratch of T * num_heads * max_keys floats. out: (T, num_heads * hd),
 * the element type of q. Thread tid of n takes (token, KV head) items tid, tid + n, ...; an item's arithmetic
 * does not depend on the others, so a token's result does not depend on what else the step carries. */

static inline float bf16_to_f32(uint16_t h) {
  union { uint32_t u; float f; } c = {.u = (uint32_t)h << 16};
  return c.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(bfloat16); a select, not a
                                                  * branch, for NaN (which stays NaN): loops over it vectorise */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, nan = (u >> 16) | 0x40;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

#ifdef __AVX512F__
static inline __m512 widen16_bf16(const uint16_t *p) { /* 16 bf16 -> fp32, exactly */
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif

/* n elements of an fp32 (bf16 = 0) or bf16 (bf16 = 1) array from element offset `at`, as fp32 in buf; an fp32
 * array is returned in place. */
static inline __attribute__((always_inline)) const float *as_f32(const void *base, int64_t at, int64_t n, float *buf,
                                                                  int bf16) {
  if (!bf16) return (const float *)base + at;
  const uint16_t *src = (const uint16_t *)base + at;
#pragma omp simd
  for (int64_t i = 0; i < n; i++) buf[i] = bf16_to_f32(src[i]);
  return buf;
}

/* The sums of 16 vectors' lanes as one vector (lane j: the sum of p[j]): a tree of pairwise lane folds, 30
 * shuffles and 15 adds for 16 dot products instead of 16 horizontal sums. */
#if defined(__GNUC__) && !defined(__clang__)
typedef int32_t vi16 __attribute__((vector_size(64)));
#define FOLD(a, b, lo, hi) (__builtin_shuffle((a), (b), (vi16)lo) + __builtin_shuffle((a), (b), (vi16)hi))
static inline vf16 sum_lanes16(vf16 p[16]) {
  vf16 c[8], e[4], f[2];
  for (int i = 0; i < 8; i++)
    c[i] = FOLD(p[2 * i], p[2 * i + 1], ((vi16){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}),
                ((vi16){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}));
  for (int i = 0; i < 4; i++)
    e[i] = FOLD(c[2 * i], c[2 * i + 1], ((vi16){0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}),
                ((vi16){4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}));
  for (int i = 0; i < 2; i++)
    f[i] = FOLD(e[2 * i], e[2 * i + 1], ((vi16){0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}),
                ((vi16){2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31}));
  return FOLD(f[0], f[1], ((vi16){0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}),
              ((vi16){1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}));
}
#else
static inline vf16 sum_lanes16(vf16 p[16]) {
  vf16 s;
  for (int j = 0; j < 16; j++) {
    float t = 0.f;
    for (int i = 0; i < 16; i++) t += p[j][i];
    s[j] = t;
  }
  return s;
}
#endif

static inline vf16 load16(const float *p) { return *(const vf16 *)p; }

/* p[j] = exp(p[j] - mx) for j < n (all <= 0), returning their sum, 16 at a time in vector code (libm's expf is
 * one call per element without -ffast-math, and GCC kept this loop scalar). Cody-Waite reduction x = k ln2 + r,
 * Cephes' degree-6 polynomial for e^r, 2^k from the exponent bits: within 2 ulp of expf, 0 below e^-87. */
typedef int32_t vi16x __attribute__((vector_size(64), aligned(4)));
static inline vf16 exp_le0(vf16 x) {
  vi16x under = x < -87.0f;
  x = (vf16)(((vi16x)x & ~under) | ((vi16x)((vf16){0} - 87.0f) & under));
  vf16 k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
  vf16 r = x - k * 0.693359375f + k * 2.12194440e-4f;
  vf16 y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  vi16x bits = (__builtin_convertvector(k, vi16x) + 127) << 23;
  return (vf16)((vi16x)(y * (vf16)bits) & ~under);
}

static inline float exp_shifted(float *restrict p, int64_t n, float mx) {
  vf16 sum = {0};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    vf16 e = exp_le0(*(vf16 *)(p + j) - mx);
    *(vf16 *)(p + j) = e;
    sum += e;
  }
  if (j < n) { /* the tail through a buffer padded with e^-inf = 0 */
    vf16 t;
    for (int64_t i = 0; i < 16; i++) t[i] = j + i < n ? p[j + i] - mx : -INFINITY;
    t = exp_le0(t);
    for (int64_t i = 0; j + i < n; i++) p[j + i] = t[i];
    sum += t;
  }
  float total = 0.f;
  for (int i = 0; i < 16; i++) total += sum[i];
  return total;
}

/* SiLU(g) * u over [lo, hi) of fp32 rows: sigmoid from e^-|g| (exp_le0), so no exp overflows; 16 at a time. */
static inline vf16 silu16(vf16 g) {
  vi16x neg = g < 0.0f;
  vf16 e = exp_le0((vf16)((vi16x)g | (int32_t)0x80000000)); /* e^-|g| */
  vf16 num = (vf16)(((vi16x)e & neg) | ((vi16x)((vf16){0} + 1.0f) & ~neg)); /* g < 0: e^g / (1 + e^g) */
  return g * num / (1.0f + e);
}

static void silu_mul_range(const float *restrict g, const float *restrict u, float *restrict a, int64_t lo,
                           int64_t hi) {
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) *(vf16 *)(a + i) = silu16(load16(g + i)) * load16(u + i);
  for (; i < hi; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* Software prefetch of the next block's cache rows (up to 16 of them; `count` may be <= 0): `width` elements
 * of each, rows `stride` elements apart, into L2 (PREFETCHT1): a block's 96 lines prefetched into L1 took the
 * L1's miss buffers from the loads the kernel was waiting on (Zen 4, 30 layers' caches from DRAM: 1 query a
 * slot at 32 slots 510 -> 390 us, 8 slots x 2 queries 184 -> 126 us). */
static inline __attribute__((always_inline)) void prefetch_rows(const void *base, int64_t at, int64_t count,
                                                                 int64_t stride, int64_t width, int bf16) {
  int64_t size = bf16 ? 2 : 4, bytes = width * size;
  for (int64_t j = 0; j < (count < 16 ? count : 16); j++)
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)base + (at + j * stride) * size + b, 0, 2);
}

/* Work is cut into pieces: runs of consecutive tokens that read the same slot from the same first key (the
 * 1 + l tokens of a verify chunk, a prompt chunk), at most ceil(T / threads) and ATTN_MAX_Q tokens each. A piece
 * reads its keys and values block by block ONCE for all its queries (a block stays in L1 while they use it):
 * a verify chunk of 8 tokens no longer reads its slot's cache 8 times. An item is one piece and a run of its
 * KV heads: all of them when there are enough pieces to share among the threads (a key's row is then read
 * whole), else one KV head each. Keys (and values) go in blocks of 16: a block's scores for one query head
 * are 16 dot products folded into one vector (head_dim a multiple of 16; `hd` is a literal 64 for the common
 * head size, so the chunk loops unroll). In bf16 a block is widened once into an fp32 buffer that serves all
 * the item's queries and heads; with AVX512-BF16 (hd a multiple of 32) nothing is widened: the scores are
 * VDPBF16PS chains over a transposed key block, and P·V multiplies bf16 probability pairs by interleaved value
 * row pairs read straight from the cache (pv_tile_bf16), the probabilities rounded to bf16 as HF's eager bf16
 * attention rounds them.
 * Row invariance: every query runs the same operations in the same order whatever piece or item it falls in
 * (the same blocks of 16 from its first key, its own accumulators, its own softmax), so a token's result is
 * bit for bit the same whether its step carries 1 token or 256. */
#ifdef __AVX512BF16__
/* r[i] (row i of a 16 x 16 matrix of dwords) becomes column i: pairs of rows interleaved by dwords, then by
 * qwords (a 4 x 4 transpose in each 128-bit lane), then the lanes gathered across registers. */
static inline __attribute__((always_inline)) void transpose16_dw(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) { /* u[4i + m]: column 4L + m of rows 4i .. 4i + 3, in lane L */
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int m = 0; m < 4; m++) {
    __m512i v = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88), w = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xDD);
    __m512i v2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88), w2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xDD);
    r[m] = _mm512_shuffle_i32x4(v, v2, 0x88);
    r[8 + m] = _mm512_shuffle_i32x4(v, v2, 0xDD);
    r[4 + m] = _mm512_shuffle_i32x4(w, w2, 0x88);
    r[12 + m] = _mm512_shuffle_i32x4(w, w2, 0xDD);
  }
}
#endif

#define KEYS 16
#define ATTN_MAX_HD 256
#define ATTN_MAX_Q 16
/* P·V for a tile of cnt query heads reading one KV head: for each of the block's nb value rows (read once for
 * the tile), every query head's sums += its probability * the row, one FMA chain per (head, chunk), keys in
 * order. A query's sums take the same operations in the same order whatever tile, piece or step it is in. */
#define PV_ACC 24
#define PV_TILE 6
static inline __attribute__((always_inline)) void pv_tile(const int64_t cnt, const float *const *p, vf16 *const *a,
                                                          const float *vh, int64_t stride, int64_t nb,
                                                          const int64_t nc) {
  vf16 acc[PV_ACC > ATTN_MAX_HD / 16 ? PV_ACC : ATTN_MAX_HD / 16];
  for (int64_t x = 0; x < cnt; x++)
    for (int64_t c = 0; c < nc; c++) acc[x * nc + c] = a[x][c];
  for (int64_t j = 0; j < nb; j++) {
    vf16 v[ATTN_MAX_HD / 16];
    for (int64_t c = 0; c < nc; c++) v[c] = load16(vh + j * stride + 16 * c);
    for (int64_t x = 0; x < cnt; x++) {
      vf16 pj = (vf16){0} + p[x][j];
      for (int64_t c = 0; c < nc; c++) acc[x * nc + c] += pj * v[c];
    }
  }
  for (int64_t x = 0; x < cnt; x++)
    for (int64_t c = 0; c < nc; c++) a[x][c] = acc[x * nc + c];
}

#ifdef __AVX512BF16__
/* A query head's n_max probabilities, in place, as bf16 pairs of keys: pair k = bf16(p[2k]) | bf16(p[2k + 1]) << 16
 * (round to nearest even), the key past n_max 0. P·V then multiplies bf16 pairs as the QK scores do; rounding the
 * probabilities to bf16 before P·V is what HF's eager bf16 attention (softmax in fp32, then cast) and flash attention
 * do. Each 32-float chunk is read before its 16 pairs are written over its first half, so in place is safe. */
static inline void probs_to_pairs(float *p, int64_t n) {
  uint32_t *pp = (uint32_t *)p;
  for (int64_t j = 0; j < n; j += 32) {
    int64_t left = n - j, pairs = left >= 32 ? 16 : (left + 1) / 2;
    __mmask16 m0 = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
    __mmask16 m1 = left >= 32 ? (__mmask16)0xFFFF : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1u);
    __m512 a = _mm512_maskz_loadu_ps(m0, p + j), b = _mm512_maskz_loadu_ps(m1, p + j + 16);
    __m512i h = (__m512i)_mm512_cvtne2ps_pbh(b, a); /* bf16 lanes 0..15 from a, 16..31 from b */
    _mm512_mask_storeu_epi32(pp + j / 2, pairs == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << pairs) - 1u), h);
  }
}

/* P·V in bf16 for a tile of cnt query heads reading one KV head (hd a multiple of 32): for each pair of the
 * block's nb value rows (read once for the tile, the row past nb as zeros), the two rows interleaved by words
 * (VPUNPCK{L,H}WD: dword lane i of a 32-dim chunk's `lo` holds dim 8 (i / 4) + i % 4 of both rows, `hi` the
 * dims 4 above), then every query head's sums += its probability pair . the row pair, one VDPBF16PS chain per
 * (head, half-chunk), pairs in order. The sums hold each chunk's dims in that interleaved order (pairs_in_order
 * puts them back). As in pv_tile, a query's sums take the same operations whatever tile, piece or step. */
static inline __attribute__((always_inline)) void pv_tile_bf16(const int64_t cnt, const float *const *pp,
                                                               vf16 *const *a, const uint16_t *vh, int64_t stride,
                                                               int64_t nb, const int64_t nc) {
  __m512 acc[PV_ACC > ATTN_MAX_HD / 16 ? PV_ACC : ATTN_MAX_HD / 16];
  for (int64_t x = 0; x < cnt; x++)
    for (int64_t c = 0; c < nc; c++) acc[x * nc + c] = (__m512)a[x][c];
  for (int64_t j = 0; j < nb; j += 2) {
    __m512i v[ATTN_MAX_HD / 16];
    for (int64_t c = 0; c < nc / 2; c++) {
      __m512i r0 = _mm512_loadu_si512(vh + j * stride + 32 * c);
      __m512i r1 = j + 1 < nb ? _mm512_loadu_si512(vh + (j + 1) * stride + 32 * c) : _mm512_setzero_si512();
      v[2 * c] = _mm512_unpacklo_epi16(r0, r1);
      v[2 * c + 1] = _mm512_unpackhi_epi16(r0, r1);
    }
    for (int64_t x = 0; x < cnt; x++) {
      __m512bh pj = (__m512bh)_mm512_set1_epi32(((const dp_i32 *)pp[x])[j / 2]); /* the pair (j, j + 1) */
      for (int64_t c = 0; c < nc; c++) acc[x * nc + c] = _mm512_dpbf16_ps(acc[x * nc + c], pj, (__m512bh)v[c]);
    }
  }
  for (int64_t x = 0; x < cnt; x++)
    for (int64_t c = 0; c < nc; c++) a[x][c] = (vf16)acc[x * nc + c];
}

/* pv_tile_bf16's sums (nc vectors: per 32-dim chunk its `lo` then its `hi`) as hd floats in dim order. */
static inline void pairs_in_order(const float *s, float *out, int64_t nc) {
  for (int64_t c = 0; c < nc / 2; c++)
    for (int64_t i = 0; i < 16; i++) {
      out[32 * c + 8 * (i / 4) + i % 4] = s[32 * c + i];
      out[32 * c + 8 * (i / 4) + 4 + i % 4] = s[32 * c + 16 + i];
    }
}
#endif

static inline __attribute__((always_inline)) void attention_generic(
    int64_t T, const void *q, int64_t q_stride, const void *k_cache, const void *v_cache, const int64_t *key_row,
    const int64_t *num_keys, void *out, float *probs, int64_t num_heads, int64_t num_kv_heads, const int64_t hd,
    float scale, int64_t max_keys, int64_t tid, int64_t nthr, atomic_llong *next, int bf16) {
  int64_t nkv = num_kv_heads * hd, group = num_heads / num_kv_heads, nc = hd / 16;
  int64_t cap = (T + nthr - 1) / nthr;
  cap = cap < 1 ? 1 : cap > ATTN_MAX_Q ? ATTN_MAX_Q : cap;
  int64_t *piece = malloc(sizeof(int64_t) * (size_t)(T + 1)), num_pieces = 0;
  for (int64_t t = 0; t < T;) { /* every thread cuts the same pieces */
    int64_t e = t + 1;
    while (e < T && e - t < cap && key_row[e] == key_row[t]) e++;
    piece[num_pieces++] = t;
    t = e;
  }
  piece[num_pieces] = T;
  int64_t split = num_pieces >= 2 * nthr ? 1 : num_kv_heads, heads = num_kv_heads / split, width = heads * hd;
  int64_t hq = heads * group; /* query heads per item */
  /* per thread: q heads widened (cap, hq, hd) | a key or value block (KEYS, width) | accumulators (cap, hq, nc) */
  float *buf = malloc(sizeof(float) * (size_t)(cap * hq * hd + KEYS * width) + sizeof(vf16) * (size_t)(cap * hq * nc));
  float *qbuf = buf, *blk = qbuf + cap * hq * hd;
  vf16 *acc_all = (vf16 *)(blk + KEYS * width);
#ifdef __AVX512BF16__
  uint32_t kt[ATTN_MAX_HD / 2 * KEYS] __attribute__((aligned(64))); /* a KV head's key block, transposed */
#endif
  /* items taken in turn from a shared counter (`next`), or tid, tid + nthr, ... without one (the fused stack) */
  for (int64_t item = next ? atomic_fetch_add(next, 1) : tid; item < num_pieces * split;
       item = next ? atomic_fetch_add(next, 1) : item + nthr) {
    int64_t pc = item / split, h0 = (item % split) * heads, t0 = piece[pc], nq = piece[pc + 1] - t0, n_max = 0;
    for (int64_t i = 0; i < nq; i++) n_max = num_keys[t0 + i] > n_max ? num_keys[t0 + i] : n_max;
    int64_t k0 = key_row[t0] * nkv + h0 * hd, stride = bf16 ? width : nkv;
    const float *qh_of[ATTN_MAX_Q];
    for (int64_t i = 0; i < nq; i++)
      qh_of[i] = as_f32(q, (t0 + i) * q_stride + h0 * group * hd, hq * hd, qbuf + i * hq * hd, bf16);
    for (int64_t j0 = 0; j0 < n_max; j0 += KEYS) {
      int64_t nb_max = n_max - j0 < KEYS ? n_max - j0 : KEYS;
      const float *kb = bf16 ? blk : (const float *)k_cache + k0 + j0 * nkv;
      prefetch_rows(k_cache, k0 + (j0 + KEYS) * nkv, n_max - j0 - KEYS, nkv, width, bf16);
#ifdef __AVX512BF16__
      if (bf16 && hd % 32 == 0) { /* bf16 pairs multiplied exactly and summed into fp32 lanes: no widening */
        /* A KV head's 16 keys transposed once into dword columns kt[p] (lane j: key j's pair p, keys past the
         * block zero), then each query head's 16 scores are one vector: hd / 2 VDPBF16PS of its pair p
         * broadcast against kt[p], in two chains (even and odd p) added at the end. No lane folds and no
         * stores per key; the transpose is shared by every query of the piece and every head of the group. */
        int64_t npair = hd / 2, row_dw = nkv / 2;
        for (int64_t kh = 0; kh < heads; kh++) {
          const uint32_t *src = (const uint32_t *)((const uint16_t *)k_cache + k0 + j0 * nkv + kh * hd);
          for (int64_t c = 0; c < npair; c += 16) {
            __m512i r[16];
            for (int64_t j = 0; j < KEYS; j++)
              r[j] = _mm512_maskz_loadu_epi32(j < nb_max ? (__mmask16)0xFFFF : 0, src + j * row_dw + c);
            transpose16_dw(r);
            for (int64_t m = 0; m < 16; m++) _mm512_store_si512(kt + (c + m) * 16, r[m]);
          }
          for (int64_t i = 0; i < nq; i++) {
            int64_t t = t0 + i, n = num_keys[t];
            if (j0 >= n) continue;
            int64_t nb = n - j0 < KEYS ? n - j0 : KEYS;
            float *p0 = probs + (t * num_heads + h0 * group) * max_keys;
            for (int64_t g = 0; g < group; g++) {
              int64_t hg = kh * group + g;
              const int32_t *qd = (const int32_t *)((const uint16_t *)q + t * q_stride + (h0 * group + hg) * hd);
              __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
              for (int64_t pr = 0; pr < npair; pr += 2) {
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_set1_epi32(qd[pr]),
                                      (__m512bh)_mm512_load_si512(kt + pr * 16));
                a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_set1_epi32(qd[pr + 1]),
                                      (__m512bh)_mm512_load_si512(kt + (pr + 1) * 16));
              }
              __m512 sc = _mm512_mul_ps(_mm512_add_ps(a0, a1), _mm512_set1_ps(scale));
              _mm512_mask_storeu_ps(p0 + hg * max_keys + j0, (__mmask16)((1u << nb) - 1u), sc);
            }
          }
        }
        continue;
      }
#endif
      if (bf16)
        for (int64_t j = 0; j < nb_max; j++) as_f32(k_cache, k0 + (j0 + j) * nkv, width, blk + j * width, 1);
      for (int64_t i = 0; i < nq; i++) {
        int64_t t = t0 + i, n = num_keys[t];
        if (j0 >= n) continue;
        int64_t nb = n - j0 < KEYS ? n - j0 : KEYS;
        float *p0 = probs + (t * num_heads + h0 * group) * max_keys;
        for (int64_t hg = 0; hg < hq; hg++) { /* query head h0 * group + hg reads KV head h0 + hg / group */
          const float *qg = qh_of[i] + hg * hd, *kh = kb + (hg / group) * hd;
          vf16 part[KEYS];
          for (int64_t j = 0; j < KEYS; j++) {
            vf16 s = {0};
            if (j < nb)
              for (int64_t c = 0; c < nc; c++) s += load16(qg + 16 * c) * load16(kh + j * stride + 16 * c);
            part[j] = s;
          }
          vf16 sc = sum_lanes16(part) * scale;
          float *p = p0 + hg * max_keys + j0;
          if (nb == KEYS)
            *(vf16 *)p = sc;
          else
            for (int64_t j = 0; j < nb; j++) p[j] = sc[j];
        }
      }
    }
    prefetch_rows(v_cache, k0, n_max, nkv, width, bf16);
    for (int64_t i = 0; i < nq; i++) {
      int64_t t = t0 + i, n = num_keys[t];
      float *p0 = probs + (t * num_heads + h0 * group) * max_keys;
      for (int64_t hg = 0; hg < hq; hg++) {
        float *p = p0 + hg * max_keys, mx = -INFINITY;
#pragma omp simd reduction(max : mx)
        for (int64_t j = 0; j < n; j++) mx = p[j] > mx ? p[j] : mx;
        float inv = 1.0f / exp_shifted(p, n, mx);
        for (int64_t j = 0; j < n; j++) p[j] *= inv;
        for (int64_t j = n; j < n_max; j++) p[j] = 0.0f; /* keys past its own: +0 * v leaves its sums as they are */
        for (int64_t c = 0; c < nc; c++) acc_all[(i * hq + hg) * nc + c] = (vf16){0};
      }
    }
    int64_t nx = nq * group, tile = PV_ACC / nc > PV_TILE ? PV_TILE : PV_ACC / nc;
    int pv_pairs = 0; /* bf16 P·V on pairs of keys (pv_tile_bf16): probabilities as bf16 pairs, no widening */
#ifdef __AVX512BF16__
    pv_pairs = bf16 && hd % 32 == 0;
    if (pv_pairs)
      for (int64_t i = 0; i < nq; i++)
        for (int64_t hg = 0; hg < hq; hg++)
          probs_to_pairs(probs + ((t0 + i) * num_heads + h0 * group + hg) * max_keys, n_max);
#endif
    for (int64_t j0 = 0; j0 < n_max; j0 += KEYS) {
      int64_t nb_max = n_max - j0 < KEYS ? n_max - j0 : KEYS;
      const float *vb = bf16 ? blk : (const float *)v_cache + k0 + j0 * nkv;
      prefetch_rows(v_cache, k0 + (j0 + KEYS) * nkv, n_max - j0 - KEYS, nkv, width, bf16);
      if (bf16 && !pv_pairs)
        for (int64_t j = 0; j < nb_max; j++) as_f32(v_cache, k0 + (j0 + j) * nkv, width, blk + j * width, 1);
      for (int64_t kh = 0; kh < heads; kh++) /* the queries of a KV head in tiles: a value row read once a tile */
        for (int64_t x0 = 0; x0 < nx; x0 += tile) {
          int64_t cnt = nx - x0 < tile ? nx - x0 : tile;
          const float *pr[PV_TILE];
          vf16 *ar[PV_TILE];
          for (int64_t x = 0; x < cnt; x++) {
            int64_t i = (x0 + x) / group, hg = kh * group + (x0 + x) % group;
            /* the block's probabilities: from key j0, or from pair j0 / 2 (a pair takes a float's 4 bytes) */
            pr[x] = probs + ((t0 + i) * num_heads + h0 * group + hg) * max_keys + (pv_pairs ? j0 / 2 : j0);
            ar[x] = acc_all + (i * hq + hg) * nc;
          }
#ifdef __AVX512BF16__
          if (pv_pairs) {
            const uint16_t *vh = (const uint16_t *)v_cache + k0 + j0 * nkv + kh * hd;
            TILE_DISPATCH(pv_tile_bf16, cnt, pr, ar, vh, nkv, nb_max, nc);
            continue;
          }
#endif
          TILE_DISPATCH(pv_tile, cnt, pr, ar, vb + kh * hd, stride, nb_max, nc);
        }
    }
    for (int64_t i = 0; i < nq; i++)
      for (int64_t hg = 0; hg < hq; hg++) {
        int64_t at = (t0 + i) * num_heads * hd + (h0 * group + hg) * hd;
        const float *a = (const float *)(acc_all + (i * hq + hg) * nc);
#ifdef __AVX512BF16__
        float ordered[ATTN_MAX_HD];
        if (pv_pairs) pairs_in_order(a, ordered, nc), a = ordered;
#endif
        if (bf16)
          for (int64_t x = 0; x < hd; x++) ((uint16_t *)out)[at + x] = f32_to_bf16(a[x]);
        else
          memcpy((float *)out + at, a, (size_t)hd * sizeof(float));
      }
  }
  free(buf);
  free(piece);
}

/* hd a literal where it is 64 (the chunk loops then unroll into registers), any multiple of 16 otherwise. */
#define ATTENTION(bf16)                                                                                              \
  do {                                                                                                               \
    if (hd == 64)                                                                                                    \
      attention_generic(T, q, q_stride, k_cache, v_cache, key_row, num_keys, out, probs, num_heads, num_kv_heads, 64, \
                        scale, max_keys, tid, nthr, next, bf16);                                                     \
    else                                                                                                             \
      attention_generic(T, q, q_stride, k_cache, v_cache, key_row, num_keys, out, probs, num_heads, num_kv_heads, hd, \
                        scale, max_keys, tid, nthr, next, bf16);                                                     \
  } while (0)

static void attention_part(int64_t T, const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                           const int64_t *key_row, const int64_t *num_keys, float *out, float *probs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t hd, float scale, int64_t max_keys,
                           int64_t tid, int64_t nthr, atomic_llong *next) {
  ATTENTION(0);
}

/* attention_f32 / attention_bf16: the above over nt threads, items handed out one at a time from a shared counter:
 * on cores the model shares with other processes (a server's ingress, its proxy), a thread preempted for a moment
 * does not hold its share of the items up while the other waits at the region's end (a static split made every
 * burst of another process cost about twice its own time). */
void attention_f32(int64_t T, const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                   const int64_t *key_row, const int64_t *num_keys, float *out, float *probs, int64_t num_heads,
                   int64_t num_kv_heads, int64_t hd, float scale, int64_t max_keys, int64_t nt) {
  atomic_llong next = 0;
#pragma omp parallel num_threads(nt)
  attention_part(T, q, q_stride, k_cache, v_cache, key_row, num_keys, out, probs, num_heads, num_kv_heads, hd, scale,
                 max_keys, omp_get_thread_num(), omp_get_num_threads(), &next);
}

void attention_bf16(int64_t T, const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                    const uint16_t *v_cache, const int64_t *key_row, const int64_t *num_keys, uint16_t *out,
                    float *probs, int64_t num_heads, int64_t num_kv_heads, int64_t hd, float scale, int64_t max_keys,
                    int64_t nt) {
  atomic_llong next_item = 0;
#pragma omp parallel num_threads(nt)
  {
    int64_t tid = omp_get_thread_num(), nthr = omp_get_num_threads();
    atomic_llong *next = &next_item;
    ATTENTION(1);
  }
}

/* ---- The decoder stack for a few fp32 tokens, in place on x, in ONE parallel region. ----
 * Phases inside a layer meet at a spinning barrier of our own: a parallel region per GEMM cost ~0.2 ms a
 * layer more when the caller is not the process's main thread (the engine's thread in a server: libgomp's
 * workers then sleep between regions, each region waking them through the kernel), ~6 ms a SmolLM2 step.
 * Token t sits at cache row cache_row[t] (slot * max_len + position) and attends to the num_keys[t] rows
 * from key_row[t] (its slot's first row): causal by position, since the step's K/V are written first.
 * cos/sin: (T, head_dim) rotary tables; HF's rotate_half convention (pairs i and i + head_dim / 2).
 * weights: 6 per layer (in_norm, qkv, o, post_norm, gate_up, down; GEMM weights packed); hidden: (L, T, d),
 * written after layer i where is_hidden[i]; nt: threads (torch.get_num_threads(), passed per call: the
 * calling thread's OpenMP default is not torch's, e.g. 1 in a Ray worker under OMP_NUM_THREADS=1). */

typedef struct {
  atomic_int count;
  atomic_int sense;
} spin_barrier;

static void barrier_wait(spin_barrier *b, int *local_sense, int n) {
  *local_sense = !*local_sense;
  if (atomic_fetch_add(&b->count, 1) == n - 1) {
    atomic_store(&b->count, 0);
    atomic_store(&b->sense, *local_sense);
  } else {
    for (long spins = 0; atomic_load(&b->sense) != *local_sense; spins++) {
      if (spins < 200000) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      } else
        sched_yield(); /* more threads than cores: let the others run */
    }
  }
}

static void rms_norm_rows(const float *restrict x, const float *restrict w, float *restrict out, int64_t rows,
                          int64_t d, float eps) {
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * d;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < d; i++) ss += xr[i] * xr[i];
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
#pragma omp simd
    for (int64_t i = 0; i < d; i++) out[r * d + i] = w[i] * (xr[i] * inv);
  }
}

static void rotate(float *restrict v, const float *restrict cos, const float *restrict sin, int64_t hd) {
  int64_t half = hd / 2;
  for (int64_t i = 0; i < half; i++) {
    float a = v[i], b = v[i + half];
    v[i] = a * cos[i] - b * sin[i];
    v[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

void decoder_stack_f32(int64_t T, float *restrict x, float *restrict scratch, int64_t num_layers,
                       const int64_t *weights, const int64_t *k_caches, const int64_t *v_caches,
                       const int64_t *cache_row, const int64_t *key_row, const int64_t *num_keys, const float *cos,
                       const float *sin, int64_t d, int64_t num_heads, int64_t num_kv_heads, int64_t hd,
                       int64_t inter, float eps, float scale, int64_t max_keys, float *hidden,
                       const int64_t *is_hidden, int64_t nt) {
  int64_t nq = num_heads * hd, nkv = num_kv_heads * hd, nqkv = nq + 2 * nkv;
  /* scratch: h (T, d) | qkv (T, nqkv) | attn (T, nq) | gate_up (T, 2 inter) | act (T, inter) | probs */
  float *h = scratch, *qkv = h + T * d, *attn = qkv + T * nqkv, *gu = attn + T * nq, *act = gu + T * 2 * inter;
  float *probs = act + T * inter; /* (T * num_heads, max_keys) */
  spin_barrier bar;
  atomic_init(&bar.count, 0);
  atomic_init(&bar.sense, 0);
#pragma omp parallel num_threads(nt)
  {
    int tid = omp_get_thread_num(), n = omp_get_num_threads(), sense = 0;
    for (int64_t l = 0; l < num_layers; l++) {
      const float *in_norm = (const float *)weights[6 * l], *w_qkv = (const float *)weights[6 * l + 1];
      const float *w_o = (const float *)weights[6 * l + 2], *post_norm = (const float *)weights[6 * l + 3];
      const float *w_gate_up = (const float *)weights[6 * l + 4], *w_down = (const float *)weights[6 * l + 5];
      float *k_cache = (float *)k_caches[l], *v_cache = (float *)v_caches[l];
      if (tid == 0) rms_norm_rows(x, in_norm, h, T, d, eps);
      barrier_wait(&bar, &sense, n);
      gemm_part(h, w_qkv, qkv, T, d, nqkv, tid, n);
      barrier_wait(&bar, &sense, n);
      if (tid == 0)
        for (int64_t t = 0; t < T; t++) {
          float *row = qkv + t * nqkv;
          for (int64_t hh = 0; hh < num_heads + num_kv_heads; hh++)
            rotate(row + hh * hd, cos + t * hd, sin + t * hd, hd);
          memcpy(k_cache + cache_row[t] * nkv, row + nq, (size_t)nkv * sizeof(float));
          memcpy(v_cache + cache_row[t] * nkv, row + nq + nkv, (size_t)nkv * sizeof(float));
        }
      barrier_wait(&bar, &sense, n);
      attention_part(T, qkv, nqkv, k_cache, v_cache, key_row, num_keys, attn, probs, num_heads, num_kv_heads, hd,
                     scale, max_keys, tid, n, NULL);
      barrier_wait(&bar, &sense, n);
      gemm_part(attn, w_o, h, T, nq, d, tid, n);
      barrier_wait(&bar, &sense, n);
      if (tid == 0) {
        for (int64_t i = 0; i < T * d; i++) x[i] += h[i];
        rms_norm_rows(x, post_norm, h, T, d, eps);
      }
      barrier_wait(&bar, &sense, n);
      gemm_part(h, w_gate_up, gu, T, d, 2 * inter, tid, n);
      barrier_wait(&bar, &sense, n);
      for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * inter, *u = g + inter;
        float *a = act + t * inter;
        int64_t chunk = (inter + n - 1) / n, lo = tid * chunk, hi = lo + chunk < inter ? lo + chunk : inter;
        silu_mul_range(g, u, a, lo, hi);
      }
      barrier_wait(&bar, &sense, n);
      gemm_part(act, w_down, h, T, inter, d, tid, n);
      barrier_wait(&bar, &sense, n);
      if (tid == 0) {
        for (int64_t i = 0; i < T * d; i++) x[i] += h[i];
        if (is_hidden[l]) memcpy(hidden + l * T * d, x, (size_t)(T * d) * sizeof(float));
      }
      barrier_wait(&bar, &sense, n);
    }
  }
}

/* ---- The plain sampler's passes over whole rows (spec/nucleus.py), rows in parallel. ----
 * Row r of logits (rows, V), fp32 or bf16: its argmax (first of equal maxima), the total of
 * w_j = exp((x_j - max) / temp[r]) (fp32 terms summed in double), and the candidates j with
 * w_j > frac[r] * total, in ascending j, up to `cap` of them (cand_count[r] is the full count: a row with more
 * is the caller's to take another way). temp[r] = 0 marks a greedy row: its argmax only. scratch: nt * V
 * floats. One read of the row and two passes over an fp32 copy in cache, where PyTorch took ~9 passes. */
void nucleus_candidates(int64_t rows, int64_t V, const void *logits, int64_t bf16, const float *temp,
                        const double *frac, int64_t *argmax, double *total, int64_t cap, int32_t *cand_idx,
                        float *cand_w, int64_t *cand_count, float *scratch, int64_t nt) {
#pragma omp parallel num_threads(nt)
  {
    float *w = scratch + (int64_t)omp_get_thread_num() * V;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; r++) {
      if (bf16)
        as_f32(logits, r * V, V, w, 1);
      else
        memcpy(w, (const float *)logits + r * V, (size_t)V * sizeof(float));
      float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
      for (int64_t j = 0; j < V; j++) mx = w[j] > mx ? w[j] : mx;
      int64_t best = 0;
      while (best < V - 1 && w[best] != mx) best++;
      argmax[r] = best;
      cand_count[r] = 0;
      total[r] = 0.0;
      float tr = temp[r];
      if (tr == 0.f) continue;
      double sum = 0.0;
      int64_t j = 0;
      for (; j + 16 <= V; j += 16) {
        vf16 e = exp_le0((*(vf16 *)(w + j) - mx) / tr);
        *(vf16 *)(w + j) = e;
        float part = 0.f;
        for (int i = 0; i < 16; i++) part += e[i];
        sum += part;
      }
      for (; j < V; j++) {
        vf16 t = {0};
        t[0] = (w[j] - mx) / tr;
        t = exp_le0(t);
        w[j] = t[0];
        sum += t[0];
      }
      total[r] = sum;
      float thr = (float)(frac[r] * sum);
      int64_t count = 0;
      for (j = 0; j < V; j += 16) {
        int64_t end = j + 16 < V ? j + 16 : V;
        int any = 0;
        for (int64_t i = j; i < end; i++) any |= w[i] > thr;
        if (!any) continue;
        for (int64_t i = j; i < end; i++)
          if (w[i] > thr) {
            if (count < cap) {
              cand_idx[r * cap + count] = (int32_t)i;
              cand_w[r * cap + count] = w[i];
            }
            count++;
          }
      }
      cand_count[r] = count;
    }
  }
}

/* ---- Rotary embedding and the K/V cache write of a step, in place on its q|k|v rows (fp32 or bf16). ----
 * qkv (T, (num_heads + 2 num_kv_heads) * hd): q and k heads rotated by cos/sin (T, hd; HF's rotate_half pairs
 * i and i + hd / 2), computed in fp32 and rounded once; k and v then copied to cache row cache_row[t] of the
 * (rows, num_kv_heads, hd) caches. Replaces ~8 PyTorch ops a layer (mul, neg, cat, add, the index copies). */
static inline __attribute__((always_inline)) void rotary_write_generic(
    int64_t T, void *qkv, const void *cos, const void *sin, void *k_cache, void *v_cache, const int64_t *cache_row,
    int64_t num_heads, int64_t num_kv_heads, int64_t hd, int64_t nt, int bf16) {
  int64_t width = (num_heads + 2 * num_kv_heads) * hd, nkv = num_kv_heads * hd, half = hd / 2;
  size_t esize = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    float cbuf[ATTN_MAX_HD], sbuf[ATTN_MAX_HD], v[ATTN_MAX_HD], out[ATTN_MAX_HD];
    const float *c = as_f32(cos, t * hd, hd, cbuf, bf16), *s = as_f32(sin, t * hd, hd, sbuf, bf16);
    for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {
      int64_t at = t * width + h * hd;
      const float *x = as_f32(qkv, at, hd, v, bf16);
      for (int64_t i = 0; i < half; i++) {
        out[i] = x[i] * c[i] - x[i + half] * s[i];
        out[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
      }
      if (bf16)
        for (int64_t i = 0; i < hd; i++) ((uint16_t *)qkv)[at + i] = f32_to_bf16(out[i]);
      else
        memcpy((float *)qkv + at, out, (size_t)hd * sizeof(float));
    }
    char *row = (char *)qkv + (t * width + num_heads * hd) * esize;
    memcpy((char *)k_cache + cache_row[t] * nkv * esize, row, (size_t)nkv * esize);
    memcpy((char *)v_cache + cache_row[t] * nkv * esize, row + nkv * esize, (size_t)nkv * esize);
  }
}

void rotary_cache_write(int64_t T, void *qkv, const void *cos, const void *sin, void *k_cache, void *v_cache,
                        const int64_t *cache_row, int64_t num_heads, int64_t num_kv_heads, int64_t hd, int64_t bf16,
                        int64_t nt) {
  if (bf16)
    rotary_write_generic(T, qkv, cos, sin, k_cache, v_cache, cache_row, num_heads, num_kv_heads, hd, nt, 1);
  else
    rotary_write_generic(T, qkv, cos, sin, k_cache, v_cache, cache_row, num_heads, num_kv_heads, hd, nt, 0);
}

/* ---- The MLP's SiLU(gate) * up for fp32 rows gate_up (T, 2 inter) -> out (T, inter), rows in parallel. ---- */
void silu_mul_f32(int64_t T, const float *gate_up, float *out, int64_t inter, int64_t nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t t = 0; t < T; t++)
    silu_mul_range(gate_up + t * 2 * inter, gate_up + t * 2 * inter + inter, out + t * inter, 0, inter);
}

/* ---- RMSNorm of fp32 rows x (T, d) with weight w -> out, rows in parallel. ---- */
void rms_norm_f32(int64_t T, const float *x, const float *w, float *out, int64_t d, float eps, int64_t nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t t = 0; t < T; t++) rms_norm_rows(x + t * d, w, out + t * d, 1, d, eps);
}

/* ---- bf16 rows: RMSNorm (of x + r where a residual r is given), bit for bit as PyTorch's CPU ops round it. ----
 * F.rms_norm on bf16 rows is a composite of ~10 ops on the CPU (each a dispatch and an allocation: ~50-70 us a
 * call at 16-32 rows of 576, two calls a layer), and the add before it one more. Here one pass does both, and its
 * result is PyTorch's to the bit, because a norm that rounds one element in a million the other way moves greedy
 * texts (session 46: the same kernel with a plain sum of squares moved 13 of 18 texts within 128 tokens). The
 * order PyTorch rounds in: the residual sum rounded to bf16 (an elementwise add); the row widened to fp32 and
 * squared; the squares summed as aten's CPU sum reduces a contiguous fp32 row (`aten_order_sum`); ÷ d, + eps,
 * 1 / sqrt; (x · rrms) · w in fp32, rounded once to bf16. `lanes` is the vector width of the sum kernel torch
 * dispatched to on this machine (`native.torch_sum_lanes` finds it by comparing sums; it is not the ISA's).
 * No fused multiply-adds here: each product is rounded before it is added, as in PyTorch. */
#define SUM_LEVELS 4
#define SUM_ILP 4
#define SUM_MAX_LANES 16
#define ROWS_SERIAL_WORK 4096 /* elements: below this, no parallel region */

static inline int64_t ceil_log2(int64_t x) { /* aten's utils::CeilLog2 */
  if (x <= 2) return 1;
  int64_t b = 0;
  for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) b++;
  return b;
}

/* The SUM_ILP × lanes partial sums of `size` groups of SUM_ILP vectors of `lanes` floats (group i at
 * a + i · SUM_ILP · lanes): each element a running sum, but of chunks of 2^p groups added into the next level and
 * so on (aten's cascade: only sums of similar size are added), p = max(4, ceil(log2 size) / SUM_LEVELS). */
__attribute__((optimize("fp-contract=off"))) static void cascade_partials(const float *restrict a, int64_t size,
                                                                        int64_t lanes, float *restrict out) {
  const int64_t width = SUM_ILP * lanes, power = ceil_log2(size) / SUM_LEVELS > 4 ? ceil_log2(size) / SUM_LEVELS : 4;
  const int64_t step = (int64_t)1 << power, mask = step - 1;
  float acc[SUM_LEVELS][SUM_ILP * SUM_MAX_LANES] = {{0.f}};
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; j++, i++)
      for (int64_t e = 0; e < width; e++) acc[0][e] += a[i * width + e];
    for (int64_t level = 1; level < SUM_LEVELS; level++) {
      for (int64_t e = 0; e < width; e++) {
        acc[level][e] += acc[level - 1][e];
        acc[level - 1][e] = 0.f;
      }
      if (i & (mask << (level * power))) break;
    }
  }
  for (; i < size; i++)
    for (int64_t e = 0; e < width; e++) acc[0][e] += a[i * width + e];
  for (int64_t level = 1; level < SUM_LEVELS; level++)
    for (int64_t e = 0; e < width; e++) acc[0][e] += acc[level][e];
  memcpy(out, acc[0], sizeof(float) * (size_t)width);
}

/* The sum of a[0..n) as aten's CPU sum reduces a contiguous fp32 row with vectors of `lanes` floats: rows of at
 * least `lanes` as vectors (SUM_ILP interleaved vector sums, the leftover vectors into the first, those folded
 * lane-wise, then the leftover scalars and the lanes one by one from 0); shorter rows as scalars, the same way. */
__attribute__((optimize("fp-contract=off"))) static float aten_order_sum(const float *restrict a, int64_t n,
                                                                       int64_t lanes) {
  if (n < lanes) lanes = 1;
  float part[SUM_ILP * SUM_MAX_LANES];
  const int64_t vecs = n / lanes, groups = vecs / SUM_ILP;
  cascade_partials(a, groups, lanes, part);
  for (int64_t v = groups * SUM_ILP; v < vecs; v++)
    for (int64_t l = 0; l < lanes; l++) part[l] += a[v * lanes + l];
  for (int64_t k = 1; k < SUM_ILP; k++)
    for (int64_t l = 0; l < lanes; l++) part[l] += part[k * lanes + l];
  if (lanes == 1) return part[0];
  float total = 0.f;
  for (int64_t i = vecs * lanes; i < n; i++) total += a[i];
  for (int64_t l = 0; l < lanes; l++) total += part[l];
  return total;
}

/* Row sums of fp32 rows (T, n) in aten's order: how `native.torch_sum_lanes` matches `lanes` to torch.sum. */
void aten_order_row_sums(int64_t T, const float *x, float *out, int64_t n, int64_t lanes) {
  for (int64_t t = 0; t < T; t++) out[t] = aten_order_sum(x + t * n, n, lanes);
}

__attribute__((optimize("fp-contract=off"))) static void rms_norm_row_bf16(
    uint16_t *restrict sum, const uint16_t *restrict x, const uint16_t *restrict r, const uint16_t *restrict w,
    uint16_t *restrict out, int64_t d, float eps, int64_t lanes, float *restrict row, float *restrict sq) {
  if (r)
    for (int64_t i = 0; i < d; i++) {
      uint16_t h = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(r[i]));
      sum[i] = h;
      row[i] = bf16_to_f32(h);
    }
  else
    for (int64_t i = 0; i < d; i++) row[i] = bf16_to_f32(x[i]);
  for (int64_t i = 0; i < d; i++) sq[i] = row[i] * row[i];
  const float inv = 1.0f / sqrtf(aten_order_sum(sq, d, lanes) / (float)d + eps);
  for (int64_t i = 0; i < d; i++) out[i] = f32_to_bf16(row[i] * inv * bf16_to_f32(w[i]));
}

static void rms_norm_rows_bf16(int64_t T, uint16_t *sum, const uint16_t *x, const uint16_t *r, const uint16_t *w,
                               uint16_t *out, int64_t d, float eps, int64_t lanes, atomic_llong *next) {
  float *buf = malloc(sizeof(float) * 2 * (size_t)d);
  for (int64_t t = next ? atomic_fetch_add(next, 1) : 0; t < T; t = next ? atomic_fetch_add(next, 1) : t + 1)
    rms_norm_row_bf16(r ? sum + t * d : NULL, x + t * d, r ? r + t * d : NULL, w, out + t * d, d, eps, lanes, buf,
                      buf + d);
  free(buf);
}

/* out = RMSNorm(x) · w over bf16 rows (T, d); with r (not NULL), sum = x + r first and out = RMSNorm(sum) · w.
 * Rows go from a shared counter where the work pays for a parallel region (a prompt's rows); below that one
 * thread does them all (a region costs more than a few dozen rows take). */
void rms_norm_bf16(int64_t T, const uint16_t *x, const uint16_t *r, uint16_t *sum, const uint16_t *w,
                   uint16_t *out, int64_t d, float eps, int64_t lanes, int64_t nt) {
  if (nt <= 1 || T < 2 || T * d < ROWS_SERIAL_WORK) {
    rms_norm_rows_bf16(T, sum, x, r, w, out, d, eps, lanes, NULL);
    return;
  }
  atomic_llong next = 0;
#pragma omp parallel num_threads(nt)
  rms_norm_rows_bf16(T, sum, x, r, w, out, d, eps, lanes, &next);
}

/* ---- bf16 rows: SiLU(gate) · up, PyTorch's to the bit. ----
 * PyTorch computes a bf16 SiLU in fp32 with its own vectorised exp and rounds it to bf16; the product with up is
 * then rounded once more (three ops with the chunk: ~10-20 us a layer at 1-16 rows, mostly dispatch). A bf16 SiLU
 * has only 65536 inputs, so `table` holds PyTorch's own result for each (widened to fp32: `native.silu_bf16_table`
 * builds it with F.silu at start-up): looked up, multiplied by up (exact in fp32: two 8-bit significands) and
 * rounded to nearest even, as PyTorch's bf16 multiply rounds. */
#define SILU_SERIAL_WORK 16384 /* elements: below this, no parallel region */

static void silu_mul_row_bf16(const uint16_t *restrict g, const uint16_t *restrict u, uint16_t *restrict o,
                              int64_t n, const float *restrict table, float *restrict prod) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) {
    __m512 s = _mm512_i32gather_ps(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(g + i))), table, 4);
    _mm512_storeu_ps(prod + i, _mm512_mul_ps(s, widen16_bf16(u + i)));
  }
#endif
  for (; i < n; i++) prod[i] = table[g[i]] * bf16_to_f32(u[i]);
  for (int64_t j = 0; j < n; j++) o[j] = f32_to_bf16(prod[j]);
}

static void silu_mul_rows_bf16(int64_t T, const uint16_t *gate_up, uint16_t *out, int64_t inter, const float *table,
                               atomic_llong *next) {
  float *prod = malloc(sizeof(float) * (size_t)inter);
  for (int64_t t = next ? atomic_fetch_add(next, 1) : 0; t < T; t = next ? atomic_fetch_add(next, 1) : t + 1)
    silu_mul_row_bf16(gate_up + t * 2 * inter, gate_up + t * 2 * inter + inter, out + t * inter, inter, table, prod);
  free(prod);
}

/* out (T, inter) = SiLU(gate) · up of bf16 rows gate_up (T, 2 inter) laid out gate | up (see above). */
void silu_mul_bf16(int64_t T, const uint16_t *gate_up, uint16_t *out, int64_t inter, const float *table, int64_t nt) {
  if (nt <= 1 || T < 2 || T * inter < SILU_SERIAL_WORK) {
    silu_mul_rows_bf16(T, gate_up, out, inter, table, NULL);
    return;
  }
  atomic_llong next = 0;
#pragma omp parallel num_threads(nt)
  silu_mul_rows_bf16(T, gate_up, out, inter, table, &next);
}

/* ---- Greedy acceptance's argmax over rows of logits, as torch.max(dim=-1).indices gives it. ----
 * Each row: the index of its largest value, the first of equal maxima (-0 and +0 equal); a row holding a NaN gives
 * its first NaN (torch's max propagates NaN). fp32 or bf16 rows (row stride `stride` elements). PyTorch's max over
 * a verify step's rows of 49,152 bf16 logits took 0.37 ms at 8 rows and 0.58 at 15 on a Zen 4: a pass that widens
 * 16 values at a time and keeps a vector of maxima, then one that finds the first equal, rows shared by threads. */
static inline float logit_at(const void *row, int64_t i, int bf16) {
  return bf16 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

static int64_t argmax_row(const void *row, int64_t n, int bf16) {
  float mx = -INFINITY;
  int nan = 0;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 vmx = _mm512_set1_ps(-INFINITY);
  __mmask16 vnan = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v = bf16 ? widen16_bf16((const uint16_t *)row + i) : _mm512_loadu_ps((const float *)row + i);
    vnan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmx = _mm512_max_ps(vmx, v);
  }
  nan = vnan != 0;
  mx = _mm512_reduce_max_ps(vmx);
#endif
  for (; i < n; i++) {
    float v = logit_at(row, i, bf16);
    nan |= v != v;
    mx = v > mx ? v : mx;
  }
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512 target = _mm512_set1_ps(mx);
  for (; j + 16 <= n; j += 16) {
    __m512 v = bf16 ? widen16_bf16((const uint16_t *)row + j) : _mm512_loadu_ps((const float *)row + j);
    __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz((unsigned)hit);
  }
#endif
  for (; j < n; j++) {
    float v = logit_at(row, j, bf16);
    if (nan ? v != v : v == mx) return j;
  }
  return 0; /* a row of -inf only: its first */
}

void argmax_rows(int64_t T, const void *x, int64_t n, int64_t stride, int64_t bf16, int64_t *out, int64_t nt) {
#pragma omp parallel for num_threads(T > 1 && nt > 1 ? nt : 1) schedule(static)
  for (int64_t t = 0; t < T; t++)
    out[t] = argmax_row((const char *)x + t * stride * (bf16 ? 2 : 4), n, (int)bf16);
}

/* dst (cols, rows) = src (rows, cols; row stride src_stride) transposed, for elements of 2 or 4 bytes. The LM
 * head's W @ xᵀ leaves a step's logits as (V, T) and every consumer reduces over one token's row (argmax,
 * sampling): PyTorch's strided copy of that bf16 view ran at ~0.6 GB/s (10 ms for 60 x 49,152 on one AMX Xeon
 * core, as long as the GEMM three times over). Tiles of 64 x 64 keep both sides' cache lines in L1. */
#define TRANSPOSE_TILE 64
#define TRANSPOSE_BODY(T)                                                                                      \
  {                                                                                                            \
    const T *s = (const T *)src;                                                                               \
    T *d = (T *)dst;                                                                                           \
    int64_t tiles_r = (rows + TRANSPOSE_TILE - 1) / TRANSPOSE_TILE;                                            \
    int64_t tiles_c = (cols + TRANSPOSE_TILE - 1) / TRANSPOSE_TILE;                                            \
    _Pragma("omp parallel for num_threads(nt) schedule(static)")                                               \
    for (int64_t tile = 0; tile < tiles_r * tiles_c; tile++) {                                                 \
      int64_t r0 = (tile / tiles_c) * TRANSPOSE_TILE, c0 = (tile % tiles_c) * TRANSPOSE_TILE;                  \
      int64_t r1 = r0 + TRANSPOSE_TILE < rows ? r0 + TRANSPOSE_TILE : rows;                                    \
      int64_t c1 = c0 + TRANSPOSE_TILE < cols ? c0 + TRANSPOSE_TILE : cols;                                    \
      for (int64_t c = c0; c < c1; c++)                                                                        \
        for (int64_t r = r0; r < r1; r++) d[c * rows + r] = s[r * src_stride + c];                             \
    }                                                                                                          \
  }

void transpose_2byte(const void *src, void *dst, int64_t rows, int64_t cols, int64_t src_stride, int64_t nt)
    TRANSPOSE_BODY(uint16_t)

void transpose_4byte(const void *src, void *dst, int64_t rows, int64_t cols, int64_t src_stride, int64_t nt)
    TRANSPOSE_BODY(uint32_t)
