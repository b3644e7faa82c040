/* Native CPU kernels for the target runner's few-row steps (built by native.py with this machine's -march).
 *
 * A decode or verify step multiplies 1-16 rows by every weight: memory-bound, so what matters is reading
 * each weight once at the machine's streaming bandwidth. MKL's one-row fp32 path read weights at a fraction
 * of it on the CPUs measured (native.py's docstring has the figures). Every output row here is one dot
 * product of a weight row with one input row, reduced in the same order whatever the row count: a row's
 * result does not depend on what else the step carries.
 */
#include <stdint.h>
#include <math.h>
#include <string.h>

#define ROW_BLOCK 16 /* weight rows per OpenMP work item */

static inline float dot_f32(const float *restrict w, const float *restrict x, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; i++) acc += w[i] * x[i];
  return acc;
}

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline float dot_bf16(const uint16_t *restrict w, const float *restrict x, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; i++) acc += bf16_to_f32(w[i]) * x[i];
  return acc;
}

/* Four input rows against one weight row: the weight row is loaded once for all four. */
static inline void dot4_f32(const float *restrict w, const float *restrict x, int64_t n, float *restrict out,
                            int64_t stride) {
  const float *x0 = x, *x1 = x + n, *x2 = x + 2 * n, *x3 = x + 3 * n;
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
  for (int64_t i = 0; i < n; i++) {
    float wi = w[i];
    a0 += wi * x0[i];
    a1 += wi * x1[i];
    a2 += wi * x2[i];
    a3 += wi * x3[i];
  }
  out[0] = a0;
  out[stride] = a1;
  out[2 * stride] = a2;
  out[3 * stride] = a3;
}

static inline void dot4_bf16(const uint16_t *restrict w, const float *restrict x, int64_t n, float *restrict out,
                             int64_t stride) {
  const float *x0 = x, *x1 = x + n, *x2 = x + 2 * n, *x3 = x + 3 * n;
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
  for (int64_t i = 0; i < n; i++) {
    float wi = bf16_to_f32(w[i]);
    a0 += wi * x0[i];
    a1 += wi * x1[i];
    a2 += wi * x2[i];
    a3 += wi * x3[i];
  }
  out[0] = a0;
  out[stride] = a1;
  out[2 * stride] = a2;
  out[3 * stride] = a3;
}

/* y (rows, out) = x (rows, in) @ w (out, in)^T, all row-major fp32. */
void gemm_f32(const float *restrict x, const float *restrict w, float *restrict y, int64_t rows, int64_t in,
              int64_t out) {
#pragma omp parallel for schedule(static)
  for (int64_t ob = 0; ob < out; ob += ROW_BLOCK) {
    int64_t oe = ob + ROW_BLOCK < out ? ob + ROW_BLOCK : out;
    for (int64_t o = ob; o < oe; o++) {
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) dot4_f32(w + o * in, x + r * in, in, y + r * out + o, out);
      for (; r < rows; r++) y[r * out + o] = dot_f32(w + o * in, x + r * in, in);
    }
  }
}

/* The same with bf16 weights, fp32 activations and accumulation (the bulk generation path). */
void gemm_bf16w(const float *restrict x, const uint16_t *restrict w, float *restrict y, int64_t rows, int64_t in,
                int64_t out) {
#pragma omp parallel for schedule(static)
  for (int64_t ob = 0; ob < out; ob += ROW_BLOCK) {
    int64_t oe = ob + ROW_BLOCK < out ? ob + ROW_BLOCK : out;
    for (int64_t o = ob; o < oe; o++) {
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) dot4_bf16(w + o * in, x + r * in, in, y + r * out + o, out);
      for (; r < rows; r++) y[r * out + o] = dot_bf16(w + o * in, x + r * in, in);
    }
  }
}


/* Attention of T single tokens over their own cache slots, fp32. Query t (row t of q, stride q_stride, heads
 * contiguous) reads keys key_row[t] .. key_row[t] + num_keys[t] - 1 of the (rows, num_kv_heads, hd) cache.
 * The G query heads sharing a KV head are done together, so each cached key and value is read once per
 * token (the CPU SDPA kernel ran at ~1/7 of the read bandwidth on single-query rows). probs: scratch of
 * T * num_heads * max_keys floats. out: (T, num_heads * hd). */
void attention_f32(int64_t T, const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                   const int64_t *key_row, const int64_t *num_keys, float *out, float *probs, int64_t num_heads,
                   int64_t num_kv_heads, int64_t hd, float scale, int64_t max_keys) {
  int64_t nkv = num_kv_heads * hd, group = num_heads / num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) collapse(2)
  for (int64_t t = 0; t < T; t++) {
    for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
      int64_t n = num_keys[t];
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
}

/* ---- One Llama decoder layer for a few fp32 tokens, in place on x (the few-token step's fused path). ----
 * Token t sits at cache row cache_row[t] (slot * max_len + position) and attends to the num_keys[t] rows
 * from key_row[t] (its slot's first row): causal by position, since the step's K/V are written first.
 * cos/sin: (T, head_dim) rotary tables; HF's rotate_half convention (pairs i and i + head_dim / 2). */

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

void decoder_layer_f32(int64_t T, float *restrict x, float *restrict scratch, const float *in_norm,
                       const float *w_qkv, const float *w_o, const float *post_norm, const float *w_gate_up,
                       const float *w_down, float *k_cache, float *v_cache, const int64_t *cache_row,
                       const int64_t *key_row, const int64_t *num_keys, const float *cos, const float *sin,
                       int64_t d, int64_t num_heads, int64_t num_kv_heads, int64_t hd, int64_t inter, float eps,
                       float scale, int64_t max_keys) {
  int64_t nq = num_heads * hd, nkv = num_kv_heads * hd, nqkv = nq + 2 * nkv;
  /* scratch: h (T, d) | qkv (T, nqkv) | attn (T, nq) | gate_up (T, 2 inter) | act (T, inter) | probs */
  float *h = scratch, *qkv = h + T * d, *attn = qkv + T * nqkv, *gu = attn + T * nq, *act = gu + T * 2 * inter;
  float *probs = act + T * inter; /* (T * num_heads, max_keys) */

  rms_norm_rows(x, in_norm, h, T, d, eps);
  gemm_f32(h, w_qkv, qkv, T, d, nqkv);
  for (int64_t t = 0; t < T; t++) {
    float *row = qkv + t * nqkv;
    for (int64_t hh = 0; hh < num_heads + num_kv_heads; hh++) rotate(row + hh * hd, cos + t * hd, sin + t * hd, hd);
    memcpy(k_cache + cache_row[t] * nkv, row + nq, (size_t)nkv * sizeof(float));
    memcpy(v_cache + cache_row[t] * nkv, row + nq + nkv, (size_t)nkv * sizeof(float));
  }
  attention_f32(T, qkv, nqkv, k_cache, v_cache, key_row, num_keys, attn, probs, num_heads, num_kv_heads, hd, scale,
                max_keys);
  gemm_f32(attn, w_o, h, T, nq, d);
  for (int64_t i = 0; i < T * d; i++) x[i] += h[i];
  rms_norm_rows(x, post_norm, h, T, d, eps);
  gemm_f32(h, w_gate_up, gu, T, d, 2 * inter);
  for (int64_t t = 0; t < T; t++) {
    const float *g = gu + t * 2 * inter, *u = g + inter;
    float *a = act + t * inter;
    for (int64_t i = 0; i < inter; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
  }
  gemm_f32(act, w_down, h, T, inter, d);
  for (int64_t i = 0; i < T * d; i++) x[i] += h[i];
}
