/* Native CPU kernels for the target runner's few-row steps (built by native.py with this machine's -march).
 *
 * A decode or verify step multiplies 1-16 rows by every weight: memory-bound, so what matters is reading
 * each weight once at the machine's streaming bandwidth. MKL's one-row fp32 path read weights at a fraction
 * of it on the CPUs measured (native.py's docstring has the figures). Every
 * output is one FMA chain over the inputs in order, whatever the row count: a row's result does not depend
 * on what else the step carries. Weights are packed once (native.py: pack) in blocks of 16 outputs.
 */
#include <stdint.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>


/* ---- fp32 GEMM on weights packed in column blocks: wp (out_pad / 16, in, 16), out_pad a multiple of the tile. ----
 * 16 outputs are one vector: y[r, o:o+16] += x[r, i] * wp[o/16, i, :], a plain FMA chain over i per output.
 * No horizontal sums (row-major dot products, tried first, spent ~40% of their time in them at 4-8 rows), the
 * weight tile is read once per 4 input rows, and every output is the same chain whatever the row count.
 */
typedef float vf16 __attribute__((vector_size(64), aligned(4)));
#ifdef __AVX512F__
#define NB 4 /* column blocks per tile: 4 x NB accumulators stay in registers (32 zmm with AVX-512) */
#else
#define NB 2 /* 16 ymm registers with AVX2 */
#endif

/* Outputs per tile, to which pack() pads the output dimension. */
int64_t native_tile_outputs(void) { return 16 * NB; }

/* Four input rows (missing ones repeat row 0, their sums are dropped) against NB blocks of 16 outputs. The
 * inputs are summed in runs of KB, each run's sum added to the output: the rounding error grows with
 * KB + in / KB terms instead of `in` (one chain over 1536 inputs drifted ~1e-5 from PyTorch's log-probs). */
#define KB 64
static inline void tile_f32(const float *const xr[4], int64_t in, const float *restrict b, float *restrict y,
                            int64_t ld, int64_t nr) {
  for (int64_t i0 = 0; i0 < in; i0 += KB) {
    int64_t i1 = i0 + KB < in ? i0 + KB : in;
    vf16 acc[4][NB];
    for (int r = 0; r < 4; r++)
      for (int c = 0; c < NB; c++) acc[r][c] = (vf16){0};
    for (int64_t i = i0; i < i1; i++) {
      vf16 w[NB];
      for (int c = 0; c < NB; c++) w[c] = *(const vf16 *)(b + c * in * 16 + i * 16);
      for (int r = 0; r < 4; r++) {
        float xv = xr[r][i];
        for (int c = 0; c < NB; c++) acc[r][c] += xv * w[c];
      }
    }
    for (int64_t r = 0; r < nr; r++)
      for (int c = 0; c < NB; c++) {
        vf16 *out = (vf16 *)(y + r * ld + c * 16);
        *out = i0 == 0 ? acc[r][c] : *out + acc[r][c];
      }
  }
}

/* Tiles [tid * chunk, ...) of y = x @ w^T: the part of thread tid of n (contiguous, for streaming). */
static void gemm_part(const float *restrict x, const float *restrict wp, float *restrict y, int64_t rows, int64_t in,
                      int64_t out, int64_t tid, int64_t n) {
  int64_t width = 16 * NB, num_tiles = (out + width - 1) / width, chunk = (num_tiles + n - 1) / n;
  int64_t lo = tid * chunk, hi = lo + chunk < num_tiles ? lo + chunk : num_tiles;
  float tail[4 * 16 * NB];
  for (int64_t p = lo; p < hi; p++) {
    const float *b = wp + p * NB * in * 16;
    int64_t o = width * p, cols = out - o < width ? out - o : width;
    for (int64_t r = 0; r < rows; r += 4) {
      int64_t nr = rows - r < 4 ? rows - r : 4;
      const float *xr[4];
      for (int64_t k = 0; k < 4; k++) xr[k] = x + (r + (k < nr ? k : 0)) * in;
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

/* Attention of T single tokens over their own cache slots, fp32. Query t (row t of q, stride q_stride, heads
 * contiguous) reads keys key_row[t] .. key_row[t] + num_keys[t] - 1 of the (rows, num_kv_heads, hd) cache.
 * The G query heads sharing a KV head are done together, so each cached key and value is read once per
 * token (the CPU SDPA kernel ran at ~1/7 of the read bandwidth on single-query rows). probs: scratch of
 * T * num_heads * max_keys floats. out: (T, num_heads * hd). Thread tid of n takes (token, KV head) items
 * tid, tid + n, ... */
static void attention_part(int64_t T, const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                           const int64_t *key_row, const int64_t *num_keys, float *out, float *probs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t hd, float scale, int64_t max_keys,
                           int64_t tid, int64_t nthr) {
  int64_t nkv = num_kv_heads * hd, group = num_heads / num_kv_heads;
  for (int64_t item = tid; item < T * num_kv_heads; item += nthr) {
    int64_t t = item / num_kv_heads, kvh = item % num_kv_heads, n = num_keys[t];
    const float *kb = k_cache + key_row[t] * nkv + kvh * hd, *vb = v_cache + key_row[t] * nkv + kvh * hd;
    float *p0 = probs + (t * num_heads + kvh * group) * max_keys;
    for (int64_t g = 0; g < group; g++) {
      const float *qh = q + t * q_stride + (kvh * group + g) * hd;
      float *p = p0 + g * max_keys;
      for (int64_t j = 0; j < n; j++) {
        const float *k = kb + j * nkv;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < hd; i++) s += qh[i] * k[i];
        p[j] = s * scale;
      }
    }
    float inv[64];
    for (int64_t g = 0; g < group; g++) {
      float *p = p0 + g * max_keys, mx = -INFINITY, sum = 0.f;
      for (int64_t j = 0; j < n; j++) mx = p[j] > mx ? p[j] : mx;
      for (int64_t j = 0; j < n; j++) {
        p[j] = expf(p[j] - mx);
        sum += p[j];
      }
      inv[g] = 1.0f / sum;
      float *o = out + t * num_heads * hd + (kvh * group + g) * hd;
      for (int64_t i = 0; i < hd; i++) o[i] = 0.f;
    }
    for (int64_t j = 0; j < n; j++) {
      const float *v = vb + j * nkv;
      for (int64_t g = 0; g < group; g++) {
        float pj = p0[g * max_keys + j] * inv[g];
        float *o = out + t * num_heads * hd + (kvh * group + g) * hd;
#pragma omp simd
        for (int64_t i = 0; i < hd; i++) o[i] += pj * v[i];
      }
    }
  }
}

void attention_f32(int64_t T, const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                   const int64_t *key_row, const int64_t *num_keys, float *out, float *probs, int64_t num_heads,
                   int64_t num_kv_heads, int64_t hd, float scale, int64_t max_keys, int64_t nt) {
#pragma omp parallel num_threads(nt)
  attention_part(T, q, q_stride, k_cache, v_cache, key_row, num_keys, out, probs, num_heads, num_kv_heads, hd, scale,
                 max_keys, omp_get_thread_num(), omp_get_num_threads());
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
                     scale, max_keys, tid, n);
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
        for (int64_t i = lo; i < hi; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
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
