// jaxdec CPU kernel: y f32[M, N] = x f32[M, K] @ W, with W stored quantised or dense.
//
// Weight formats (the quantised one is the fixed contract shared with the Python QArray type):
//   bits=8: q int8[K, N]
//   bits=4: q uint8[K/2, N]; byte (i, n) holds the code of row 2i in its low nibble and
//           row 2i+1 in its high nibble; codes are unsigned 0..15.
//   scale float16[K/g, N]; offset float16[K/g, N] or absent.
//   W[k, n] = q[k, n] * scale[k/g, n] + offset[k/g, n]
// so per group:  y[n] += scale[g, n] * sum_k x[k] q[k, n] + offset[g, n] * sum_k x[k].
//   dense: W float32[K, N] or bfloat16[K, N] itself (the same code with scale 1, no offset, and
//   "groups" that only block K, the last one possibly short).
//
// The AVX-512 path widens the codes to f32 (int8: vpmovsxbd + vcvtdq2ps; int4: vpmovzxbd and a
// 16-entry vpermps table per nibble; bf16: a shift or a mask of each 32-bit lane, exact, see
// load32_bf16) and FMAs them against broadcast x.  M <= 8: per-group register accumulators for
// an M-block of up to 6 rows (int4: 4) x 64 columns, scale/offset applied at the end of each group.
// M > 8: each group's 64-column chunk is widened once into an L1 panel and consumed by blocks of
// 6 rows.  No quantisation of x: the only error is f32 rounding.  A portable scalar path is used
// when the CPU lacks AVX-512 (chosen at run time; the AVX-512 functions carry target attributes,
// so the library builds with plain -O3 and runs anywhere).
//
// Work is split over N (in chunks of 64-column multiples) between the calling thread and a
// small persistent pool of workers that spin for a while after each job and then sleep on a
// condvar; chunks are claimed dynamically (see Pool), and the pool backs off to one thread when
// the machine is oversubscribed (see Adaptive).  Columns never depend on the split, so results
// are bitwise identical for any thread count.  Dense matrices with short rows and M <= 8 are
// split over K instead (slabs of rows, each a contiguous stretch of memory; see slab_count):
// the partial products are summed in slab order, and the slabs depend on W's shape only, so
// these results too are the same for any thread count, and a row's sums do not depend on M.
//
// Exported:
//   jaxdec_qmatmul            the XLA FFI handler for quantised W (typed API)
//   jaxdec_dense_matmul       the XLA FFI handler for dense W
//   jaxdec_qmm_*, jaxdec_dense_raw   small C helpers for tuning, benchmarks and tests (ctypes)

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#include <time.h>
#endif

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(QMM_PORTABLE_ONLY)
#define QMM_X86 1
#include <immintrin.h>
#else
#define QMM_X86 0
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------------------------------------
// Job description
// ---------------------------------------------------------------------------------------------

// How W is stored.  Quantised formats (q, scale[, offset]) and dense ones (W itself; no scale).
enum Fmt : int { kInt8 = 0, kInt4 = 1, kF32 = 2, kBF16 = 3 };

struct Job {
  const float* x;        // [M, K]
  const float* xsum;     // [M, G]  sums of x over each group (only when has_off)
  const uint8_t* q;      // int8 [K, N], packed uint8 [K/2, N], f32 [K, N] or bf16 [K, N]
  const uint16_t* scale; // f16 bits [G, N]; null for the dense formats (scale 1)
  const uint16_t* off;   // f16 bits [G, N] or null
  float* y;              // [M, N]
  // g: rows per group; for the dense formats a blocking of K only (the last block may be
  // short), G = ceil(K / g).
  int64_t M, K, N, G, g;
  int64_t units;         // ceil(N / 16)
  // Work items the pool hands out (column units, or K slabs), in chunks of chunk_units.
  int64_t items, chunk_units;
  // K-split (dense formats, few rows of x; items = slabs): slab s is groups
  // [s*G/slabs, (s+1)*G/slabs) over all columns, its partial product written to part + s*M*N;
  // the caller sums them in order.
  int64_t slabs;
  float* part;
  Fmt fmt;
  const void* ctx = nullptr;  // other jobs on the pool (decode attention: an AttnJob)
  // AMX path: x rounded to bf16, zero-padded to [Mp, Kp] (multiples of 16 and 32).
  const uint16_t* xb = nullptr;
  int64_t Mp = 0, Kp = 0;
};

inline bool is_dense(Fmt f) { return f == kF32 || f == kBF16; }
// Bytes of one stored row (int4: one packed row holds two rows of W).
inline int64_t elem_bytes(Fmt f) { return f == kF32 ? 4 : f == kBF16 ? 2 : 1; }
// Rows of W in group gi (the dense formats' last block may be short).
inline int64_t group_rows(const Job& J, int64_t gi) { return std::min(J.g, J.K - gi * J.g); }
inline int64_t weight_bytes(const Job& J) {
  return (J.fmt == kInt4 ? J.K / 2 : J.K) * J.N * elem_bytes(J.fmt);
}
// Row k of W (int4: the packed row holding it) from column c.
inline const uint8_t* row_ptr(const Job& J, int64_t k, int64_t c) {
  const int64_t srow = J.fmt == kInt4 ? k / 2 : k;
  return J.q + (srow * J.N + c) * elem_bytes(J.fmt);
}

int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  long r = std::strtol(v, &end, 10);
  if (end == v) return dflt;
  return static_cast<int>(r);
}

// Tuning knobs (environment at load time, or the jaxdec_qmm_* C helpers).
std::atomic<int> g_active_threads{0};  // cap on threads per call; 0: all the pool's
std::atomic<int> g_panel_min_m{env_int("JAXDEC_CPU_PANEL_MIN_M", 8)};  // M above: panel path
std::atomic<int> g_spin_us{env_int("JAXDEC_CPU_SPIN_US", 100)};        // worker spin before sleep
// Software prefetching of W (see prefetch_offset); 0 leaves it to the hardware prefetchers.
std::atomic<int> g_prefetch{env_int("JAXDEC_CPU_PREFETCH", 1)};
// Smaller matrices (code bytes x M) run on the calling thread alone.
std::atomic<int64_t> g_min_parallel_bytes{env_int("JAXDEC_CPU_MIN_PARALLEL_BYTES", 24 * 1024)};

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  uint32_t bits;
  if (e == 0) {
    if (m == 0) {
      bits = sign;
    } else {  // subnormal half: m * 2^-24
      float f = static_cast<float>(m) * 5.9604644775390625e-8f;
      std::memcpy(&bits, &f, 4);
      bits |= sign;
    }
  } else if (e == 31) {
    bits = sign | 0x7f800000u | (m << 13);
  } else {
    bits = sign | ((e + 112u) << 23) | (m << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Portable scalar path
// ---------------------------------------------------------------------------------------------

// Row k of W, columns [c, c + w), widened to f32 (the codes, before the group's scale).
void scalar_row(const Job& J, int64_t k, int64_t c, int64_t w, float* out) {
  const uint8_t* p = row_ptr(J, k, c);
  switch (J.fmt) {
    case kInt8:
      for (int64_t j = 0; j < w; ++j) out[j] = static_cast<float>(reinterpret_cast<const int8_t*>(p)[j]);
      break;
    case kInt4: {
      const int sh = static_cast<int>(k & 1) * 4;
      for (int64_t j = 0; j < w; ++j) out[j] = static_cast<float>((p[j] >> sh) & 15);
      break;
    }
    case kF32:
      std::memcpy(out, p, sizeof(float) * w);
      break;
    case kBF16:
      for (int64_t j = 0; j < w; ++j) {
        uint16_t h;
        std::memcpy(&h, p + 2 * j, 2);
        const uint32_t b = static_cast<uint32_t>(h) << 16;
        std::memcpy(&out[j], &b, 4);
      }
      break;
  }
}

void scalar_range(const Job& J, int64_t u0, int64_t u1) {
  const int64_t c_begin = u0 * 16;
  const int64_t c_end = std::min(u1 * 16, J.N);
  if (c_begin >= c_end) return;
  const int64_t N = J.N, K = J.K, g = J.g, G = J.G;
  for (int64_t m = 0; m < J.M; ++m)
    std::memset(J.y + m * N + c_begin, 0, sizeof(float) * (c_end - c_begin));
  float acc[64], sc[64], wr[64];
  for (int64_t c = c_begin; c < c_end; c += 64) {
    const int64_t w = std::min<int64_t>(64, c_end - c);
    for (int64_t gi = 0; gi < G; ++gi) {
      const int64_t rows = group_rows(J, gi);
      for (int64_t j = 0; j < w; ++j) sc[j] = J.scale ? half_to_float(J.scale[gi * N + c + j]) : 1.f;
      for (int64_t m = 0; m < J.M; ++m) {
        const float* xp = J.x + m * K + gi * g;
        for (int64_t j = 0; j < w; ++j) acc[j] = 0.f;
        for (int64_t kk = 0; kk < rows; ++kk) {
          scalar_row(J, gi * g + kk, c, w, wr);
          const float xk = xp[kk];
          for (int64_t j = 0; j < w; ++j) acc[j] += xk * wr[j];
        }
        float* yp = J.y + m * N + c;
        if (J.off) {
          const float xs = J.xsum[m * G + gi];
          const uint16_t* op = J.off + gi * N + c;
          for (int64_t j = 0; j < w; ++j) yp[j] += acc[j] * sc[j] + xs * half_to_float(op[j]);
        } else {
          for (int64_t j = 0; j < w; ++j) yp[j] += acc[j] * sc[j];
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512 path
// ---------------------------------------------------------------------------------------------

#if QMM_X86

#define QMM_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define QMM_INLINE inline __attribute__((always_inline))

#ifndef QMM_PREFETCH
#define QMM_PREFETCH 1
#endif
#ifndef QMM_INT4_LUT
#define QMM_INT4_LUT 1
#endif

// Software prefetch distance (bytes from the line being read).  A group's rows are read chunk
// by chunk (g lines at stride N per chunk); prefetching the same lines of the next group keeps
// the stream about one band-group ahead, which works while that is small (<= 128 KiB);
// for wider rows (LM heads) four chunks (256 bytes) ahead in the same row works better
// (measured on 576x1536, 1536x576, 896x4864, 4864x896 and 576x49152, cold caches).
// The dense formats use the same rule (their rows are 2-4x longer, so "next group" is within
// 128 KiB only for narrow matrices or short groups).
QMM_INLINE int64_t prefetch_offset(const Job& J, int64_t gi) {
  if (!g_prefetch.load(std::memory_order_relaxed)) return 0;
  const int64_t row_bytes = J.N * elem_bytes(J.fmt), rows = J.fmt == kInt4 ? J.g / 2 : J.g;
  if (rows * row_bytes <= 128 * 1024) return gi + 1 < J.G ? rows * row_bytes : 0;
  return 256;
}

// Prefetches the lines of [p, p + span) (span: the bytes of a stored row a chunk reads); the
// last byte too when the span is a line or more, in case it straddles one more line.
template <int64_t SPAN>
QMM_INLINE void prefetch_span(const uint8_t* p) {
#pragma GCC unroll 8
  for (int64_t o = 0; o < SPAN; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
  if (SPAN >= 64) _mm_prefetch(reinterpret_cast<const char*>(p + SPAN - 1), _MM_HINT_T0);
}

// Rows of W that one stored row holds (int4 packs two), and bytes per stored element.
template <Fmt F>
constexpr int kRowsPerLoad = F == kInt4 ? 2 : 1;
template <Fmt F>
constexpr int64_t kElemBytes = F == kF32 ? 4 : F == kBF16 ? 2 : 1;

// Widens 16 columns of a stored row, from p (the first lanes of `mask` only when `masked`), to
// f32: w[0], and w[1] (the odd row) for int4.  bf16 -> f32 is exact: the bits shifted up 16.
template <Fmt F>
QMM_TARGET QMM_INLINE void load16(const uint8_t* p, bool masked, __mmask16 mask, __m512* w) {
  if (F == kInt8 || F == kInt4) {
    const __m128i b =
        masked ? _mm_maskz_loadu_epi8(mask, p) : _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if (F == kInt8) {
      w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    } else {
      const __m512i d = _mm512_cvtepu8_epi32(b);
#if QMM_INT4_LUT
      // vpermps reads only the low 4 bits of each index: a 16-entry table lookup.
      const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      w[0] = _mm512_permutexvar_ps(d, lut);
      w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), lut);
#else
      w[0] = _mm512_cvtepi32_ps(_mm512_and_si512(d, _mm512_set1_epi32(15)));
      w[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4));
#endif
    }
  } else if (F == kF32) {
    const float* f = reinterpret_cast<const float*>(p);
    w[0] = masked ? _mm512_maskz_loadu_ps(mask, f) : _mm512_loadu_ps(f);
  } else {
    const __m256i h =
        masked ? _mm256_maskz_loadu_epi16(mask, p) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// bf16 tiles of whole 32-column pairs load 32 columns at once (see load32_bf16).
template <Fmt F, int NV, bool TAIL>
constexpr bool kPairs = F == kBF16 && NV % 2 == 0 && !TAIL;

// 32 bf16 columns from p, widened to f32 with one load and two integer ops (vpmovzxwd + shift
// per 16 columns costs half as much again): `even` holds columns 0, 2, .., 30 (the low halves
// of the 32-bit lanes shifted up), `odd` columns 1, 3, .., 31 (the high halves, masked).
QMM_TARGET QMM_INLINE void load32_bf16(const uint8_t* p, __m512& even, __m512& odd) {
  const __m512i v = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// One group `gi` of a band: `nchunks` column chunks of 16*NV columns starting at c0 (the last
// vector of the last chunk masked by tmask when TAIL), each for `mblocks` blocks of MB rows of
// x starting at m0.  Accumulates into y.  The chunk loop is outside the M-block loop so each
// chunk of W (g rows x 64 columns) is reused from L1 by every M-block.
template <int MB, int NV, Fmt F, bool OFF, bool TAIL>
QMM_TARGET void tile_avx512(const Job& J, int64_t m0, int64_t mblocks, int64_t c0, int64_t nchunks,
                            __mmask16 tmask, int64_t gi) {
  constexpr int R = kRowsPerLoad<F>;
  constexpr int64_t EB = kElemBytes<F>;
  const int64_t N = J.N, K = J.K, g = J.g, G = J.G;
  const int64_t rows = group_rows(J, gi), stride = N * EB;
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const int64_t c = c0 + ch * 16 * NV;
    const bool tail = TAIL && ch == nchunks - 1;
    // Scale / offset of this group and chunk (the dense formats: 1, none).
    __m512 s[NV], o[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      const bool mv = tail && v == NV - 1;
      o[v] = _mm512_setzero_ps();
      if (is_dense(F)) {
        s[v] = _mm512_set1_ps(1.f);
        continue;
      }
      const uint16_t* sp = J.scale + gi * N + c + 16 * v;
      s[v] = _mm512_cvtph_ps(mv ? _mm256_maskz_loadu_epi16(tmask, sp)
                                : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp)));
      if (OFF) {
        const uint16_t* op = J.off + gi * N + c + 16 * v;
        o[v] = _mm512_cvtph_ps(mv ? _mm256_maskz_loadu_epi16(tmask, op)
                                  : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(op)));
      }
    }
    for (int64_t mb = 0; mb < mblocks; ++mb) {
      const int64_t mr = m0 + mb * MB;
      __m512 acc[MB][NV];
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m)
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
      const float* xp = J.x + mr * K + gi * g;
      const uint8_t* qp = row_ptr(J, gi * g, c);
      const int64_t pf = mb != 0 ? 0 : prefetch_offset(J, gi);
      for (int64_t kk = 0; kk < rows; kk += R, qp += stride) {
        if (QMM_PREFETCH && pf) prefetch_span<16 * NV * EB>(qp + pf);
        __m512 w[NV][R];
        if (kPairs<F, NV, TAIL>) {
          // bf16, 32 columns per 512-bit load: w[v] the even columns, w[v+1] the odd ones.
#pragma GCC unroll 8
          for (int v = 0; v < NV; v += 2) load32_bf16(qp + 32 * v, w[v][0], w[v + 1][0]);
        } else {
#pragma GCC unroll 16
          for (int v = 0; v < NV; ++v) load16<F>(qp + 16 * v * EB, tail && v == NV - 1, tmask, w[v]);
        }
#pragma GCC unroll 16
        for (int m = 0; m < MB; ++m)
#pragma GCC unroll 2
          for (int r = 0; r < R; ++r) {
            const __m512 xb = _mm512_set1_ps(xp[m * K + kk + r]);
#pragma GCC unroll 16
            for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_fmadd_ps(xb, w[v][r], acc[m][v]);
          }
      }
      if (kPairs<F, NV, TAIL>) {
        // Back to column order: acc[v] columns 0..15 of the pair, acc[v+1] columns 16..31.
        const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
#pragma GCC unroll 16
        for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
          for (int v = 0; v < NV; v += 2) {
            const __m512 e = acc[m][v], o2 = acc[m][v + 1];
            acc[m][v] = _mm512_permutex2var_ps(e, lo, o2);
            acc[m][v + 1] = _mm512_permutex2var_ps(e, hi, o2);
          }
      }
      // y += acc * scale (+ sum(x) * offset).
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) {
        float* yp = J.y + (mr + m) * N + c;
        __m512 xs = _mm512_setzero_ps();
        if (OFF) xs = _mm512_set1_ps(J.xsum[(mr + m) * G + gi]);
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) {
          __m512 cur;
          if (tail && v == NV - 1)
            cur = _mm512_maskz_loadu_ps(tmask, yp + 16 * v);
          else
            cur = _mm512_loadu_ps(yp + 16 * v);
          cur = _mm512_fmadd_ps(acc[m][v], s[v], cur);
          if (OFF) cur = _mm512_fmadd_ps(xs, o[v], cur);
          if (tail && v == NV - 1)
            _mm512_mask_storeu_ps(yp + 16 * v, tmask, cur);
          else
            _mm512_storeu_ps(yp + 16 * v, cur);
        }
      }
    }
  }
}

using TileFn = void (*)(const Job&, int64_t, int64_t, int64_t, int64_t, __mmask16, int64_t);

constexpr int kMaxMB = 6;
constexpr int kMaxNV = 4;

// The largest M-block of a format: 6 rows x 4 vectors is 24 accumulators, + 4 widened W
// vectors + a broadcast x = 29 of the 32 zmm registers.  int4 widens two W rows per load (8
// vectors), so its blocks stop at 4.  One block covers M <= 6, so a short verification chunk
// (a speculative draft of 5) reads each W chunk once, not once per block.
inline int max_mb(Fmt f) { return f == kInt4 ? 4 : kMaxMB; }

// Instantiated: 64-column chunks (NV=4) and single vectors (NV=1, the band remainders), the
// latter also with a masked tail; MB = 1..6.
template <Fmt F, bool OFF>
struct TileTable {
#define QMM_ROW(NV, TAIL)                                                                       \
  {tile_avx512<1, NV, F, OFF, TAIL>, tile_avx512<2, NV, F, OFF, TAIL>, tile_avx512<3, NV, F, OFF, TAIL>, \
   tile_avx512<4, NV, F, OFF, TAIL>, tile_avx512<5, NV, F, OFF, TAIL>, tile_avx512<6, NV, F, OFF, TAIL>}
  static constexpr TileFn wide[kMaxMB] = QMM_ROW(4, false);
  static constexpr TileFn one[kMaxMB] = QMM_ROW(1, false);
  static constexpr TileFn tail[kMaxMB] = QMM_ROW(1, true);
#undef QMM_ROW
};

// kind: 0 wide (NV=4), 1 one vector, 2 one masked vector.  The dense formats have no offset.
TileFn lookup_tile(Fmt fmt, bool off, int kind, int mb) {
  const int i = mb - 1;
#define QMM_PICK(F, OF) \
  (kind == 0 ? TileTable<F, OF>::wide[i] : kind == 1 ? TileTable<F, OF>::one[i] : TileTable<F, OF>::tail[i])
  switch (fmt) {
    case kInt4: return off ? QMM_PICK(kInt4, true) : QMM_PICK(kInt4, false);
    case kInt8: return off ? QMM_PICK(kInt8, true) : QMM_PICK(kInt8, false);
    case kF32: return QMM_PICK(kF32, false);
    case kBF16: return QMM_PICK(kBF16, false);
  }
  return nullptr;
#undef QMM_PICK
}

// ---- Panel path (M > kMaxMB): each group's 64-column chunk of codes is widened to f32 once,
// into an L1 panel, and then consumed by every block of up to kPanelMB rows of x with pure
// FMAs (kPanelMB x 4 accumulators).

constexpr int kPanelMB = 6;
constexpr int kMaxGroup = 256;  // larger groups are split into sub-panels of this many rows

struct alignas(64) Panel {
  float w[kMaxGroup][64];
  float s[64];
  float o[64];
};

// Widens rows [k0, k0+rows) of group `gi`, columns [c, c+64) (zero beyond ncols) into P.
template <Fmt F>
QMM_TARGET void fill_panel(const Job& J, int64_t gi, int64_t k0, int64_t rows, int64_t c, int ncols,
                           Panel& P) {
  constexpr int R = kRowsPerLoad<F>;
  constexpr int64_t EB = kElemBytes<F>;
  __mmask16 vm[4];
  for (int v = 0; v < 4; ++v) {
    const int n = std::max(0, std::min(16, ncols - 16 * v));
    vm[v] = static_cast<__mmask16>((1u << n) - 1u);
  }
  const uint8_t* qp = row_ptr(J, gi * J.g + k0, c);
  const int64_t stride = J.N * EB, pf = prefetch_offset(J, gi);
  for (int64_t k = 0; k < rows; k += R, qp += stride) {
    if (pf) prefetch_span<64 * EB>(qp + pf);
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      __m512 w[R];
      load16<F>(qp + 16 * v * EB, true, vm[v], w);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) _mm512_store_ps(&P.w[k + r][16 * v], w[r]);
    }
  }
}

using FillFn = void (*)(const Job&, int64_t, int64_t, int64_t, int64_t, int, Panel&);

FillFn lookup_fill(Fmt fmt) {
  switch (fmt) {
    case kInt8: return fill_panel<kInt8>;
    case kInt4: return fill_panel<kInt4>;
    case kF32: return fill_panel<kF32>;
    case kBF16: return fill_panel<kBF16>;
  }
  return nullptr;
}

QMM_TARGET void fill_panel_scales(const Job& J, int64_t gi, int64_t c, int ncols, Panel& P) {
  for (int v = 0; v < 4; ++v) {
    const int n = std::max(0, std::min(16, ncols - 16 * v));
    const __mmask16 m = static_cast<__mmask16>((1u << n) - 1u);
    const __m512 s = J.scale ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, J.scale + gi * J.N + c + 16 * v))
                             : _mm512_set1_ps(1.f);  // dense: scale 1
    _mm512_store_ps(&P.s[16 * v], s);
    if (J.off)
      _mm512_store_ps(&P.o[16 * v], _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, J.off + gi * J.N + c + 16 * v)));
  }
}

// acc[m][:] = sum_k x[m0+m, xk0 + k] * P.w[k][:] for k < rows; then y (+)= ...
// `first`: the sub-panel starts a group (acc starts from zero); `last`: apply the epilogue.
template <int MB, bool OFF>
QMM_TARGET void panel_block(const Job& J, const Panel& P, int64_t m0, int64_t gi, int64_t c, int ncols,
                            __m512 (*carry)[4], int64_t xk0, int64_t rows, bool first, bool last) {
  const int64_t K = J.K, N = J.N, G = J.G;
  __m512 acc[MB][4];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) acc[m][v] = first ? _mm512_setzero_ps() : carry[m][v];
  const float* xp = J.x + m0 * K + xk0;
  for (int64_t k = 0; k < rows; ++k) {
    const __m512 w0 = _mm512_load_ps(&P.w[k][0]);
    const __m512 w1 = _mm512_load_ps(&P.w[k][16]);
    const __m512 w2 = _mm512_load_ps(&P.w[k][32]);
    const __m512 w3 = _mm512_load_ps(&P.w[k][48]);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512 xb = _mm512_set1_ps(xp[m * K + k]);
      acc[m][0] = _mm512_fmadd_ps(xb, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xb, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(xb, w2, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(xb, w3, acc[m][3]);
    }
  }
  if (!last) {
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) carry[m][v] = acc[m][v];
    return;
  }
  __mmask16 vm[4];
#pragma GCC unroll 4
  for (int v = 0; v < 4; ++v) {
    const int n = std::max(0, std::min(16, ncols - 16 * v));
    vm[v] = static_cast<__mmask16>((1u << n) - 1u);
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) {
    float* yp = J.y + (m0 + m) * N + c;
    __m512 xs = _mm512_setzero_ps();
    if (OFF) xs = _mm512_set1_ps(J.xsum[(m0 + m) * G + gi]);
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      __m512 cur = _mm512_maskz_loadu_ps(vm[v], yp + 16 * v);
      cur = _mm512_fmadd_ps(acc[m][v], _mm512_load_ps(&P.s[16 * v]), cur);
      if (OFF) cur = _mm512_fmadd_ps(xs, _mm512_load_ps(&P.o[16 * v]), cur);
      _mm512_mask_storeu_ps(yp + 16 * v, vm[v], cur);
    }
  }
}

using PanelFn = void (*)(const Job&, const Panel&, int64_t, int64_t, int64_t, int, __m512 (*)[4], int64_t,
                         int64_t, bool, bool);

PanelFn lookup_panel(bool off, int mb) {
  static constexpr PanelFn with_off[kPanelMB] = {panel_block<1, true>, panel_block<2, true>,
                                                 panel_block<3, true>, panel_block<4, true>,
                                                 panel_block<5, true>, panel_block<6, true>};
  static constexpr PanelFn no_off[kPanelMB] = {panel_block<1, false>, panel_block<2, false>,
                                               panel_block<3, false>, panel_block<4, false>,
                                               panel_block<5, false>, panel_block<6, false>};
  return off ? with_off[mb - 1] : no_off[mb - 1];
}

// Bytes of y (M rows x band columns, f32) a band may keep live; the band is re-read once per
// group, so it should stay in L2.
constexpr int64_t kBandYBytes = 256 * 1024;

QMM_TARGET void avx512_panel_range(const Job& J, int64_t u0, int64_t u1) {
  thread_local Panel* P = nullptr;
  if (!P) P = static_cast<Panel*>(std::aligned_alloc(64, sizeof(Panel)));
  const int64_t N = J.N, M = J.M, g = J.g;
  const int64_t c_begin = u0 * 16, c_end = std::min(u1 * 16, N);
  int64_t band = kBandYBytes / (M * 4);  // columns
  band = std::max<int64_t>(64, band / 64 * 64);
  const bool off = J.off != nullptr;
  const FillFn fill = lookup_fill(J.fmt);
  const int64_t mfull = M / kPanelMB, mlast = M % kPanelMB;
  const PanelFn f_full = lookup_panel(off, kPanelMB);
  const PanelFn f_last = mlast ? lookup_panel(off, static_cast<int>(mlast)) : nullptr;
  // Carried accumulators when a group is longer than a panel (g > kMaxGroup).
  thread_local __m512* carry_buf = nullptr;
  thread_local int64_t carry_cap = 0;
  const bool split = g > kMaxGroup;
  if (split && carry_cap < (M + kPanelMB) * 4) {
    std::free(carry_buf);
    carry_cap = (M + kPanelMB) * 4;
    carry_buf = static_cast<__m512*>(std::aligned_alloc(64, sizeof(__m512) * carry_cap));
  }
  for (int64_t cb = c_begin; cb < c_end; cb += band) {
    const int64_t ce = std::min(cb + band, c_end);
    for (int64_t gi = 0; gi < J.G; ++gi) {
      for (int64_t c = cb; c < ce; c += 64) {
        const int ncols = static_cast<int>(std::min<int64_t>(64, ce - c));
        fill_panel_scales(J, gi, c, ncols, *P);
        const int64_t grows = group_rows(J, gi);
        for (int64_t k0 = 0; k0 < grows; k0 += kMaxGroup) {
          const int64_t rows = std::min<int64_t>(kMaxGroup, grows - k0);
          const bool first = k0 == 0, last = k0 + rows == grows;
          fill(J, gi, k0, rows, c, ncols, *P);
          for (int64_t b = 0; b < mfull; ++b) {
            auto* carry = split ? reinterpret_cast<__m512(*)[4]>(&carry_buf[b * kPanelMB * 4]) : nullptr;
            f_full(J, *P, b * kPanelMB, gi, c, ncols, carry, gi * g + k0, rows, first, last);
          }
          if (f_last) {
            auto* carry = split ? reinterpret_cast<__m512(*)[4]>(&carry_buf[mfull * kPanelMB * 4]) : nullptr;
            f_last(J, *P, mfull * kPanelMB, gi, c, ncols, carry, gi * g + k0, rows, first, last);
          }
        }
      }
    }
  }
}

// Band width in units of 16 columns (a multiple of kMaxNV): y of the band stays in L2.
inline int64_t band_units(const Job& J) {
  return std::max<int64_t>(kMaxNV, kBandYBytes / (J.M * 64) / kMaxNV * kMaxNV);
}

// Group gi of W times every row of x, for the columns [16*ub, 16*ue) (within one band),
// accumulated into y.
void avx512_group_band(const Job& J, int64_t gi, int64_t ub, int64_t ue) {
  const bool off = J.off != nullptr;
  const int64_t rem = J.N % 16;
  const __mmask16 tmask = rem ? static_cast<__mmask16>((1u << rem) - 1u) : static_cast<__mmask16>(0xffff);
  // M-blocks: as few as the format's largest block allows, of balanced sizes (7 rows: 4 and
  // 3, not 6 and 1), so no block is a lone row (its 4 accumulator chains wait on FMA latency).
  // Each row's sums do not depend on its block: y is the same for any blocking.
  const int64_t nb = (J.M + max_mb(J.fmt) - 1) / max_mb(J.fmt), base = J.M / nb, extra = J.M % nb;
  const bool has_tail = rem != 0 && ue == J.units;
  // 64-column chunks, then single vectors, the very last one masked when N % 16 != 0.
  const int64_t nvec = ue - ub - (has_tail ? 1 : 0);
  const int64_t nwide = nvec / kMaxNV, nsingle = nvec % kMaxNV;
  const int64_t c_single = (ub + nwide * kMaxNV) * 16, c_tail = (ue - 1) * 16;
  for (int pass = 0; pass < 2; ++pass) {  // `extra` blocks of base + 1 rows, then base rows
    const int64_t mblocks = pass == 0 ? extra : nb - extra;
    const int mb = static_cast<int>(pass == 0 ? base + 1 : base);
    if (mblocks == 0) continue;
    const int64_t m0 = pass == 0 ? 0 : extra * (base + 1);
    if (nwide > 0) lookup_tile(J.fmt, off, 0, mb)(J, m0, mblocks, ub * 16, nwide, tmask, gi);
    if (nsingle > 0) lookup_tile(J.fmt, off, 1, mb)(J, m0, mblocks, c_single, nsingle, tmask, gi);
    if (has_tail) lookup_tile(J.fmt, off, 2, mb)(J, m0, mblocks, c_tail, 1, tmask, gi);
  }
}

// Columns [16*u0, 16*u1) of y.  The columns are cut into bands; within a band the groups are
// walked in order and, for each group, the band's g rows are read left to right, so the codes
// stream row-segment by row-segment (each 4 KiB page is used whole, which matters: with
// N-byte row strides a column-major walk would touch a new page for every 64 bytes).
void avx512_range(const Job& J, int64_t u0, int64_t u1) {
  if (u0 >= u1) return;
  const int64_t N = J.N;
  const int64_t c_begin = u0 * 16, c_end = std::min(u1 * 16, N);
  for (int64_t m = 0; m < J.M; ++m)
    std::memset(J.y + m * N + c_begin, 0, sizeof(float) * (c_end - c_begin));
  if (J.M > g_panel_min_m.load(std::memory_order_relaxed)) {
    avx512_panel_range(J, u0, u1);
    return;
  }

  for (int64_t ub = u0; ub < u1; ub += band_units(J))
    for (int64_t gi = 0; gi < J.G; ++gi) avx512_group_band(J, gi, ub, std::min(ub + band_units(J), u1));
}

// K slabs [s0, s1) (see Job::slabs), all columns each.
void avx512_slab_range(const Job& J, int64_t s0, int64_t s1) {
  const int64_t MN = J.M * J.N;
  for (int64_t s = s0; s < s1; ++s) {
    Job S = J;
    S.y = J.part + s * MN;
    std::memset(S.y, 0, sizeof(float) * MN);
    const int64_t g0 = s * J.G / J.slabs, g1 = (s + 1) * J.G / J.slabs;
    S.G = g1;  // no prefetching past the slab (prefetch_offset)
    for (int64_t ub = 0; ub < J.units; ub += band_units(J))
      for (int64_t gi = g0; gi < g1; ++gi) avx512_group_band(S, gi, ub, std::min(ub + band_units(J), J.units));
  }
}

// ---------------------------------------------------------------------------------------------
// AVX2 path: CPUs with AVX2, FMA and F16C but no AVX-512 (AMD Zen 1-3, Intel client parts).
// The register path of the AVX-512 code at half the width: a chunk is one unit (16 columns, two
// 8-lane vectors), an M-block up to 6 rows (int4: 4) in 16 ymm registers.  A row's sums are
// FMAs in k order within a group, then scale and offset per group, whatever its block: they do
// not depend on M (more rows are more M-blocks, each widening the chunk of W again from L1; past
// panel_min_m rows of int8/int4 codes the panel path widens it once, with the same sums) or on
// the thread count.
// A last unit short of 16 columns goes to the scalar loop.
// ---------------------------------------------------------------------------------------------

#define QMM_TARGET2 __attribute__((target("avx2,fma,f16c")))

// Widens 8 columns of a stored row from p to f32: w[0], and w[1] (the odd row) for int4.
template <Fmt F>
QMM_TARGET2 QMM_INLINE void load8(const uint8_t* p, __m256* w) {
  if (F == kInt8) {
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  } else if (F == kInt4) {
    const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(d, _mm256_set1_epi32(15)));
    w[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(d, 4));
  } else if (F == kF32) {
    w[0] = _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// One stored row of a 16-column unit widened to f32 (w0: columns 0-7, w1: 8-15; int4 gives two
// rows each), after prefetching `pf` bytes ahead (0: none): how every AVX2 path reads codes.
template <Fmt F>
QMM_TARGET2 QMM_INLINE void load_unit(const uint8_t* qp, int64_t pf, __m256* w0, __m256* w1) {
  if (QMM_PREFETCH && pf) prefetch_span<16 * kElemBytes<F>>(qp + pf);
  load8<F>(qp, w0);
  load8<F>(qp + 8 * kElemBytes<F>, w1);
}

// y[mr + m, c .. c+16) += acc[m] * scale (+ sum of the group's x * offset): every AVX2 path's
// epilogue, so that their rows agree bit for bit.
template <int MB, bool OFF>
QMM_TARGET2 QMM_INLINE void store_rows_avx2(const Job& J, const __m256 (*acc)[2], int64_t mr, int64_t gi,
                                            int64_t c, const __m256* s, const __m256* o) {
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) {
    float* yp = J.y + (mr + m) * J.N + c;
    const __m256 xs = OFF ? _mm256_set1_ps(J.xsum[(mr + m) * J.G + gi]) : _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) {
      __m256 cur = _mm256_fmadd_ps(acc[m][v], s[v], _mm256_loadu_ps(yp + 8 * v));
      if (OFF) cur = _mm256_fmadd_ps(xs, o[v], cur);
      _mm256_storeu_ps(yp + 8 * v, cur);
    }
  }
}

// One group `gi`: `nchunks` whole units from column c0, each for `mblocks` blocks of MB rows of
// x from m0, accumulated into y (as tile_avx512).
template <int MB, Fmt F, bool OFF>
QMM_TARGET2 void tile_avx2(const Job& J, int64_t m0, int64_t mblocks, int64_t c0, int64_t nchunks, int64_t gi) {
  constexpr int R = kRowsPerLoad<F>;
  constexpr int64_t EB = kElemBytes<F>;
  const int64_t N = J.N, K = J.K, g = J.g;
  const int64_t rows = group_rows(J, gi), stride = N * EB;
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const int64_t c = c0 + ch * 16;
    __m256 s[2], o[2];
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) {
      o[v] = _mm256_setzero_ps();
      if (is_dense(F)) {
        s[v] = _mm256_set1_ps(1.f);
        continue;
      }
      s[v] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(J.scale + gi * N + c + 8 * v)));
      if (OFF) o[v] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(J.off + gi * N + c + 8 * v)));
    }
    for (int64_t mb = 0; mb < mblocks; ++mb) {
      const int64_t mr = m0 + mb * MB;
      __m256 acc[MB][2];
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
      const float* xp = J.x + mr * K + gi * g;
      const uint8_t* qp = row_ptr(J, gi * g, c);
      const int64_t pf = mb != 0 ? 0 : prefetch_offset(J, gi);  // (as tile_avx512)
      for (int64_t kk = 0; kk < rows; kk += R, qp += stride) {
        __m256 w0[R], w1[R];
        load_unit<F>(qp, pf, w0, w1);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m)
#pragma GCC unroll 2
          for (int r = 0; r < R; ++r) {
            const __m256 xb = _mm256_broadcast_ss(xp + m * K + kk + r);
            acc[m][0] = _mm256_fmadd_ps(xb, w0[r], acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(xb, w1[r], acc[m][1]);
          }
      }
      store_rows_avx2<MB, OFF>(J, acc, mr, gi, c, s, o);
    }
  }
}

using Tile2Fn = void (*)(const Job&, int64_t, int64_t, int64_t, int64_t, int64_t);

// 6 rows x 2 vectors: 12 accumulators + 2 widened W vectors + a broadcast x = 15 of 16 ymm;
// int4 widens two rows (4 vectors) and needs its nibble mask: 4 rows.
inline int max_mb_avx2(Fmt f) { return f == kInt4 ? 4 : 6; }

template <Fmt F, bool OFF>
struct Tile2Table {
  static constexpr Tile2Fn fn[6] = {tile_avx2<1, F, OFF>, tile_avx2<2, F, OFF>, tile_avx2<3, F, OFF>,
                                    tile_avx2<4, F, OFF>, tile_avx2<5, F, OFF>, tile_avx2<6, F, OFF>};
};

Tile2Fn lookup_tile_avx2(Fmt fmt, bool off, int mb) {
  switch (fmt) {
    case kInt4: return off ? Tile2Table<kInt4, true>::fn[mb - 1] : Tile2Table<kInt4, false>::fn[mb - 1];
    case kInt8: return off ? Tile2Table<kInt8, true>::fn[mb - 1] : Tile2Table<kInt8, false>::fn[mb - 1];
    case kF32: return Tile2Table<kF32, false>::fn[mb - 1];
    case kBF16: return Tile2Table<kBF16, false>::fn[mb - 1];
  }
  return nullptr;
}

// ---- AVX2 panel path (more than panel_min_m rows of int8/int4 codes, groups of at most
// kMaxGroup rows): each group's 16-column unit is widened to f32 once, into an L1 panel, and
// every M-block of up to 6 rows then runs FMAs from it. The tile path widens the unit again
// for every M-block (int4: every 4 rows), which made a [64, 576] x [576, 1536] product
// conversion-bound. The sums are tile_avx2's, in the same order (k within the group, then
// scale and offset), so a row's result does not depend on which path ran it.

struct alignas(32) Panel2 {
  float w[kMaxGroup][16];
};

template <Fmt F>
QMM_TARGET2 void fill_panel_avx2(const Job& J, int64_t gi, int64_t c, int64_t rows, Panel2& P) {
  constexpr int R = kRowsPerLoad<F>;
  constexpr int64_t EB = kElemBytes<F>;
  const int64_t stride = J.N * EB, pf = prefetch_offset(J, gi);
  const uint8_t* qp = row_ptr(J, gi * J.g, c);
  for (int64_t kk = 0; kk < rows; kk += R, qp += stride) {
    __m256 w0[R], w1[R];
    load_unit<F>(qp, pf, w0, w1);
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      _mm256_store_ps(&P.w[kk + r][0], w0[r]);
      _mm256_store_ps(&P.w[kk + r][8], w1[r]);
    }
  }
}

// Rows [mr, mr + MB) of x times the panel (group gi, columns [c, c + 16)), into y.
template <int MB, bool OFF>
QMM_TARGET2 void panel_block_avx2(const Job& J, const Panel2& P, int64_t mr, int64_t gi, int64_t c,
                                  int64_t rows, const __m256* s, const __m256* o) {
  const int64_t K = J.K;
  __m256 acc[MB][2];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const float* xp = J.x + mr * K + gi * J.g;
  for (int64_t k = 0; k < rows; ++k) {
    const __m256 w0 = _mm256_load_ps(&P.w[k][0]);
    const __m256 w1 = _mm256_load_ps(&P.w[k][8]);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256 xb = _mm256_broadcast_ss(xp + m * K + k);
      acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
    }
  }
  store_rows_avx2<MB, OFF>(J, acc, mr, gi, c, s, o);
}

using Panel2Fn = void (*)(const Job&, const Panel2&, int64_t, int64_t, int64_t, int64_t, const __m256*,
                          const __m256*);

Panel2Fn lookup_panel_avx2(bool off, int mb) {
  static constexpr Panel2Fn with_off[6] = {panel_block_avx2<1, true>, panel_block_avx2<2, true>,
                                           panel_block_avx2<3, true>, panel_block_avx2<4, true>,
                                           panel_block_avx2<5, true>, panel_block_avx2<6, true>};
  static constexpr Panel2Fn no_off[6] = {panel_block_avx2<1, false>, panel_block_avx2<2, false>,
                                         panel_block_avx2<3, false>, panel_block_avx2<4, false>,
                                         panel_block_avx2<5, false>, panel_block_avx2<6, false>};
  return off ? with_off[mb - 1] : no_off[mb - 1];
}

inline bool avx2_panel(const Job& J) {
  return J.M > g_panel_min_m.load(std::memory_order_relaxed) && (J.fmt == kInt8 || J.fmt == kInt4) &&
         J.g <= kMaxGroup;
}

// Columns [16*u0, 16*u1) of y, all whole units, on the panel path: bands of columns, the groups
// in order within a band, the rows in balanced blocks of up to 6 (as avx2_units).
QMM_TARGET2 void avx2_panel_units(const Job& J, int64_t u0, int64_t u1) {
  thread_local Panel2* P = nullptr;
  if (!P) P = static_cast<Panel2*>(std::aligned_alloc(32, sizeof(Panel2)));
  const int64_t N = J.N;
  for (int64_t m = 0; m < J.M; ++m) std::memset(J.y + m * N + u0 * 16, 0, sizeof(float) * (u1 - u0) * 16);
  const bool off = J.off != nullptr;
  const int64_t nb = (J.M + 5) / 6, base = J.M / nb, extra = J.M % nb;
  const Panel2Fn big = lookup_panel_avx2(off, static_cast<int>(base + (extra ? 1 : 0)));
  const Panel2Fn small = lookup_panel_avx2(off, static_cast<int>(base));
  const auto fill = J.fmt == kInt4 ? fill_panel_avx2<kInt4> : fill_panel_avx2<kInt8>;
  for (int64_t ub = u0; ub < u1; ub += band_units(J)) {
    const int64_t ue = std::min(ub + band_units(J), u1);
    for (int64_t gi = 0; gi < J.G; ++gi) {
      const int64_t rows = group_rows(J, gi);
      for (int64_t u = ub; u < ue; ++u) {
        const int64_t c = u * 16;
        __m256 s[2], o[2];
#pragma GCC unroll 2
        for (int v = 0; v < 2; ++v) {
          s[v] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(J.scale + gi * N + c + 8 * v)));
          o[v] = off ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(J.off + gi * N + c + 8 * v)))
                     : _mm256_setzero_ps();
        }
        fill(J, gi, c, rows, *P);
        for (int64_t b = 0; b < extra; ++b) big(J, *P, b * (base + 1), gi, c, rows, s, o);
        for (int64_t b = extra; b < nb; ++b) small(J, *P, extra * (base + 1) + (b - extra) * base, gi, c, rows, s, o);
      }
    }
  }
}

// Columns [16*u0, 16*u1) of y, all whole units: bands of columns, the groups in order within a
// band (as avx512_range), the rows in balanced M-blocks.
void avx2_units(const Job& J, int64_t u0, int64_t u1) {
  const int64_t N = J.N;
  for (int64_t m = 0; m < J.M; ++m) std::memset(J.y + m * N + u0 * 16, 0, sizeof(float) * (u1 - u0) * 16);
  const bool off = J.off != nullptr;
  const int64_t nb = (J.M + max_mb_avx2(J.fmt) - 1) / max_mb_avx2(J.fmt), base = J.M / nb, extra = J.M % nb;
  const Tile2Fn big = lookup_tile_avx2(J.fmt, off, static_cast<int>(base + (extra ? 1 : 0)));
  const Tile2Fn small = lookup_tile_avx2(J.fmt, off, static_cast<int>(base));
  for (int64_t ub = u0; ub < u1; ub += band_units(J)) {
    const int64_t n = std::min(ub + band_units(J), u1) - ub;
    for (int64_t gi = 0; gi < J.G; ++gi) {
      if (extra) big(J, 0, extra, ub * 16, n, gi);  // `extra` blocks of base + 1 rows
      if (nb > extra) small(J, extra * (base + 1), nb - extra, ub * 16, n, gi);
    }
  }
}

void avx2_range(const Job& J, int64_t u0, int64_t u1) {
  if (u0 >= u1) return;
  if (J.N % 16 && u1 == J.units) {  // the short last unit
    scalar_range(J, u1 - 1, u1);
    --u1;
  }
  if (u0 >= u1) return;
  if (avx2_panel(J)) {
    avx2_panel_units(J, u0, u1);
  } else {
    avx2_units(J, u0, u1);
  }
}

bool cpu_has_avx2() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return ok;
}

bool cpu_has_avx512() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return ok;
}

inline void cpu_relax() { _mm_pause(); }

// The first min(n, 16) lanes.
inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1);
}
inline unsigned get_fp_mode() { return _mm_getcsr(); }
inline void set_fp_mode(unsigned v) { _mm_setcsr(v); }

#else  // !QMM_X86

void avx512_range(const Job& J, int64_t u0, int64_t u1) { scalar_range(J, u0, u1); }
void avx512_slab_range(const Job&, int64_t, int64_t) {}  // never used: simd is false
void avx2_range(const Job& J, int64_t u0, int64_t u1) { scalar_range(J, u0, u1); }
bool cpu_has_avx512() { return false; }
bool cpu_has_avx2() { return false; }
inline void cpu_relax() {}
inline unsigned get_fp_mode() { return 0; }
inline void set_fp_mode(unsigned) {}

#endif  // QMM_X86

// ---------------------------------------------------------------------------------------------
// Thread pool: the calling thread takes part; workers spin on the work word for spin_us after
// each job, then sleep on a condition variable.
// ---------------------------------------------------------------------------------------------

using RangeFn = void (*)(const Job&, int64_t, int64_t);

// impl: 0 auto, 1 scalar, 2 simd (the best this CPU has), 3 AVX2 (where the CPU has it; for
// tests and benchmarks on AVX-512 machines).  The AVX-512 code is used for 0 and 2.
bool use_avx512(int64_t impl) { return (impl == 0 || impl == 2) && cpu_has_avx512(); }

// The N-split work of a matmul on this CPU.
RangeFn nsplit_range(int64_t impl) {
  if (impl == 1) return scalar_range;
  if (use_avx512(impl)) return avx512_range;
  return cpu_has_avx2() ? avx2_range : scalar_range;
}


int default_threads() {
  int n = env_int("JAXDEC_CPU_THREADS", 0);
  if (n > 0) return std::min(n, 256);
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int c = CPU_COUNT(&set);
    if (c > 0) return c;
  }
#endif
  unsigned hc = std::thread::hardware_concurrency();
  return hc ? static_cast<int>(hc) : 1;
}

// Work is handed out in chunks (column ranges, or K slabs) through one atomic word
//   work_ = [job serial : 24][participants : 8][front : 16][back : 16]
// that the caller and the workers claim from with compare-and-swap: chunks [front, back) are
// left; the caller takes them from the front, workers from the back, so that with repeated
// calls on the same weights each thread tends to get the same chunks (and finds them in its
// own L2).  A claim succeeds only
// while the word still names the job the claimant saw, so a worker that wakes late cannot take
// a chunk of a finished job, and the caller does whatever nobody else took: if a worker is
// descheduled (the machine is oversubscribed) the caller waits only for chunks already claimed.
class Pool {
 public:
  explicit Pool(int nthreads) : nthreads_(std::min(255, std::max(1, nthreads))) {
    for (int t = 1; t < nthreads_; ++t) workers_.emplace_back([this, t] { Worker(t); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_.store(true);
      work_.fetch_add(uint64_t{1} << 40);
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }
  int size() const { return nthreads_; }

  // Runs fn on each of the job's chunks with threads 0 (the caller) .. parts-1.
  // Returns true when the caller, done with its own chunks, waited for the workers longer than
  // half the time it had worked (a straggling, probably descheduled, worker).
  bool Run(RangeFn fn, const Job* job, int64_t nchunks, int parts) {
    fn_ = fn;
    job_ = job;
    fp_mode_.store(get_fp_mode(), std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    serial_ = (serial_ + 1) & 0xffffffu;
    const uint64_t w = (serial_ << 40) | (static_cast<uint64_t>(parts & 0xff) << 32) |
                       static_cast<uint64_t>(nchunks);
    work_.store(w, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> lk(mu_); }
      cv_.notify_all();
    }
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t mine = Drain(w >> 32, 0);
    if (mine == nchunks) return false;
    const auto t1 = std::chrono::steady_clock::now();
    while (done_.load(std::memory_order_acquire) + mine != nchunks) cpu_relax();
    const auto t2 = std::chrono::steady_clock::now();
    return (t2 - t1) > (t1 - t0) / 2 + std::chrono::microseconds(5);
  }

 private:
  // Claims and runs chunks of job `serial` until none are left; returns how many it ran.
  // `tag` is the job's serial and participant count (the word's top 32 bits); thread t takes
  // part only if t < parts.
  int64_t Drain(uint64_t tag, int t) {
    if (t >= static_cast<int>(tag & 0xff)) return 0;
    int64_t ran = 0;
    uint64_t w = work_.load(std::memory_order_acquire);
    for (;;) {
      if ((w >> 32) != tag) break;
      const uint64_t front = (w >> 16) & 0xffff, back = w & 0xffff;
      if (front >= back) break;
      const uint64_t i = t == 0 ? front : back - 1;
      if (!work_.compare_exchange_weak(w, t == 0 ? w + (1u << 16) : w - 1, std::memory_order_acq_rel,
                                       std::memory_order_acquire))
        continue;
      const Job& J = *job_;
      const int64_t u0 = J.chunk_units * static_cast<int64_t>(i);
      const int64_t u1 = std::min(J.items, u0 + J.chunk_units);
      fn_(J, u0, u1);
      ++ran;
      w = work_.load(std::memory_order_acquire);
    }
    return ran;
  }

  void Worker(int t) {
    uint64_t seen = 0;  // the serial at construction (a job may be posted before we start)
    unsigned my_fp = get_fp_mode();
    for (;;) {
      const auto spin_until = std::chrono::steady_clock::now() +
                              std::chrono::microseconds(g_spin_us.load(std::memory_order_relaxed));
      uint64_t cur;
      int iter = 0;
      while (((cur = work_.load(std::memory_order_acquire)) >> 32) == seen) {
        cpu_relax();
        if ((++iter & 63) == 0 && std::chrono::steady_clock::now() > spin_until) break;
      }
      if ((cur >> 32) == seen) {
        std::unique_lock<std::mutex> lk(mu_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        while (((cur = work_.load(std::memory_order_seq_cst)) >> 32) == seen) cv_.wait(lk);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      }
      seen = cur >> 32;
      if (stop_.load(std::memory_order_acquire)) return;
      // The caller's MXCSR (flush-to-zero / denormals-are-zero as XLA set them), so that
      // workers round like the caller.
      const unsigned want_fp = fp_mode_.load(std::memory_order_relaxed);
      if (want_fp != my_fp) {
        set_fp_mode(want_fp);
        my_fp = want_fp;
      }
      const int64_t ran = Drain(seen, t);
      if (ran) done_.fetch_add(ran, std::memory_order_acq_rel);
    }
  }

  const int nthreads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> work_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<bool> stop_{false};
  uint64_t serial_ = 0;  // caller side only (24 bits)
  // Job state: written by the caller before work_ is published, read by claimants.
  RangeFn fn_ = nullptr;
  const Job* job_ = nullptr;
  std::atomic<unsigned> fp_mode_{0};
};

std::mutex g_pool_mu;          // guards creating the pool and running a job on it
Pool* g_pool = nullptr;        // leaked on purpose (no join at exit)
int g_pool_threads = -1;

#if defined(__linux__)
void after_fork_child() {
  // The child has no worker threads: forget the pool (leak it) and build a new one on demand.
  new (&g_pool_mu) std::mutex();
  g_pool = nullptr;
  g_pool_threads = -1;
}
#endif

int pool_threads_locked() {
  if (g_pool_threads < 0) {
    g_pool_threads = default_threads();
#if defined(__linux__)
    static bool registered = false;
    if (!registered) {
      pthread_atfork(nullptr, nullptr, after_fork_child);
      registered = true;
    }
#endif
  }
  return g_pool_threads;
}

// Falls back to one thread for a while when workers keep straggling (an oversubscribed
// machine: a descheduled worker holding a chunk costs the caller a scheduler time slice, which
// on average undoes what the worker contributed).  Guarded by g_pool_mu.
//
// Signals, per parallel call: the caller waited for workers longer than half its own work time
// (a straggler), or the caller itself ran on the CPU for under 80% of the call's wall time (it
// was preempted: more runnable threads than cores, to which spinning workers contribute).
// 32 such calls in a window of 64 switch to one thread for 100 ms (doubling, up to 5 s, while it
// keeps happening), then parallel calls resume and are judged again.  (4 in 16 also fired on
// the short bursts of a streaming host thread reading each chunk: bf16 streamed decode ran at
// 0.67 of the one-jit rate.)
inline double thread_cpu_seconds() {
#if defined(__linux__)
  timespec ts;
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0) return ts.tv_sec + 1e-9 * ts.tv_nsec;
#endif
  return -1.0;
}

struct Adaptive {
  bool enabled = env_int("JAXDEC_CPU_ADAPTIVE", 1) != 0;
  int calls = 0, bad = 0;
  int backoff_ms = kMinBackoffMs;
  static constexpr int kWindow = 64, kBadLimit = 32, kMinBackoffMs = 100, kMaxBackoffMs = 5000;
  std::chrono::steady_clock::time_point serial_until{};
  int64_t total_parallel = 0, total_bad = 0, total_fallbacks = 0;
  bool SerialNow() const { return enabled && std::chrono::steady_clock::now() < serial_until; }
  void Record(bool was_bad) {
    total_parallel += 1;
    total_bad += was_bad ? 1 : 0;
    calls += 1;
    bad += was_bad ? 1 : 0;
    if (calls < kWindow) return;
    if (enabled && bad >= kBadLimit) {
      // Back off exponentially while the machine stays oversubscribed.
      total_fallbacks += 1;
      serial_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(backoff_ms);
      backoff_ms = std::min(2 * backoff_ms, kMaxBackoffMs);
    } else {
      backoff_ms = kMinBackoffMs;
    }
    calls = bad = 0;
  }
} g_adapt;

// Runs fn over the job's items [0, J.items), shared with the pool when the job is large enough
// (work_bytes, the bytes it reads, and min_items or more items): about chunks_per_thread chunks per thread, each a multiple
// of `align` items.
void run_job(Job& J, RangeFn fn, int64_t align, int64_t min_items, int64_t chunks_per_thread,
             int64_t work_bytes) {
  int want = 1;
  if (work_bytes >= g_min_parallel_bytes.load(std::memory_order_relaxed) &&
      J.items >= min_items) {
    want = 256;
    const int active = g_active_threads.load(std::memory_order_relaxed);
    if (active > 0) want = active;
  }
  if (want > 1) {
    // Concurrent callers (XLA may run independent custom calls at once) do not queue on the
    // pool: whoever finds it busy computes on its own thread.
    std::unique_lock<std::mutex> lk(g_pool_mu, std::try_to_lock);
    if (lk.owns_lock()) {
      const int n = pool_threads_locked();
      if (n > 1 && !g_pool) g_pool = new Pool(n);
      if (g_pool) {
        want = std::min(want, g_pool->size());
        int64_t cu = (J.items + want * chunks_per_thread - 1) / (want * chunks_per_thread);
        cu = std::max<int64_t>(align, (cu + align - 1) / align * align);
        int64_t nchunks = (J.items + cu - 1) / cu;
        while (nchunks > 0xffff) {
          cu *= 2;
          nchunks = (J.items + cu - 1) / cu;
        }
        if (nchunks > 1 && !g_adapt.SerialNow()) {
          J.chunk_units = cu;
          const bool measure = g_adapt.enabled;
          const double c0 = measure ? thread_cpu_seconds() : 0.0;
          const auto w0 = std::chrono::steady_clock::now();
          bool bad = g_pool->Run(fn, &J, nchunks, want);
          if (measure) {
            const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
            const double cpu = thread_cpu_seconds() - c0;
            if (c0 >= 0 && wall > 20e-6 && cpu < 0.8 * wall) bad = true;
            g_adapt.Record(bad);
          }
          return;
        }
      }
    }
  }
  J.chunk_units = J.items;
  fn(J, 0, J.items);
}

// ---------------------------------------------------------------------------------------------
// AMX path: M >= g_amx_min_m rows against bf16 or quantised W, where the CPU has AMX-BF16 and
// the kernel grants this process the tile state.  x is rounded to bf16 once per call; each
// 32-column block of W is dequantised (q * scale + offset, rounded to bf16; bf16 W as it is)
// into a K x 32 slab in the tiles' pair-interleaved layout, which then meets every 32-row block
// of x in 16x16 tile products accumulated in f32 (tdpbf16ps).  So this path computes with bf16
// activations and bf16 weights, as a bf16 framework Linear does; the weight codes are read once
// per call whatever M is.
// ---------------------------------------------------------------------------------------------

std::atomic<int> g_amx_min_m{env_int("JAXDEC_CPU_AMX_MIN_M", 16)};  // <= 0: never
constexpr int64_t kAmxSlab = 128;  // columns of W dequantised per slab (4 blocks of 32)

#if QMM_X86
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,amx-tile,amx-bf16")))

bool cpu_has_amx() {
  static const bool ok = [] {
    if (!cpu_has_avx512() || env_int("JAXDEC_CPU_AMX", 1) == 0) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
    const bool avx512_bf16 = (a >> 5) & 1;
    if (!tile || !bf16 || !avx512_bf16) return false;
#if defined(__linux__)
    // Linux hands out the tile data state on request (ARCH_REQ_XCOMP_PERM, XTILEDATA).
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: C (16 x 16 f32), 4-5: A (16 rows x 32 bf16 of x), 6-7: B (16 pairs of W rows x 16
// columns, pair-interleaved).  Every tile is 16 rows of 64 bytes.
AMX_TARGET void amx_configure() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Scale and offset of group gi at columns [c, c + 32), as f32 (0 past the masked columns).
struct GroupScale {
  __m512 sc[2], of[2];
};

AMX_TARGET QMM_INLINE GroupScale amx_group_scale(const Job& J, int64_t gi, int64_t c, __mmask32 cols) {
  GroupScale s;
  for (int h = 0; h < 2; ++h) {
    const __mmask16 m = static_cast<__mmask16>(cols >> (16 * h));
    s.sc[h] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, J.scale + gi * J.N + c + 16 * h));
    s.of[h] = J.off ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, J.off + gi * J.N + c + 16 * h))
                    : _mm512_setzero_ps();
  }
  return s;
}

// Row k (< K) of W at columns [c, c + 32) as 32 bf16 (0 past the masked columns).
AMX_TARGET QMM_INLINE __m512i amx_row(const Job& J, int64_t k, int64_t c, __mmask32 cols, const GroupScale& s) {
  if (J.fmt == kBF16)
    return _mm512_maskz_loadu_epi16(cols, reinterpret_cast<const uint16_t*>(J.q) + k * J.N + c);
  __m512 w[2];
  if (J.fmt == kInt8) {
    const __m256i b = _mm256_maskz_loadu_epi8(cols, reinterpret_cast<const int8_t*>(J.q) + k * J.N + c);
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  } else {  // int4: row k's code is the low nibble of packed row k/2 for even k, else the high one
    const __m256i b = _mm256_maskz_loadu_epi8(cols, J.q + (k / 2) * J.N + c);
    const int shift = (k & 1) ? 4 : 0;
    for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_cvtepu8_epi32(h ? _mm256_extracti128_si256(b, 1) : _mm256_castsi256_si128(b));
      w[h] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, shift), _mm512_set1_epi32(15)));
    }
  }
  w[0] = _mm512_fmadd_ps(w[0], s.sc[0], s.of[0]);
  w[1] = _mm512_fmadd_ps(w[1], s.sc[1], s.of[1]);
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w[1], w[0]));
}

// The K x kAmxSlab slab of W's columns [c, c + ncols): for each block j of 32 columns, Kp x 32
// bf16 at slab + j * Kp * 32, pair-interleaved: 128 bytes per pair of rows (2k, 2k + 1), the
// first 64 for the block's columns 0..15 (tile 6), the next 64 for 16..31 (tile 7); zeros past
// K and past ncols.  Rows are read group by group across the slab's full width (one to four
// cache lines each), with the next group's rows prefetched.
AMX_TARGET void amx_fill_slab(const Job& J, int64_t c, int64_t ncols, uint16_t* slab) {
  alignas(64) static const uint16_t lo_idx[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                   8,  40, 9,  41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                   24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i il = _mm512_load_si512(lo_idx), ih = _mm512_load_si512(hi_idx);
  const int64_t blocks = (ncols + 31) / 32;
  // Rows per step: a group of the quantised formats (their scale changes per group), 32 for bf16.
  const int64_t step = J.fmt == kBF16 ? 32 : J.g;
  const int64_t row_bytes = J.fmt == kBF16 ? 2 * ncols : ncols;
  GroupScale one;
  for (int h = 0; h < 2; ++h) {
    one.sc[h] = _mm512_set1_ps(1.f);
    one.of[h] = _mm512_setzero_ps();
  }
  for (int64_t k0 = 0; k0 < J.K; k0 += step) {
    const int64_t k1 = std::min(J.K, k0 + step);
    for (int64_t k = k1; k < std::min(J.K, k1 + step); ++k)  // the next step's rows
      if (J.fmt != kInt4 || (k & 1) == 0)
        for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(row_ptr(J, k, c)) + off, _MM_HINT_T0);
    for (int64_t j = 0; j < blocks; ++j) {
      const int64_t cj = c + 32 * j, n = std::min<int64_t>(32, ncols - 32 * j);
      const __mmask32 cols = n >= 32 ? ~__mmask32{0} : (__mmask32{1} << n) - 1;
      const GroupScale s = J.fmt == kBF16 ? one : amx_group_scale(J, k0 / J.g, cj, cols);
      uint16_t* dst = slab + j * J.Kp * 32;
      for (int64_t k = k0; k < k1; k += 2) {
        const __m512i a = amx_row(J, k, cj, cols, s);
        const __m512i b = k + 1 < J.K ? amx_row(J, k + 1, cj, cols, s) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + k * 32, _mm512_permutex2var_epi16(a, il, b));
        _mm512_storeu_si512(dst + k * 32 + 32, _mm512_permutex2var_epi16(a, ih, b));
      }
    }
  }
  // Zero rows K..Kp (K padded to a multiple of 32).
  for (int64_t j = 0; j < blocks; ++j)
    for (int64_t k = (J.K + 1) / 2 * 2; k < J.Kp; k += 2) {
      _mm512_storeu_si512(slab + j * J.Kp * 32 + k * 32, _mm512_setzero_si512());
      _mm512_storeu_si512(slab + j * J.Kp * 32 + k * 32 + 32, _mm512_setzero_si512());
    }
}

// Column slabs [u0, u1) (kAmxSlab columns each).
AMX_TARGET void amx_range(const Job& J, int64_t u0, int64_t u1) {
  thread_local std::vector<uint16_t> tls_slab;
  std::vector<uint16_t>& slab = tls_slab;
  slab.resize(static_cast<size_t>(J.Kp * kAmxSlab));
  alignas(64) float cbuf[4][16 * 16];
  amx_configure();
  const int64_t xstride = J.Kp * 2;
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t cs = u * kAmxSlab, slab_cols = std::min<int64_t>(kAmxSlab, J.N - cs);
    amx_fill_slab(J, cs, slab_cols, slab.data());
    for (int64_t j = 0; j * 32 < slab_cols; ++j) {
      const int64_t c = cs + 32 * j, ncols = std::min<int64_t>(32, J.N - c);
      const uint16_t* bj = slab.data() + j * J.Kp * 32;
      for (int64_t m0 = 0; m0 < J.Mp; m0 += 32) {
        const bool two = m0 + 16 < J.Mp;
        const uint16_t* x0 = J.xb + m0 * J.Kp;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < J.Kp; k += 32) {
          _tile_loadd(6, bj + k * 32, 128);
          _tile_loadd(7, bj + k * 32 + 32, 128);
          _tile_loadd(4, x0 + k, xstride);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_loadd(5, x0 + 16 * J.Kp + k, xstride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, cbuf[0], 64);
        _tile_stored(1, cbuf[1], 64);
        if (two) {
          _tile_stored(2, cbuf[2], 64);
          _tile_stored(3, cbuf[3], 64);
        }
        const int64_t rows = std::min<int64_t>(two ? 32 : 16, J.M - m0);
        const int64_t n0 = std::min<int64_t>(16, ncols), n1 = ncols - n0;
        for (int64_t r = 0; r < rows; ++r) {
          const float* src = cbuf[r >= 16 ? 2 : 0] + (r % 16) * 16;
          float* dst = J.y + (m0 + r) * J.N + c;
          std::memcpy(dst, src, sizeof(float) * n0);
          if (n1 > 0) std::memcpy(dst + 16, cbuf[r >= 16 ? 3 : 1] + (r % 16) * 16, sizeof(float) * n1);
        }
      }
    }
  }
  _tile_release();
}

// x f32[M, K] -> bf16 [Mp, Kp] (round to nearest even), zero padding.
AMX_TARGET void amx_round_x(const float* x, int64_t M, int64_t K, int64_t Mp, int64_t Kp, uint16_t* xb) {
  std::memset(xb, 0, sizeof(uint16_t) * Mp * Kp);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 t = tail_mask(K - k);
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(t, x + m * K + k));
      _mm256_mask_storeu_epi16(xb + m * Kp + k, t, reinterpret_cast<const __m256i&>(v));
    }
}

#else
bool cpu_has_amx() { return false; }
void amx_range(const Job&, int64_t, int64_t) {}
void amx_round_x(const float*, int64_t, int64_t, int64_t, int64_t, uint16_t*) {}
#endif  // QMM_X86

// ---------------------------------------------------------------------------------------------
// Drivers shared by the FFI handlers and the raw C entry points
// ---------------------------------------------------------------------------------------------

// Rows of W per group (a blocking of K only) for the dense formats, on the register path
// (M <= panel_min_m: the group's partial sums stay in registers across g rows, y is updated
// once per group) and on the panel path.
// The register path reads a group's g rows side by side, 64 columns at a time: g read streams
// at a stride of one row.  16 was tuned on Intel (Sapphire Rapids).  AMD Zen 4's prefetchers
// keep up with 8 and not with 16: cache-cold f32 matrix-vector products stream about 1.4x
// faster with 8 (576x1536: 17 -> 25 GB/s, scripts/matvec_traversal.c), and f32 decode ran
// 31 -> 37 tok/s (`jaxdec bench --weights f32` with JAXDEC_CPU_DENSE_GROUP=16|8, 5 pairs).
int default_dense_group() {
#if QMM_X86 && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_is("amd")) return 8;
#endif
  return 16;
}
std::atomic<int> g_dense_group{env_int("JAXDEC_CPU_DENSE_GROUP", default_dense_group())};
std::atomic<int> g_dense_group_panel{env_int("JAXDEC_CPU_DENSE_GROUP_PANEL", 256)};
// K slabs (see Job::slabs): bytes of W per slab (0: never split K), and the longest row of W
// (bytes) for which K is split.
std::atomic<int> g_slab_bytes{env_int("JAXDEC_CPU_SLAB_BYTES", 512 * 1024)};
constexpr int64_t kSlabMaxRowBytes = 16 * 1024;

// Slabs of W rows for a K-split product (0: split N instead).  Depends on W's shape only: not
// on the thread count, and not on M either, within the register path (M <= panel_min_m) that
// decoding and short verification chunks take.  So a row of x gets the same sums, bit for bit,
// whether it comes alone (a decode step) or with the other tokens of a speculative draft (the
// verification): greedy speculation stays token-identical to plain decoding, in bf16 too.
int64_t slab_count(const Job& J, bool simd) {
  const int64_t target = g_slab_bytes.load(std::memory_order_relaxed);
  const int64_t row_bytes = J.N * elem_bytes(J.fmt);
  if (!simd || !is_dense(J.fmt) || target <= 0 || J.M > g_panel_min_m.load(std::memory_order_relaxed) ||
      row_bytes > kSlabMaxRowBytes || J.K * row_bytes < g_min_parallel_bytes.load(std::memory_order_relaxed))
    return 0;
  // About `target` bytes each, a multiple of 4 slabs (even shares for 2 or 4 threads).
  int64_t n = (J.K * row_bytes + target - 1) / target;
  n = (n + 3) / 4 * 4;
  n = std::min(n, J.G);  // at least one group each
  return n >= 2 ? n : 0;
}

// impl: see use_avx512.  scale is null for the
// dense formats (and g, the blocking of K, chosen here).
void matmul_2d(const float* x, const uint8_t* q, const uint16_t* scale, const uint16_t* off,
               float* y, int64_t M, int64_t K, int64_t N, Fmt fmt, int64_t g, int impl,
               std::vector<float>& xsum_buf) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    std::fill(y, y + M * N, 0.f);
    return;
  }
  const bool simd = use_avx512(impl);
  const int amx_min_m = g_amx_min_m.load(std::memory_order_relaxed);
  const bool amx = simd && fmt != kF32 && (fmt == kBF16 || g % 2 == 0) && amx_min_m > 0 &&
                   M >= amx_min_m && cpu_has_amx();
  if (is_dense(fmt)) {  // g blocks K only (the AMX path reads bf16 rows in steps of 32)
    const bool panel = simd && M > g_panel_min_m.load(std::memory_order_relaxed);
    g = std::max(1, (panel ? g_dense_group_panel : g_dense_group).load(std::memory_order_relaxed));
    g = std::min(g, K);
  }
  Job J;
  J.x = x;
  J.q = q;
  J.scale = scale;
  J.off = off;
  J.y = y;
  J.M = M;
  J.K = K;
  J.N = N;
  J.g = g;
  J.G = (K + g - 1) / g;
  J.units = (N + 15) / 16;
  J.fmt = fmt;
  if (amx) {
    J.Mp = (M + 15) / 16 * 16;
    J.Kp = (K + 31) / 32 * 32;
    thread_local std::vector<uint16_t> tls_xb;
    std::vector<uint16_t>& xb = tls_xb;
    xb.resize(static_cast<size_t>(J.Mp * J.Kp));
    amx_round_x(x, M, K, J.Mp, J.Kp, xb.data());
    J.xb = xb.data();
    J.items = (N + kAmxSlab - 1) / kAmxSlab;
    run_job(J, amx_range, 1, 2, 4, weight_bytes(J) * M);
    return;
  }
  J.xsum = nullptr;
  J.items = J.units;
  J.slabs = 0;
  J.part = nullptr;
  if (off) {
    xsum_buf.resize(static_cast<size_t>(M * J.G));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t gi = 0; gi < J.G; ++gi) {
        float s = 0.f;
        const float* xp = x + m * K + gi * g;
        for (int64_t k = 0; k < g; ++k) s += xp[k];
        xsum_buf[m * J.G + gi] = s;
      }
    J.xsum = xsum_buf.data();
  }
  if (const int64_t slabs = slab_count(J, simd)) {
    // Split K: each slab's partial product into its own buffer (one slab per chunk of work),
    // then y = their sum, in slab order.
    J.slabs = J.items = slabs;
    thread_local std::vector<float> part;
    part.resize(static_cast<size_t>(J.items * M * N));
    J.part = part.data();
    run_job(J, avx512_slab_range, 1, 2, J.items, weight_bytes(J) * M);
    const int64_t MN = M * N;
    std::memcpy(y, J.part, sizeof(float) * MN);
    for (int64_t s = 1; s < J.items; ++s) {
      const float* p = J.part + s * MN;
      for (int64_t i = 0; i < MN; ++i) y[i] += p[i];
    }
    return;
  }
  // Split N: chunks of a multiple of 4 units (64 columns), about 4 per thread.
  run_job(J, nsplit_range(impl), 4, 8, 4, weight_bytes(J) * M);
}

int64_t prod(ffi::Span<const int64_t> d, size_t from, size_t to) {
  int64_t p = 1;
  for (size_t i = from; i < to; ++i) p *= d[i];
  return p;
}

// Leading (vmap) dimensions of y = x @ W, shared by the handlers.  ops[0] are x's dimensions,
// the rest those of the weight operands; each operand's leading dims are 1 or equal to y's.
// Calls mm(idx, rows, y_out) with idx[i] the batch index of operand i and rows the rows of x
// (and y) to multiply: once with every row folded into M when the weights are not batched,
// else once per batch element.
template <size_t NOps, class MM>
ffi::Error for_each_batch(const char* name, ffi::Span<const int64_t> yd,
                          const std::array<ffi::Span<const int64_t>, NOps>& ops, float* y, MM mm) {
  const size_t r = yd.size();
  const int64_t M = yd[r - 2], N = yd[r - 1];
  bool weights_batched = false;
  for (size_t i = 0; i + 2 < r; ++i) {
    const int64_t b = yd[i];
    for (size_t o = 0; o < NOps; ++o) {
      if (ops[o][i] != 1 && ops[o][i] != b)
        return ffi::Error::InvalidArgument(std::string(name) + ": batch dimension mismatch");
      if (o > 0 && ops[o][i] != 1) weights_batched = true;
    }
  }
  const int64_t B = prod(yd, 0, r - 2);
  std::array<int64_t, NOps> idx{};
  if (!weights_batched) {
    // x's leading dims are all 1 or all equal to y's; either way its rows are contiguous.
    if (prod(ops[0], 0, r - 2) == B) {
      mm(idx, B * M, y);
    } else {  // x broadcast along some batch dims: each batch element is the same product.
      mm(idx, M, y);
      for (int64_t b = 1; b < B; ++b) std::memcpy(y + b * M * N, y, sizeof(float) * M * N);
    }
    return ffi::Error::Success();
  }
  // General broadcasting over the leading dims.
  for (int64_t b = 0; b < B; ++b) {
    int64_t rem = b;
    std::array<int64_t, NOps> stride;
    idx.fill(0);
    stride.fill(1);
    for (size_t i = r - 2; i-- > 0;) {
      const int64_t at = rem % yd[i];
      rem /= yd[i];
      for (size_t o = 0; o < NOps; ++o) {
        if (ops[o][i] != 1) idx[o] += at * stride[o];
        stride[o] *= ops[o][i];
      }
    }
    mm(idx, M, y + b * M * N);
  }
  return ffi::Error::Success();
}

ffi::Error QMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::Buffer<ffi::F16> scale,
                       ffi::Buffer<ffi::F16> offset, ffi::ResultBuffer<ffi::F32> y, int64_t bits,
                       int64_t group_size, bool has_offset, int64_t impl) {
  if (bits != 4 && bits != 8) return ffi::Error::InvalidArgument("qmatmul: bits must be 4 or 8");
  const auto xd = x.dimensions();
  const auto qd = q.dimensions();
  const auto sd = scale.dimensions();
  const auto od = offset.dimensions();
  const auto yd = y->dimensions();
  const size_t r = yd.size();
  if (r < 2 || xd.size() != r || qd.size() != r || sd.size() != r)
    return ffi::Error::InvalidArgument("qmatmul: operands must share a rank >= 2");
  if (has_offset && od.size() != r)
    return ffi::Error::InvalidArgument("qmatmul: offset rank mismatch");
  const int64_t M = xd[r - 2], K = xd[r - 1], N = qd[r - 1];
  const int64_t g = group_size;
  if (g <= 0 || K % g != 0 || (bits == 4 && g % 2 != 0))
    return ffi::Error::InvalidArgument("qmatmul: group_size must divide K (and be even for 4 bits)");
  const int64_t G = K / g;
  const int64_t Kq = bits == 8 ? K : K / 2;
  if (bits == 8 && q.element_type() != ffi::S8)
    return ffi::Error::InvalidArgument("qmatmul: 8-bit codes must be int8");
  if (bits == 4 && q.element_type() != ffi::U8)
    return ffi::Error::InvalidArgument("qmatmul: 4-bit codes must be uint8");
  if (qd[r - 2] != Kq || sd[r - 2] != G || sd[r - 1] != N || yd[r - 2] != M || yd[r - 1] != N)
    return ffi::Error::InvalidArgument("qmatmul: shape mismatch");
  if (has_offset && (od[r - 2] != G || od[r - 1] != N))
    return ffi::Error::InvalidArgument("qmatmul: offset shape");
  const float* xp = x.typed_data();
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.untyped_data());
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.typed_data());
  const uint16_t* op = has_offset ? reinterpret_cast<const uint16_t*>(offset.typed_data()) : nullptr;
  const Fmt fmt = bits == 8 ? kInt8 : kInt4;
  thread_local std::vector<float> xsum_buf;
  // Without an offset its slot holds `scale` again (same shape): it takes part harmlessly.
  return for_each_batch<4>("qmatmul", yd, {xd, qd, sd, has_offset ? od : sd}, y->typed_data(),
                           [&](const std::array<int64_t, 4>& i, int64_t rows, float* yo) {
                             matmul_2d(xp + i[0] * M * K, qp + i[1] * Kq * N, sp + i[2] * G * N,
                                       op ? op + i[3] * G * N : nullptr, yo, rows, K, N, fmt, g,
                                       static_cast<int>(impl), xsum_buf);
                           });
}

// dtype: 0 float32, 1 bfloat16; false unless it matches w's element type.
bool dense_format(const ffi::AnyBuffer& w, int64_t dtype, Fmt* fmt) {
  if (dtype == 0 && w.element_type() == ffi::F32) *fmt = kF32;
  else if (dtype == 1 && w.element_type() == ffi::BF16) *fmt = kBF16;
  else return false;
  return true;
}

ffi::Error DenseMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y,
                           int64_t dtype, int64_t impl) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  const size_t r = yd.size();
  if (r < 2 || xd.size() != r || wd.size() != r)
    return ffi::Error::InvalidArgument("dense_matmul: operands must share a rank >= 2");
  const int64_t M = xd[r - 2], K = xd[r - 1], N = wd[r - 1];
  if (wd[r - 2] != K || yd[r - 2] != M || yd[r - 1] != N)
    return ffi::Error::InvalidArgument("dense_matmul: shape mismatch");
  Fmt fmt;
  if (!dense_format(w, dtype, &fmt))
    return ffi::Error::InvalidArgument("dense_matmul: w must be float32 (dtype=0) or bfloat16 (dtype=1)");
  const float* xp = x.typed_data();
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.untyped_data());
  const int64_t wbytes = K * N * elem_bytes(fmt);
  thread_local std::vector<float> unused;
  return for_each_batch<2>("dense_matmul", yd, {xd, wd}, y->typed_data(),
                           [&](const std::array<int64_t, 2>& i, int64_t rows, float* yo) {
                             matmul_2d(xp + i[0] * M * K, wp + i[1] * wbytes, nullptr, nullptr, yo, rows,
                                       K, N, fmt, 0, static_cast<int>(impl), unused);
                           });
}


struct ExpertJob {
  std::vector<Job> slots;  // one N-split job per slot
  int64_t units;           // column units per slot
  RangeFn fn;
};

// Items [u0, u1) of all slots' column units, slot after slot.
void expert_range(const Job& J, int64_t u0, int64_t u1) {
  const ExpertJob& X = *static_cast<const ExpertJob*>(J.ctx);
  while (u0 < u1) {
    const int64_t s = u0 / X.units, a = u0 % X.units;
    const int64_t b = std::min(X.units, a + (u1 - u0));
    X.fn(X.slots[s], a, b);
    u0 += b - a;
  }
}

// y[s] = x[s] @ w[idx[s]] for each slot s: x f32[S, M, K], w [E, K, N] float32 or bfloat16,
// idx s32[S] (each in [0, E)), y f32[S, M, N].  The mixture-of-experts matmul of decoding:
// a step reads only the experts its tokens chose, in place (no gathered copy of the weights).
ffi::Error ExpertMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> idx,
                            ffi::ResultBuffer<ffi::F32> y, int64_t dtype, int64_t impl) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto id = idx.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 3 || wd.size() != 3 || id.size() != 1 || yd.size() != 3)
    return ffi::Error::InvalidArgument("expert_matmul: x [S, M, K], w [E, K, N], idx [S]");
  const int64_t S = xd[0], M = xd[1], K = xd[2], E = wd[0], N = wd[2];
  if (wd[1] != K || id[0] != S || yd[0] != S || yd[1] != M || yd[2] != N)
    return ffi::Error::InvalidArgument("expert_matmul: shape mismatch");
  Fmt fmt;
  if (!dense_format(w, dtype, &fmt))
    return ffi::Error::InvalidArgument("expert_matmul: w must be float32 (dtype=0) or bfloat16 (dtype=1)");
  const float* xp = x.typed_data();
  const int32_t* ip = idx.typed_data();
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.untyped_data());
  const int64_t wbytes = K * N * elem_bytes(fmt);
  float* yp = y->typed_data();
  for (int64_t s = 0; s < S; ++s)
    if (ip[s] < 0 || ip[s] >= E) return ffi::Error::InvalidArgument("expert_matmul: expert index out of range");
  const bool simd = use_avx512(impl);
  const int amx_min_m = g_amx_min_m.load(std::memory_order_relaxed);
  const bool amx = simd && fmt == kBF16 && amx_min_m > 0 && M >= amx_min_m && cpu_has_amx();
  if (amx || (simd && M > g_panel_min_m.load(std::memory_order_relaxed)) || K == 0 || N == 0) {
    thread_local std::vector<float> unused;  // many rows per slot: one matmul per slot
    for (int64_t s = 0; s < S; ++s)
      matmul_2d(xp + s * M * K, wp + ip[s] * wbytes, nullptr, nullptr, yp + s * M * N, M, K, N, fmt,
                0, static_cast<int>(impl), unused);
    return ffi::Error::Success();
  }
  // Few rows (decoding): every slot's column units are items of one job on the pool, so the
  // threads split all the chosen experts at once instead of synchronising once per slot.
  ExpertJob X;
  X.fn = nsplit_range(impl);
  X.units = (N + 15) / 16;
  X.slots.resize(static_cast<size_t>(S));
  const int64_t g = std::min<int64_t>(std::max(1, g_dense_group.load(std::memory_order_relaxed)), K);
  for (int64_t s = 0; s < S; ++s) {
    Job& J = X.slots[s];
    J.x = xp + s * M * K;
    J.xsum = nullptr;
    J.q = wp + ip[s] * wbytes;
    J.scale = J.off = nullptr;
    J.y = yp + s * M * N;
    J.M = M, J.K = K, J.N = N, J.g = g, J.G = (K + g - 1) / g;
    J.units = J.items = X.units;
    J.slabs = 0;
    J.part = nullptr;
    J.fmt = fmt;
  }
  Job all = X.slots[0];
  all.items = S * X.units;
  all.ctx = &X;
  run_job(all, expert_range, 4, 8, 4, S * wbytes * M);
  return ffi::Error::Success();
}

// Grouped matmul: x f32[R, K] holds the rows of each expert in turn (group_sizes s32[E] of
// them, summing to at most R), w [E, K, N] float32 or bfloat16; y f32[R, N] = each group's
// rows times its expert, rows past the groups zero.  The dropless MoE matmul of prefill: every
// expert runs once over exactly the rows routed to it (what jax.lax.ragged_dot means, which
// XLA:CPU lowers to a masked dense dot over every expert for every row).
ffi::Error RaggedMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> sizes,
                            ffi::ResultBuffer<ffi::F32> y, int64_t dtype, int64_t impl) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto sd = sizes.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 1 || yd.size() != 2)
    return ffi::Error::InvalidArgument("ragged_matmul: x [R, K], w [E, K, N], group_sizes [E]");
  const int64_t R = xd[0], K = xd[1], E = wd[0], N = wd[2];
  if (wd[1] != K || sd[0] != E || yd[0] != R || yd[1] != N)
    return ffi::Error::InvalidArgument("ragged_matmul: shape mismatch");
  Fmt fmt;
  if (!dense_format(w, dtype, &fmt))
    return ffi::Error::InvalidArgument("ragged_matmul: w must be float32 (dtype=0) or bfloat16 (dtype=1)");
  const int32_t* gp = sizes.typed_data();
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (gp[e] < 0) return ffi::Error::InvalidArgument("ragged_matmul: negative group size");
    total += gp[e];
  }
  if (total > R) return ffi::Error::InvalidArgument("ragged_matmul: group sizes exceed the rows");
  const float* xp = x.typed_data();
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.untyped_data());
  const int64_t wbytes = K * N * elem_bytes(fmt);
  float* yp = y->typed_data();
  thread_local std::vector<float> unused;
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    matmul_2d(xp + row * K, wp + e * wbytes, nullptr, nullptr, yp + row * N, gp[e], K, N, fmt, 0,
              static_cast<int>(impl), unused);
    row += gp[e];
  }
  std::fill(yp + row * N, yp + R * N, 0.f);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Decode attention over the KV cache
// ---------------------------------------------------------------------------------------------
//
// out[b, t, n, :] = softmax_s(scale * q[b, t, n] . k[b, n/G, s]) @ v[b, n/G, :, s], one softmax
// over the keys of all blocks (the cache before this step, the step's own keys), each block
// with its own visibility mask[b, t, s].  Layouts are the dense cache's: k [B, Kh, S, H] (a key
// is a contiguous row), v [B, Kh, H, S] (a value dimension is a contiguous row), float32 or
// bfloat16; q and out float32 [B, T, N, H], N = Kh * G.  A paged block (`jaxdec_paged_attention`)
// keeps them in a page pool instead: k and v [Kh, pages, ps, H] (a key and a value are rows), slot
// s of row b in pool page table[b, s / ps] at offset s % ps; its sums are the dense layout's, term
// for term and in the same order (values gathered lane by lane), so a paged cache decodes bit for
// bit as a dense one.  One work item is one (b, kv head): its
// G * T queries share every key and value row read.  Keys no query of the item sees are never
// read, and value rows are read only over the span of visible keys, so a cache read costs the
// visible context, not the allocated capacity.  A query that sees no key gets zeros.
// Scores, softmax and sums in f32; the AVX-512 path differs from the scalar one by rounding.

struct AttnBlock {
  const uint8_t* k;
  const uint8_t* v;
  const bool* mask;
  int64_t S;
  bool bf16;
  const int32_t* table = nullptr;  // a paged block's page table [B, width]; dense: none
  int64_t ps = 0, pages = 0, width = 0;
};

// Where the H elements of a key (or, in a paged block, a value) of slot s of one item live.
struct Rows {
  const uint8_t* base;
  const int32_t* table;  // this row's page table (paged), or null (dense: slot rows in order)
  int64_t ps, stride;    // stride: bytes of one row
  const uint8_t* operator()(int64_t s) const {
    return table ? base + (static_cast<int64_t>(table[s / ps]) * ps + s % ps) * stride : base + s * stride;
  }
};

// The rows of pool `p` (blk.k, or blk.v of a paged block) for item (b, kh).
inline Rows rows_of(const AttnBlock& blk, const uint8_t* p, int64_t b, int64_t Kh, int64_t kh, int64_t H) {
  const int64_t stride = H * (blk.bf16 ? 2 : 4);
  if (!blk.table) return {p + (b * Kh + kh) * blk.S * stride, nullptr, 0, stride};
  return {p + kh * blk.pages * blk.ps * stride, blk.table + b * blk.width, blk.ps, stride};
}

struct AttnJob {
  const float* q;
  float* out;
  std::vector<AttnBlock> blocks;
  int64_t T, N, Kh, G, H, S_total;
  float scale;
  bool simd, avx2;  // the AVX-512 code, else the AVX2 code, else the scalar loops
};

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float attn_elem(const uint8_t* p, int64_t i, bool bf16) {
  if (bf16) return bf16_to_float(reinterpret_cast<const uint16_t*>(p)[i]);
  return reinterpret_cast<const float*>(p)[i];
}

// Per-item scratch: scaled queries [TG, H], scores [TG, S_total], row max and sum [TG],
// visible-key span per block.
struct AttnScratch {
  std::vector<float> q, sc, mx, l;
  std::vector<int64_t> lo, hi;
};

// Pass 1 (scores), shared by both paths up to the dot product (inlined into each, so the
// AVX-512 dot is inlined too).
template <class Dot>
inline __attribute__((always_inline)) void attn_scores(const AttnJob& A, int64_t b, int64_t kh, AttnScratch& W, Dot dot) {
  const int64_t T = A.T, G = A.G, H = A.H, TG = T * G, St = A.S_total;
  const float ninf = -std::numeric_limits<float>::infinity();
  std::fill(W.mx.begin(), W.mx.end(), ninf);
  int64_t off = 0;
  for (size_t bi = 0; bi < A.blocks.size(); ++bi) {
    const AttnBlock& blk = A.blocks[bi];
    const int64_t S = blk.S;
    const bool* mk = blk.mask + b * T * S;
    const Rows krows = rows_of(blk, blk.k, b, A.Kh, kh, H);
    int64_t lo = S, hi = 0;
    for (int64_t s = 0; s < S; ++s) {
      bool any = false;
      for (int64_t t = 0; t < T; ++t) any |= mk[t * S + s];
      if (!any) {
        for (int64_t i = 0; i < TG; ++i) W.sc[i * St + off + s] = ninf;
        continue;
      }
      lo = std::min(lo, s);
      hi = s + 1;
      const uint8_t* krow = krows(s);
      for (int64_t t = 0; t < T; ++t) {
        const bool see = mk[t * S + s];
        for (int64_t g = 0; g < G; ++g) {
          const int64_t i = t * G + g;
          const float d = see ? dot(W.q.data() + i * H, krow, blk.bf16) : ninf;
          W.sc[i * St + off + s] = d;
          W.mx[i] = std::max(W.mx[i], d);
        }
      }
    }
    W.lo[bi] = lo;
    W.hi[bi] = hi;
    off += S;
  }
}

void attn_item_scalar(const AttnJob& A, int64_t u, AttnScratch& W) {
  const int64_t b = u / A.Kh, kh = u % A.Kh;
  const int64_t T = A.T, G = A.G, H = A.H, TG = T * G, St = A.S_total;
  attn_scores(A, b, kh, W, [H](const float* q, const uint8_t* k, bool bf16) {
    float d = 0.f;
    for (int64_t h = 0; h < H; ++h) d += q[h] * attn_elem(k, h, bf16);
    return d;
  });
  for (int64_t i = 0; i < TG; ++i) {
    float* row = W.sc.data() + i * St;
    float sum = 0.f;
    for (int64_t s = 0; s < St; ++s) {
      row[s] = row[s] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(row[s] - W.mx[i]);
      sum += row[s];
    }
    W.l[i] = sum;
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = t * G + g;
      float* o = A.out + ((b * T + t) * A.N + kh * G + g) * H;
      const float inv = W.l[i] > 0.f ? 1.f / W.l[i] : 0.f;
      for (int64_t h = 0; h < H; ++h) {
        float acc = 0.f;
        int64_t off = 0;
        for (size_t bi = 0; bi < A.blocks.size(); ++bi) {
          const AttnBlock& blk = A.blocks[bi];
          const int64_t S = blk.S, esz = blk.bf16 ? 2 : 4;
          const float* p = W.sc.data() + i * St + off;
          if (blk.table) {  // value rows: element h of each; a slot nobody sees adds 0, unread
            const Rows vrows = rows_of(blk, blk.v, b, A.Kh, kh, H);
            for (int64_t s = W.lo[bi]; s < W.hi[bi]; ++s)
              acc += p[s] * (p[s] != 0.f ? attn_elem(vrows(s), h, blk.bf16) : 0.f);
          } else {
            const uint8_t* vrow = blk.v + ((b * A.Kh + kh) * H + h) * S * esz;
            for (int64_t s = W.lo[bi]; s < W.hi[bi]; ++s) acc += p[s] * attn_elem(vrow, s, blk.bf16);
          }
          off += S;
        }
        o[h] = acc * inv;
      }
    }
}

#if QMM_X86

// 16 lanes of a f32 or bf16 row from element i (the first n < 16 lanes when masked; others 0).
QMM_TARGET QMM_INLINE __m512 attn_load16(const uint8_t* p, int64_t i, bool bf16, __mmask16 m) {
  if (bf16) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const uint16_t*>(p) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(p) + i);
}

// ln 2 in two parts (the first exact in few bits, so n * kLn2Hi is exact), and the Taylor
// coefficients of e^r, highest degree first: shared by exp_nonpos and exp_nonpos8.
constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187e-06f;
constexpr float kExpTaylor[8] = {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};

// e^x for x <= 0 (and -inf -> 0): x = n ln2 + r, |r| <= ln2/2, a degree-7 Taylor polynomial
// (relative error below 1e-8) scaled by 2^n.
QMM_TARGET QMM_INLINE __m512 exp_nonpos(__m512 x) {
  const __mmask16 finite = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                              _CMP_NEQ_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
#pragma GCC unroll 8
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpTaylor[i]));
  return _mm512_maskz_mov_ps(finite, _mm512_scalef_ps(p, n));
}


// Scores of NQ queries (rows of qs) against the keys of one block that mask row mk shows;
// -inf for the others.  Updates the running maxima mx and the visible span [lo, hi).
template <int NQ>
QMM_TARGET void attn_scores_avx512(const float* qs, int64_t H, const Rows& krows, bool bf16,
                                   const bool* mk, int64_t S, float* sc, int64_t St, float* mx,
                                   int64_t& lo, int64_t& hi) {
  const float ninf = -std::numeric_limits<float>::infinity();
  lo = S;
  hi = 0;
  for (int64_t s = 0; s < S; ++s) {
    if (!mk[s]) {
#pragma GCC unroll 8
      for (int j = 0; j < NQ; ++j) sc[j * St + s] = ninf;
      continue;
    }
    lo = std::min(lo, s);
    hi = s + 1;
    const uint8_t* krow = krows(s);
    __m512 acc[NQ];
#pragma GCC unroll 8
    for (int j = 0; j < NQ; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t h = 0; h < H; h += 16) {
      const __mmask16 m = tail_mask(H - h);
      const __m512 k = attn_load16(krow, h, bf16, m);
#pragma GCC unroll 8
      for (int j = 0; j < NQ; ++j) acc[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, qs + j * H + h), k, acc[j]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < NQ; ++j) {
      const float d = _mm512_reduce_add_ps(acc[j]);
      sc[j * St + s] = d;
      mx[j] = std::max(mx[j], d);
    }
  }
}

// o[j, :] += sum over s in [lo, hi) of p[j, s] * v[:, s] for NQ rows of probabilities p.
template <int NQ>
QMM_TARGET void attn_values_avx512(const float* p, int64_t St, const uint8_t* vb, bool bf16, int64_t H,
                                   int64_t S, int64_t lo, int64_t hi, float* o) {
  const int64_t esz = bf16 ? 2 : 4;
  for (int64_t h = 0; h < H; ++h) {
    const uint8_t* vrow = vb + h * S * esz;
    __m512 acc[NQ];
#pragma GCC unroll 8
    for (int j = 0; j < NQ; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t s = lo; s < hi; s += 16) {
      const __mmask16 m = tail_mask(hi - s);
      const __m512 v = attn_load16(vrow, s, bf16, m);
#pragma GCC unroll 8
      for (int j = 0; j < NQ; ++j) acc[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, p + j * St + s), v, acc[j]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < NQ; ++j) o[j * H + h] += _mm512_reduce_add_ps(acc[j]);
  }
}

// attn_values_avx512 over a paged block's value rows: lane i of a 16-slot step gathers element
// h of slot s + i, so every product and sum is the dense layout's, in its order.  A lane whose
// slot no query weighs (p = 0 for all NQ) is not read (a page nobody wrote may hold NaN).
// bfloat16 lanes gather the aligned 32-bit word holding element h (rows start 4-byte aligned,
// H even), so no read leaves the row.
template <int NQ>
QMM_TARGET void attn_values_paged_avx512(const float* p, int64_t St, const Rows& vrows, bool bf16, int64_t H,
                                         int64_t lo, int64_t hi, float* o) {
  const int64_t steps = hi > lo ? (hi - lo + 15) / 16 : 0;
  thread_local std::vector<int64_t> at;     // per step: 16 row offsets from vrows.base
  thread_local std::vector<__mmask16> use;  // lanes some query weighs
  at.resize(steps * 16);
  use.resize(steps);
  for (int64_t c = 0; c < steps; ++c) {
    const int64_t s0 = lo + 16 * c;
    const __mmask16 m = tail_mask(hi - s0);
    __mmask16 any = 0;
#pragma GCC unroll 8
    for (int j = 0; j < NQ; ++j)
      any |= _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, p + j * St + s0), _mm512_setzero_ps(), _CMP_NEQ_UQ);
    use[c] = any;
    for (int i = 0; i < 16; ++i) at[16 * c + i] = s0 + i < hi ? vrows(s0 + i) - vrows.base : 0;
  }
  for (int64_t h = 0; h < H; ++h) {
    const __m512i off = _mm512_set1_epi64(bf16 ? (h & ~int64_t(1)) * 2 : h * 4);
    __m512 acc[NQ];
#pragma GCC unroll 8
    for (int j = 0; j < NQ; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < steps; ++c) {
      const int64_t s = lo + 16 * c;
      const __mmask16 m = tail_mask(hi - s), u = use[c];
      const __m512i i0 = _mm512_add_epi64(_mm512_loadu_si512(at.data() + 16 * c), off);
      const __m512i i1 = _mm512_add_epi64(_mm512_loadu_si512(at.data() + 16 * c + 8), off);
      const __m256i w0 = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), static_cast<__mmask8>(u), i0,
                                                     vrows.base, 1);
      const __m256i w1 = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), static_cast<__mmask8>(u >> 8), i1,
                                                     vrows.base, 1);
      __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);
      if (bf16) w = h & 1 ? _mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))
                          : _mm512_slli_epi32(w, 16);
      const __m512 v = _mm512_castsi512_ps(w);
#pragma GCC unroll 8
      for (int j = 0; j < NQ; ++j) acc[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, p + j * St + s), v, acc[j]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < NQ; ++j) o[j * H + h] += _mm512_reduce_add_ps(acc[j]);
  }
}

// Row of St scores -> e^(score - mx) in place; returns 1 / their sum (0 if none is visible).
QMM_TARGET float attn_softmax_avx512(float* row, int64_t St, float mx) {
  const __m512 m = _mm512_set1_ps(mx == -std::numeric_limits<float>::infinity() ? 0.f : mx);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t s = 0; s < St; s += 16) {
    const __mmask16 k = tail_mask(St - s);
    const __m512 e = exp_nonpos(_mm512_sub_ps(
        _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), k, row + s), m));
    _mm512_mask_storeu_ps(row + s, k, e);
    sum = _mm512_add_ps(sum, e);
  }
  const float l = _mm512_reduce_add_ps(sum);
  return l > 0.f ? 1.f / l : 0.f;
}

// ---- AVX2 decode attention: the AVX-512 code at 8 lanes.  A partial last step of 8 is read
// through a zero-filled copy (AVX2 has no masked 16-bit loads, and no read may leave a row).

// The horizontal sum of 8 lanes in a fixed order: ((0+4)+(2+6)) + ((1+5)+(3+7)).
QMM_TARGET2 QMM_INLINE float hsum8(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

// 8 lanes of a f32 or bf16 row from element i; the first n < 8 only (others `fill`).
QMM_TARGET2 QMM_INLINE __m256 attn_load8(const uint8_t* p, int64_t i, bool bf16, int64_t n, float fill = 0.f) {
  if (n >= 8) {
    if (bf16) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(p) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + i);
  }
  alignas(32) float t[8];
  for (int k = 0; k < 8; ++k) t[k] = k < n ? attn_elem(p, i + k, bf16) : fill;
  return _mm256_load_ps(t);
}

QMM_TARGET2 QMM_INLINE __m256 load8f(const float* p, int64_t n, float fill = 0.f) {
  return attn_load8(reinterpret_cast<const uint8_t*>(p), 0, false, n, fill);
}

// e^x for x <= 0 (and -inf -> 0), as exp_nonpos, with x clamped at -87 (2^n stays normal;
// e^-87 is 1.6e-38, nothing beside the largest weight, 1).
QMM_TARGET2 QMM_INLINE __m256 exp_nonpos8(__m256 x) {
  const __m256 finite = _mm256_cmp_ps(x, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
#pragma GCC unroll 8
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTaylor[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), finite);
}

// As attn_scores_avx512.
template <int NQ>
QMM_TARGET2 void attn_scores_avx2(const float* qs, int64_t H, const Rows& krows, bool bf16, const bool* mk,
                                  int64_t S, float* sc, int64_t St, float* mx, int64_t& lo, int64_t& hi) {
  const float ninf = -std::numeric_limits<float>::infinity();
  lo = S;
  hi = 0;
  for (int64_t s = 0; s < S; ++s) {
    if (!mk[s]) {
      for (int j = 0; j < NQ; ++j) sc[j * St + s] = ninf;
      continue;
    }
    lo = std::min(lo, s);
    hi = s + 1;
    const uint8_t* krow = krows(s);
    __m256 acc[NQ];
#pragma GCC unroll 8
    for (int j = 0; j < NQ; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t h = 0; h < H; h += 8) {
      const __m256 k = attn_load8(krow, h, bf16, H - h);
#pragma GCC unroll 8
      for (int j = 0; j < NQ; ++j) acc[j] = _mm256_fmadd_ps(load8f(qs + j * H + h, H - h), k, acc[j]);
    }
    for (int j = 0; j < NQ; ++j) {
      const float d = hsum8(acc[j]);
      sc[j * St + s] = d;
      mx[j] = std::max(mx[j], d);
    }
  }
}

// As attn_values_avx512: lane i of step c holds slot lo + 8c + i.
template <int NQ>
QMM_TARGET2 void attn_values_avx2(const float* p, int64_t St, const uint8_t* vb, bool bf16, int64_t H, int64_t S,
                                  int64_t lo, int64_t hi, float* o) {
  const int64_t esz = bf16 ? 2 : 4;
  for (int64_t h = 0; h < H; ++h) {
    const uint8_t* vrow = vb + h * S * esz;
    __m256 acc[NQ];
#pragma GCC unroll 8
    for (int j = 0; j < NQ; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t s = lo; s < hi; s += 8) {
      const __m256 v = attn_load8(vrow, s, bf16, hi - s);
#pragma GCC unroll 8
      for (int j = 0; j < NQ; ++j) acc[j] = _mm256_fmadd_ps(load8f(p + j * St + s, hi - s), v, acc[j]);
    }
    for (int j = 0; j < NQ; ++j) o[j * H + h] += hsum8(acc[j]);
  }
}

// attn_values_avx2 over a paged block's value rows, without gathers: slot s's whole row goes
// into lane (s - lo) % 8 of every element's accumulator (kept per lane, A[j][lane][h]), so each
// lane sums the same products in the same order as the dense layout, and the lanes are then
// added in hsum8's order.  A slot no query weighs (p = 0 for all NQ) is not read (a page
// nobody wrote may hold NaN); in the dense layout it adds 0.
template <int NQ>
QMM_TARGET2 void attn_values_paged_avx2(const float* p, int64_t St, const Rows& vrows, bool bf16, int64_t H,
                                        int64_t lo, int64_t hi, float* o) {
  const int64_t Hp = (H + 7) / 8 * 8;
  thread_local std::vector<float> acc_buf;
  acc_buf.assign(static_cast<size_t>(NQ * 8 * Hp), 0.f);
  float* A = acc_buf.data();
  for (int64_t s = lo; s < hi; ++s) {
    bool any = false;
    for (int j = 0; j < NQ; ++j) any |= p[j * St + s] != 0.f;
    if (!any) continue;
    const uint8_t* vr = vrows(s);
    const int64_t lane = (s - lo) & 7;
    __m256 pj[NQ];
    for (int j = 0; j < NQ; ++j) pj[j] = _mm256_set1_ps(p[j * St + s]);
    for (int64_t h = 0; h < H; h += 8) {
      const __m256 v = attn_load8(vr, h, bf16, H - h);
#pragma GCC unroll 8
      for (int j = 0; j < NQ; ++j) {
        float* a = A + (j * 8 + lane) * Hp + h;
        _mm256_storeu_ps(a, _mm256_fmadd_ps(pj[j], v, _mm256_loadu_ps(a)));
      }
    }
  }
  for (int j = 0; j < NQ; ++j) {
    const float* a = A + j * 8 * Hp;
    for (int64_t h = 0; h < H; h += 8) {
      __m256 l[8];
      for (int i = 0; i < 8; ++i) l[i] = _mm256_loadu_ps(a + i * Hp + h);
      const __m256 r = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(l[0], l[4]), _mm256_add_ps(l[2], l[6])),
                                     _mm256_add_ps(_mm256_add_ps(l[1], l[5]), _mm256_add_ps(l[3], l[7])));
      alignas(32) float t[8];
      _mm256_store_ps(t, r);
      for (int64_t k = 0; k < std::min<int64_t>(8, H - h); ++k) o[j * H + h + k] += t[k];
    }
  }
}

QMM_TARGET2 float attn_softmax_avx2(float* row, int64_t St, float mx) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const __m256 m = _mm256_set1_ps(mx == ninf ? 0.f : mx);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t s = 0; s < St; s += 8) {
    const __m256 e = exp_nonpos8(_mm256_sub_ps(load8f(row + s, St - s, ninf), m));
    if (St - s >= 8) {
      _mm256_storeu_ps(row + s, e);
    } else {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, e);
      for (int64_t k = 0; k < St - s; ++k) row[s + k] = tmp[k];
    }
    sum = _mm256_add_ps(sum, e);
  }
  const float l = hsum8(sum);
  return l > 0.f ? 1.f / l : 0.f;
}

// The vector code of one instruction set, for attn_queries: Avx512Attn, Avx2Attn.
#define QMM_ATTN_ISA(NAME, SFX)                                                                        \
  struct NAME {                                                                                        \
    template <int NQ>                                                                                  \
    static void scores(const float* qs, int64_t H, const Rows& krows, bool bf16, const bool* mk, int64_t S, \
                       float* sc, int64_t St, float* mx, int64_t& lo, int64_t& hi) {                   \
      attn_scores_##SFX<NQ>(qs, H, krows, bf16, mk, S, sc, St, mx, lo, hi);                           \
    }                                                                                                  \
    static float softmax(float* row, int64_t St, float mx) { return attn_softmax_##SFX(row, St, mx); } \
    template <int NQ>                                                                                  \
    static void values(const float* p, int64_t St, const uint8_t* vb, bool bf16, int64_t H, int64_t S, \
                       int64_t lo, int64_t hi, float* o) {                                             \
      attn_values_##SFX<NQ>(p, St, vb, bf16, H, S, lo, hi, o);                                         \
    }                                                                                                  \
    template <int NQ>                                                                                  \
    static void values_paged(const float* p, int64_t St, const Rows& vrows, bool bf16, int64_t H,       \
                             int64_t lo, int64_t hi, float* o) {                                       \
      attn_values_paged_##SFX<NQ>(p, St, vrows, bf16, H, lo, hi, o);                                   \
    }                                                                                                  \
  };
QMM_ATTN_ISA(Avx512Attn, avx512)
QMM_ATTN_ISA(Avx2Attn, avx2)
#undef QMM_ATTN_ISA

// Queries (t, g0 .. g0+NQ) of item (b, kh): all blocks, softmax, values, into A.out, with the
// vector code of `Isa` (Avx512Attn, Avx2Attn).
template <class Isa, int NQ>
void attn_queries(const AttnJob& A, int64_t b, int64_t kh, int64_t t, int64_t g0, AttnScratch& W) {
  const int64_t H = A.H, St = A.S_total, i0 = t * A.G + g0;
  const float* qs = W.q.data() + i0 * H;
  float* sc = W.sc.data() + i0 * St;
  float mx[NQ], o[NQ * 256];
  float* out = H <= 256 ? o : W.l.data();  // (W.l is sized for larger heads, see attn_range)
  for (int j = 0; j < NQ; ++j) mx[j] = -std::numeric_limits<float>::infinity();
  int64_t off = 0;
  for (size_t bi = 0; bi < A.blocks.size(); ++bi) {
    const AttnBlock& blk = A.blocks[bi];
    Isa::template scores<NQ>(qs, H, rows_of(blk, blk.k, b, A.Kh, kh, H), blk.bf16,
                             blk.mask + (b * A.T + t) * blk.S, blk.S, sc + off, St, mx, W.lo[bi], W.hi[bi]);
    off += blk.S;
  }
  float inv[NQ];
  for (int j = 0; j < NQ; ++j) inv[j] = Isa::softmax(sc + j * St, St, mx[j]);
  std::fill(out, out + NQ * H, 0.f);
  off = 0;
  for (size_t bi = 0; bi < A.blocks.size(); ++bi) {
    const AttnBlock& blk = A.blocks[bi];
    if (blk.table) {
      Isa::template values_paged<NQ>(sc + off, St, rows_of(blk, blk.v, b, A.Kh, kh, H), blk.bf16, H, W.lo[bi],
                                     W.hi[bi], out);
    } else {
      const uint8_t* vb = blk.v + (b * A.Kh + kh) * H * blk.S * (blk.bf16 ? 2 : 4);
      Isa::template values<NQ>(sc + off, St, vb, blk.bf16, H, blk.S, W.lo[bi], W.hi[bi], out);
    }
    off += blk.S;
  }
  for (int j = 0; j < NQ; ++j) {
    float* dst = A.out + ((b * A.T + t) * A.N + kh * A.G + g0 + j) * H;
    for (int64_t h = 0; h < H; ++h) dst[h] = out[j * H + h] * inv[j];
  }
}

// Item u = (b, kh): its queries in groups of up to 8.
template <class Isa>
void attn_item(const AttnJob& A, int64_t u, AttnScratch& W) {
  const int64_t b = u / A.Kh, kh = u % A.Kh;
  for (int64_t t = 0; t < A.T; ++t)
    for (int64_t g0 = 0; g0 < A.G; g0 += 8) {
      switch (std::min<int64_t>(8, A.G - g0)) {
        case 1: attn_queries<Isa, 1>(A, b, kh, t, g0, W); break;
        case 2: attn_queries<Isa, 2>(A, b, kh, t, g0, W); break;
        case 3: attn_queries<Isa, 3>(A, b, kh, t, g0, W); break;
        case 4: attn_queries<Isa, 4>(A, b, kh, t, g0, W); break;
        case 5: attn_queries<Isa, 5>(A, b, kh, t, g0, W); break;
        case 6: attn_queries<Isa, 6>(A, b, kh, t, g0, W); break;
        case 7: attn_queries<Isa, 7>(A, b, kh, t, g0, W); break;
        default: attn_queries<Isa, 8>(A, b, kh, t, g0, W); break;
      }
    }
}

void attn_item_avx512(const AttnJob& A, int64_t u, AttnScratch& W) { attn_item<Avx512Attn>(A, u, W); }
void attn_item_avx2(const AttnJob& A, int64_t u, AttnScratch& W) { attn_item<Avx2Attn>(A, u, W); }

#else
void attn_item_avx512(const AttnJob& A, int64_t u, AttnScratch& W) { attn_item_scalar(A, u, W); }
void attn_item_avx2(const AttnJob& A, int64_t u, AttnScratch& W) { attn_item_scalar(A, u, W); }
#endif  // QMM_X86

void attn_range(const Job& J, int64_t u0, int64_t u1) {
  const AttnJob& A = *static_cast<const AttnJob*>(J.ctx);
  thread_local AttnScratch tls;
  AttnScratch& W = tls;  // one TLS lookup (the library is PIC)
  const int64_t TG = A.T * A.G;
  W.q.resize(static_cast<size_t>(TG * A.H));
  W.sc.resize(static_cast<size_t>(TG * A.S_total));
  W.mx.resize(static_cast<size_t>(TG));
  W.l.resize(static_cast<size_t>(std::max<int64_t>(TG, 8 * A.H)));
  W.lo.resize(A.blocks.size());
  W.hi.resize(A.blocks.size());
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t b = u / A.Kh, kh = u % A.Kh;
    for (int64_t t = 0; t < A.T; ++t)
      for (int64_t g = 0; g < A.G; ++g) {
        const float* src = A.q + ((b * A.T + t) * A.N + kh * A.G + g) * A.H;
        float* dst = W.q.data() + (t * A.G + g) * A.H;
        for (int64_t h = 0; h < A.H; ++h) dst[h] = src[h] * A.scale;
      }
    if (A.simd)
      attn_item_avx512(A, u, W);
    else if (A.avx2)
      attn_item_avx2(A, u, W);
    else
      attn_item_scalar(A, u, W);
  }
}

// A job over q [B, T, N, H] into out; the caller adds its blocks and sets Kh, G, S_total.
AttnJob attn_job(const float* q, float* out, int64_t T, int64_t N, int64_t H, float scale, int64_t impl) {
  AttnJob A;
  A.q = q;
  A.out = out;
  A.T = T;
  A.N = N;
  A.H = H;
  A.Kh = A.G = A.S_total = 0;
  A.scale = scale;
  A.simd = use_avx512(impl);
  A.avx2 = !A.simd && impl != 1 && cpu_has_avx2();
  return A;
}

// Runs A's B * Kh items (one per sequence and kv head) on the pool.
void run_attention(AttnJob& A, int64_t B, int64_t bytes) {
  Job J{};
  J.ctx = &A;
  J.items = B * A.Kh;
  J.M = 1;
  run_job(J, attn_range, 1, 2, 4, bytes);
}

// args: q f32[B, T, N, H], then (k, v, mask) per block.
ffi::Error AttentionImpl(ffi::Buffer<ffi::F32> q, ffi::RemainingArgs rest, ffi::ResultBuffer<ffi::F32> out,
                         float scale, int64_t impl) {
  const auto qd = q.dimensions();
  if (qd.size() != 4) return ffi::Error::InvalidArgument("attention: q must be [B, T, N, H]");
  const int64_t B = qd[0], T = qd[1], N = qd[2], H = qd[3];
  if (rest.size() == 0 || rest.size() % 3 != 0)
    return ffi::Error::InvalidArgument("attention: blocks come as (k, v, mask) triples");
  AttnJob A = attn_job(q.typed_data(), out->typed_data(), T, N, H, scale, impl);
  int64_t bytes = 0;
  for (size_t i = 0; i < rest.size(); i += 3) {
    auto k = rest.get<ffi::AnyBuffer>(i);
    auto v = rest.get<ffi::AnyBuffer>(i + 1);
    auto m = rest.get<ffi::Buffer<ffi::PRED>>(i + 2);
    if (!k.has_value() || !v.has_value() || !m.has_value())
      return ffi::Error::InvalidArgument("attention: a block is not (k, v, bool mask)");
    const auto kd = k->dimensions(), vd = v->dimensions(), md = m->dimensions();
    if (kd.size() != 4 || vd.size() != 4 || md.size() != 3)
      return ffi::Error::InvalidArgument("attention: k, v must be 4-D and mask 3-D");
    const int64_t Kh = kd[1], S = kd[2];
    const auto et = k->element_type();
    if ((et != ffi::F32 && et != ffi::BF16) || v->element_type() != et)
      return ffi::Error::InvalidArgument("attention: k and v must both be float32 or bfloat16");
    if (kd[0] != B || kd[3] != H || vd[0] != B || vd[1] != Kh || vd[2] != H || vd[3] != S ||
        md[0] != B || md[1] != T || md[2] != S || Kh <= 0 || N % Kh != 0 || (A.Kh && Kh != A.Kh))
      return ffi::Error::InvalidArgument("attention: block shapes do not match q");
    A.Kh = Kh;
    A.blocks.push_back({reinterpret_cast<const uint8_t*>(k->untyped_data()),
                        reinterpret_cast<const uint8_t*>(v->untyped_data()), m->typed_data(), S,
                        et == ffi::BF16});
    A.S_total += S;
    bytes += 2 * B * Kh * S * H * (et == ffi::BF16 ? 2 : 4);
  }
  A.G = N / A.Kh;
  if (B * T * N * H == 0) return ffi::Error::Success();
  run_attention(A, B, bytes);
  return ffi::Error::Success();
}

// args: q f32[B, T, N, H], k and v pools [Kh, pages, ps, H] (f32 or bf16), page table
// s32[B, width], mask bool[B, T, width * ps].  Every table entry must name a pool page.
ffi::Error PagedAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::PRED> mask,
                              ffi::ResultBuffer<ffi::F32> out, float scale, int64_t impl) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const auto td = table.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || td.size() != 2 || md.size() != 3)
    return ffi::Error::InvalidArgument("paged attention: q [B, T, N, H], pools [Kh, pages, ps, H], "
                                       "table [B, width], mask [B, T, S]");
  const int64_t B = qd[0], T = qd[1], N = qd[2], H = qd[3], Kh = kd[0], pages = kd[1], ps = kd[2];
  const auto et = k.element_type();
  if ((et != ffi::F32 && et != ffi::BF16) || v.element_type() != et)
    return ffi::Error::InvalidArgument("paged attention: k and v must both be float32 or bfloat16");
  if (kd[3] != H || vd[0] != Kh || vd[1] != pages || vd[2] != ps || vd[3] != H || td[0] != B ||
      md[0] != B || md[1] != T || md[2] != td[1] * ps || Kh <= 0 || N % Kh != 0 || (et == ffi::BF16 && H % 2))
    return ffi::Error::InvalidArgument("paged attention: shapes do not match");
  const int32_t* tb = table.typed_data();
  for (int64_t i = 0; i < td[0] * td[1]; ++i)
    if (tb[i] < 0 || tb[i] >= pages) return ffi::Error::InvalidArgument("paged attention: a page index is out of range");
  AttnJob A = attn_job(q.typed_data(), out->typed_data(), T, N, H, scale, impl);
  A.Kh = Kh;
  A.G = N / Kh;
  A.S_total = md[2];
  AttnBlock blk{reinterpret_cast<const uint8_t*>(k.untyped_data()), reinterpret_cast<const uint8_t*>(v.untyped_data()),
                mask.typed_data(), md[2], et == ffi::BF16};
  blk.table = tb;
  blk.ps = ps;
  blk.pages = pages;
  blk.width = td[1];
  A.blocks.push_back(blk);
  if (B * T * N * H == 0) return ffi::Error::Success();
  run_attention(A, B, 2 * B * Kh * md[2] * H * (et == ffi::BF16 ? 2 : 4));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdec_qmatmul, QMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // q (s8 or u8)
                                  .Arg<ffi::Buffer<ffi::F16>>()  // scale
                                  .Arg<ffi::Buffer<ffi::F16>>()  // offset (ignored if absent)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group_size")
                                  .Attr<bool>("has_offset")
                                  .Attr<int64_t>("impl"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdec_dense_matmul, DenseMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // w (f32 or bf16)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Attr<int64_t>("dtype")
                                  .Attr<int64_t>("impl"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdec_expert_matmul, ExpertMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [S, M, K]
                                  .Arg<ffi::AnyBuffer>()         // w [E, K, N] (f32 or bf16)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // idx [S]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [S, M, N]
                                  .Attr<int64_t>("dtype")
                                  .Attr<int64_t>("impl"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdec_ragged_matmul, RaggedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [R, K]
                                  .Arg<ffi::AnyBuffer>()         // w [E, K, N] (f32 or bf16)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes [E]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [R, N]
                                  .Attr<int64_t>("dtype")
                                  .Attr<int64_t>("impl"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdec_attention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .RemainingArgs()               // (k, v, mask) per block
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("impl"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdec_paged_attention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::AnyBuffer>()          // k pool
                                  .Arg<ffi::AnyBuffer>()          // v pool
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page table
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("impl"));

extern "C" {

// 1 if the AVX-512 path is used on this CPU.
int jaxdec_qmm_has_simd() { return cpu_has_avx512() ? 1 : 0; }
// The matmul path of this CPU: 2 AVX-512, 1 AVX2, 0 scalar loops.
int jaxdec_qmm_isa() { return cpu_has_avx512() ? 2 : cpu_has_avx2() ? 1 : 0; }
// 1 if bf16 and quantised W with M >= jaxdec_qmm_amx_min_m() rows use AMX tiles.
int jaxdec_qmm_has_amx() { return cpu_has_amx() ? 1 : 0; }
int jaxdec_qmm_amx_min_m() { return g_amx_min_m.load(); }
void jaxdec_qmm_set_amx_min_m(int m) { g_amx_min_m.store(m); }

// Threads the pool has (the caller included); creates nothing.
int jaxdec_qmm_pool_threads() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  return pool_threads_locked();
}

// Cap on threads used per call (0: all the pool's).
void jaxdec_qmm_set_active_threads(int n) { g_active_threads.store(n < 0 ? 0 : n); }
void jaxdec_qmm_set_panel_min_m(int m) { g_panel_min_m.store(m); }
// Rows of W per block for the dense formats: register path (M <= panel_min_m), panel path.
// slab_bytes: bytes of W per K slab (0: never split K; negative: unchanged).
void jaxdec_qmm_set_dense(int rows, int panel_rows, int slab_bytes) {
  if (rows > 0) g_dense_group.store(rows);
  if (panel_rows > 0) g_dense_group_panel.store(panel_rows);
  if (slab_bytes >= 0) g_slab_bytes.store(slab_bytes);
}
// out[0..2]: parallel calls, bad ones (straggler or preempted caller), fallbacks to one thread.
void jaxdec_qmm_stats(long long* out) {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  out[0] = g_adapt.total_parallel;
  out[1] = g_adapt.total_bad;
  out[2] = g_adapt.total_fallbacks;
}
void jaxdec_qmm_set_adaptive(int on) {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  g_adapt.enabled = on != 0;
  g_adapt.serial_until = {};
}
void jaxdec_qmm_set_prefetch(int on) { g_prefetch.store(on != 0); }
void jaxdec_qmm_set_spin_us(int us) { g_spin_us.store(us < 0 ? 0 : us); }
void jaxdec_qmm_set_min_parallel_bytes(long long b) { g_min_parallel_bytes.store(b < 0 ? 0 : b); }

// Raw entry points (no XLA): for benchmarks of the kernel alone.
void jaxdec_qmm_raw(const float* x, const void* q, const uint16_t* scale, const uint16_t* off,
                    float* y, long long M, long long K, long long N, int bits, long long g,
                    int impl) {
  thread_local std::vector<float> buf;
  matmul_2d(x, reinterpret_cast<const uint8_t*>(q), scale, off, y, M, K, N, bits == 8 ? kInt8 : kInt4, g,
            impl, buf);
}

// dtype: 0 float32, 1 bfloat16.
void jaxdec_dense_raw(const float* x, const void* w, float* y, long long M, long long K, long long N,
                      int dtype, int impl) {
  thread_local std::vector<float> buf;
  matmul_2d(x, reinterpret_cast<const uint8_t*>(w), nullptr, nullptr, y, M, K, N, dtype == 1 ? kBF16 : kF32, 0,
            impl, buf);
}

}  // extern "C"

