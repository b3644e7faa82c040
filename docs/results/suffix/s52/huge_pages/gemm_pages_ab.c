/* Session 52: the AVX512-BF16 GEMM (`gemm_dpbf16`) over weights of SmolLM2-135M's shapes (30 layers' fused qkv 960 x
 * 576, o 576 x 576, gate_up 3072 x 576, down 576 x 1536, and the 49152 x 576 head; random bf16 values, packed with
 * `amx_pack_bf16`) on 4 KiB pages and on huge pages (2 MiB-aligned, madvise(MADV_HUGEPAGE)), one library or several
 * built from different sources, all in one process: at each row count every (library, pages) variant runs all the
 * GEMMs once per turn, the order rotated per turn; medians of ROUNDS turns, and each over the first variant's.
 * Columns: lib1 4 KiB, lib1 huge, lib2 4 KiB, lib2 huge, ... SHARED=1: every layer reads layer 0's weights (they sit
 * in L3: the compute alone, no head). 2 threads. Build and run (Zen 4 EPYC: see docs/results/suffix/README.md):
 *   F="-O3 -march=native -fopenmp -funroll-loops -ffp-contract=fast -std=gnu11 -shared -fPIC"
 *   gcc $F dspark/kernels/native_kernels.c -o /tmp/head.so -lm
 *   gcc -O2 docs/results/suffix/s52/huge_pages/gemm_pages_ab.c -o /tmp/gemm_pages_ab -ldl
 *   /tmp/gemm_pages_ab 1,4,8,12,16,24,32 21 /tmp/head.so [/tmp/other.so ...] */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

typedef void (*gemm_t)(const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t, int64_t, int64_t);
typedef void (*pack_t)(const uint16_t *, uint16_t *, int64_t, int64_t);
typedef struct {
  int64_t N, K;
  uint16_t *p;
} W;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s ROWS,... ROUNDS lib.so [lib.so ...]\n", argv[0]);
    return 2;
  }
  int rows[32], nr = 0;
  for (char *tok = strtok(argv[1], ","); tok && nr < 32; tok = strtok(NULL, ",")) rows[nr++] = atoi(tok);
  int rounds = atoi(argv[2]), nlib = argc - 3, nv = 2 * nlib;
  if (rounds < 1 || rounds > 64 || nlib > 4) {
    fprintf(stderr, "1-64 rounds, at most 4 libraries\n");
    return 2;
  }
  gemm_t g[4];
  pack_t pk = NULL;
  for (int i = 0; i < nlib; i++) {
    void *h = dlopen(argv[3 + i], RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      fprintf(stderr, "%s\n", dlerror());
      return 1;
    }
    g[i] = (gemm_t)dlsym(h, "gemm_dpbf16");
    if (!pk) pk = (pack_t)dlsym(h, "amx_pack_bf16");
  }
  const int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
  W w[121], wh[121];
  int nw = 0, shared = getenv("SHARED") != NULL;
  for (int l = 0; l < 30; l++)
    for (int s = 0; s < 4; s++) w[nw].N = shapes[s][0], w[nw].K = shapes[s][1], nw++;
  if (!shared) w[nw].N = 49152, w[nw].K = 576, nw++;
  for (int i = 0; i < nw; i++) {
    if (shared && i >= 4) {
      w[i].p = w[i % 4].p, wh[i] = w[i], wh[i].p = wh[i % 4].p;
      continue;
    }
    int64_t n = w[i].N * w[i].K;
    size_t huge = ((n * 2 + (1 << 21) - 1) >> 21) << 21;
    uint16_t *raw = aligned_alloc(64, n * 2), *p = aligned_alloc(64, n * 2), *q = aligned_alloc(1 << 21, huge);
    madvise(q, huge, MADV_HUGEPAGE);
    for (int64_t j = 0; j < n; j++) raw[j] = 0x3c00 + (rand() & 0xff);
    pk(raw, p, w[i].N, w[i].K), pk(raw, q, w[i].N, w[i].K);
    w[i].p = p, wh[i] = w[i], wh[i].p = q;
    free(raw);
  }
  uint16_t *x = aligned_alloc(64, 256 * 1536 * 2), *y = aligned_alloc(64, 256 * 49152 * 2);
  for (int j = 0; j < 256 * 1536; j++) x[j] = 0x3c00 + (rand() & 0xff);
  for (int ri = 0; ri < nr; ri++) {
    int M = rows[ri] < 1 ? 1 : rows[ri] > 256 ? 256 : rows[ri];
    double t[8][64];
    for (int r = 0; r < rounds; r++)
      for (int v0 = 0; v0 < nv; v0++) {
        int v = (v0 + r) % nv;
        W *ws = v % 2 ? wh : w;
        double t0 = now();
        for (int i = 0; i < nw; i++) g[v / 2](x, ws[i].p, y, M, ws[i].K, ws[i].N, 2);
        t[v][r] = (now() - t0) * 1e3;
      }
    printf("M=%3d", M);
    double base = 0;
    for (int v = 0; v < nv; v++) {
      qsort(t[v], rounds, sizeof(double), cmp);
      double m = t[v][rounds / 2];
      if (!v) base = m;
      printf("  %7.3f (%.3f)", m, m / base);
    }
    printf("\n");
  }
  return 0;
}
