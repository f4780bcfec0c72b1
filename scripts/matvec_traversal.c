// How the CPU's prefetchers take the CPU kernel's dense f32 traversal, against a plain
// row-streaming one, for y[M, N] = x[M, K] @ W[K, N] (W row-major): 30 distinct K x N matrices
// in turn (cache-cold, as a decode step's matmuls are), on 2 threads, measured alternately in
// one process so that a noisy host moves every variant alike.
//   B         K split between the threads; each thread reads its rows whole and contiguously,
//             4 at a time, into an L1 accumulator row; the two partial rows summed (M = 1 work
//             only, whatever M is given: a streaming reference, not a kernel).
//   kernel gR jaxdec_dense_raw from the kernel library (jaxdec/ops/csrc/qmatmul.cc), its
//             dense group set to R rows (JAXDEC_CPU_DENSE_GROUP): each 64-column chunk is read
//             down R rows at a time, so R read streams run side by side; with its software
//             prefetching (pf) and without (nopf, JAXDEC_CPU_PREFETCH=0).
// An ad-hoc probe for issue 3 (not built by make, not a test).  The kernel library is the one
// `python -c "from jaxdec.quant import cpu_kernel as c; print(c.info()['path'])"` prints:
//   gcc -O3 -march=native -fopenmp scripts/matvec_traversal.c -o /tmp/mv -ldl
//   /tmp/mv LIB [K N [M [matrices]]]        (default 576 1536 1 30)
// Session 19, AMD EPYC (Zen 4), best of 5 rounds, GB/s: 576x1536 B 29.0, g16 18.3, g8 26.5;
// 1536x576 25.7, 17.3, 24.4; 576x49152 (3 matrices) 34.4, 23.9, 29.7.
#include <dlfcn.h>
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void (*raw_fn)(const float*, const void*, float*, long long, long long, long long, int, int);
typedef void (*set_dense_fn)(int, int, int);
typedef void (*set_prefetch_fn)(int);

static int K = 576, N = 1536, M = 1, NM = 30;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// B: rows [k0, k1) streamed contiguously, 4 at a time, into acc[N] (L1).
static void rows_into_acc(const float* x, const float* W, float* acc, int k0, int k1) {
  for (int c = 0; c < N; c += 16) _mm512_storeu_ps(acc + c, _mm512_setzero_ps());
  for (int k = k0; k < k1; k += 4) {
    const float* w = W + (size_t)k * N;
    __m512 x0 = _mm512_set1_ps(x[k]), x1 = _mm512_set1_ps(x[k + 1]);
    __m512 x2 = _mm512_set1_ps(x[k + 2]), x3 = _mm512_set1_ps(x[k + 3]);
    for (int c = 0; c < N; c += 16) {
      __m512 a = _mm512_loadu_ps(acc + c);
      a = _mm512_fmadd_ps(x0, _mm512_loadu_ps(w + c), a);
      a = _mm512_fmadd_ps(x1, _mm512_loadu_ps(w + N + c), a);
      a = _mm512_fmadd_ps(x2, _mm512_loadu_ps(w + 2 * N + c), a);
      a = _mm512_fmadd_ps(x3, _mm512_loadu_ps(w + 3 * N + c), a);
      _mm512_storeu_ps(acc + c, a);
    }
  }
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s KERNEL_LIB [K N [M [matrices]]]\n", argv[0]);
    return 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW);
  if (!lib) {
    fprintf(stderr, "%s\n", dlerror());
    return 1;
  }
  raw_fn raw = (raw_fn)dlsym(lib, "jaxdec_dense_raw");
  set_dense_fn set_dense = (set_dense_fn)dlsym(lib, "jaxdec_qmm_set_dense");
  set_prefetch_fn set_prefetch = (set_prefetch_fn)dlsym(lib, "jaxdec_qmm_set_prefetch");
  if (argc > 3) K = atoi(argv[2]), N = atoi(argv[3]);
  if (argc > 4) M = atoi(argv[4]);
  if (argc > 5) NM = atoi(argv[5]);
  if (K % 8 || N % 16 || M < 1 || M > 8 || NM < 1) {
    fprintf(stderr, "K must be a multiple of 8, N of 16, 1 <= M <= 8\n");
    return 2;
  }
  enum { NV = 7 };
  const int groups[NV] = {0, 16, 16, 8, 8, 4, 4};  // 0: B
  const int prefetch[NV] = {0, 1, 0, 1, 0, 1, 0};
  float* Ws = aligned_alloc(64, (size_t)NM * K * N * 4);
  for (size_t i = 0; i < (size_t)NM * K * N; i++) Ws[i] = (float)(i % 7) * 0.1f;
  float* x = malloc((size_t)M * K * 4);
  for (int i = 0; i < M * K; i++) x[i] = 0.01f * (i % 97);
  float* y = aligned_alloc(64, (size_t)M * N * 4);
  float* acc = aligned_alloc(64, (size_t)2 * N * 4);
  char* flush = malloc(64 << 20);
  double best[NV] = {0};
  for (int round = 0; round < 5; round++) {
    for (int v = 0; v < NV; v++) {
      if (groups[v]) set_dense(groups[v], 0, -1), set_prefetch(prefetch[v]);
      memset(flush, round + v, 64 << 20);  // evict the matrices from the caches
      const double t = now();
      for (int it = 0; it < 5; it++)
        for (int m = 0; m < NM; m++) {
          const float* W = Ws + (size_t)m * K * N;
          if (groups[v]) {
            raw(x, W, y, M, K, N, 0, 0);
          } else {
#pragma omp parallel num_threads(2)
            {
              const int id = omp_get_thread_num();
              rows_into_acc(x, W, acc + id * N, id * K / 2, (id + 1) * K / 2);
            }
            for (int c = 0; c < N; c++) y[c] = acc[c] + acc[N + c];
          }
        }
      const double dt = (now() - t) / (5 * NM), gbs = (double)K * N * 4 / dt / 1e9;
      if (gbs > best[v]) best[v] = gbs;
    }
  }
  printf("%dx%d, M=%d, %d matrices: best GB/s of 5 rounds\n", K, N, M, NM);
  for (int v = 0; v < NV; v++) {
    if (groups[v])
      printf("  kernel g%-2d %s %5.1f\n", groups[v], prefetch[v] ? "  pf" : "nopf", best[v]);
    else
      printf("  B rows          %5.1f\n", best[v]);
  }
  return 0;
}
