// jaxdec CPU kernel: y f32[M, N] = x f32[M, K] @ W, with W stored quantised.
//
// Weight format (the fixed contract shared with the Python QArray type):
//   bits=8: q int8[K, N]
//   bits=4: q uint8[K/2, N]; byte (i, n) holds the code of row 2i in its low nibble and
//           row 2i+1 in its high nibble; codes are unsigned 0..15.
//   scale float16[K/g, N]; offset float16[K/g, N] or absent.
//   W[k, n] = q[k, n] * scale[k/g, n] + offset[k/g, n]
// so per group:  y[n] += scale[g, n] * sum_k x[k] q[k, n] + offset[g, n] * sum_k x[k].
//
// The AVX-512 path widens the codes to f32 (int8: vpmovsxbd + vcvtdq2ps; int4: vpmovzxbd and a
// 16-entry vpermps table per nibble) and FMAs them against broadcast x.  M <= 8: per-group
// register accumulators for an M-block of up to 4 rows x 64 columns, scale/offset applied at the
// end of each group.  M > 8: each group's 64-column chunk is widened once into an L1 panel and
// consumed by blocks of 6 rows.  No quantisation of x: the only error is f32 rounding.  A
// portable scalar path is used when the CPU lacks AVX-512 (chosen at run time; the AVX-512
// functions carry target attributes, so the library builds with plain -O3 and runs anywhere).
//
// Work is split over N (in chunks of 64-column multiples) between the calling thread and a
// small persistent pool of workers that spin for a while after each job and then sleep on a
// condvar; chunks are claimed dynamically, and the pool backs off to one thread when the
// machine is oversubscribed (see Adaptive).  Columns never depend on the split, so results are
// bitwise identical for any thread count.
//
// Exported:
//   jaxdec_qmatmul            the XLA FFI handler (typed API)
//   jaxdec_qmm_*              small C helpers for tuning and tests (ctypes)

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
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

struct Job {
  const float* x;        // [M, K]
  const float* xsum;     // [M, G]  sums of x over each group (only when has_off)
  const uint8_t* q;      // int8 [K, N] or packed uint8 [K/2, N]
  const uint16_t* scale; // f16 bits [G, N]
  const uint16_t* off;   // f16 bits [G, N] or null
  float* y;              // [M, N]
  int64_t M, K, N, G, g;
  int64_t units;         // ceil(N / 16)
  int64_t chunk_units;   // units per chunk of work handed to a thread
  int bits;
};

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

void scalar_range(const Job& J, int64_t u0, int64_t u1) {
  const int64_t c_begin = u0 * 16;
  const int64_t c_end = std::min(u1 * 16, J.N);
  if (c_begin >= c_end) return;
  const int64_t N = J.N, K = J.K, g = J.g, G = J.G;
  for (int64_t m = 0; m < J.M; ++m)
    std::memset(J.y + m * N + c_begin, 0, sizeof(float) * (c_end - c_begin));
  float acc[64];
  float sc[64];
  for (int64_t c = c_begin; c < c_end; c += 64) {
    const int64_t w = std::min<int64_t>(64, c_end - c);
    for (int64_t gi = 0; gi < G; ++gi) {
      for (int64_t j = 0; j < w; ++j) sc[j] = half_to_float(J.scale[gi * N + c + j]);
      for (int64_t m = 0; m < J.M; ++m) {
        const float* xp = J.x + m * K + gi * g;
        for (int64_t j = 0; j < w; ++j) acc[j] = 0.f;
        if (J.bits == 8) {
          const int8_t* row = reinterpret_cast<const int8_t*>(J.q) + gi * g * N + c;
          for (int64_t kk = 0; kk < g; ++kk, row += N) {
            const float xk = xp[kk];
            for (int64_t j = 0; j < w; ++j) acc[j] += xk * static_cast<float>(row[j]);
          }
        } else {
          const uint8_t* row = J.q + gi * (g / 2) * N + c;
          for (int64_t kk = 0; kk < g / 2; ++kk, row += N) {
            const float x0 = xp[2 * kk], x1 = xp[2 * kk + 1];
            for (int64_t j = 0; j < w; ++j) {
              const uint8_t b = row[j];
              acc[j] += x0 * static_cast<float>(b & 15) + x1 * static_cast<float>(b >> 4);
            }
          }
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
QMM_INLINE int64_t prefetch_offset(const Job& J, int64_t gi) {
  const int64_t row_bytes = J.N, rows = J.bits == 8 ? J.g : J.g / 2;
  if (rows * row_bytes <= 128 * 1024) return gi + 1 < J.G ? rows * row_bytes : 0;
  return 256;
}

// One group `gi` of a band: `nchunks` column chunks of 16*NV columns starting at c0 (the last
// vector of the last chunk masked by tmask when TAIL), each for `mblocks` blocks of MB rows of
// x starting at m0.  Accumulates into y.  The chunk loop is outside the M-block loop so each
// chunk of codes (g rows x 64 bytes at most) is reused from L1 by every M-block.
template <int MB, int NV, bool INT4, bool OFF, bool TAIL>
QMM_TARGET void tile_avx512(const Job& J, int64_t m0, int64_t mblocks, int64_t c0, int64_t nchunks,
                            __mmask16 tmask, int64_t gi) {
  const int64_t N = J.N, K = J.K, g = J.g, G = J.G;
  const __m512i lo_mask = _mm512_set1_epi32(15);
  const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  (void)lo_mask;
  (void)lut;
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const int64_t c = c0 + ch * 16 * NV;
    const bool tail = TAIL && ch == nchunks - 1;
    // Scale / offset of this group and chunk.
    __m512 s[NV], o[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      const uint16_t* sp = J.scale + gi * N + c + 16 * v;
      if (tail && v == NV - 1)
        s[v] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tmask, sp));
      else
        s[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp)));
      if (OFF) {
        const uint16_t* op = J.off + gi * N + c + 16 * v;
        if (tail && v == NV - 1)
          o[v] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tmask, op));
        else
          o[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(op)));
      } else {
        o[v] = _mm512_setzero_ps();
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
      if (!INT4) {
        const int8_t* qp = reinterpret_cast<const int8_t*>(J.q) + gi * g * N + c;
        const int64_t pf = mb != 0 ? 0 : prefetch_offset(J, gi);
        for (int64_t kk = 0; kk < g; ++kk, qp += N) {
          if (QMM_PREFETCH && pf) {
            _mm_prefetch(reinterpret_cast<const char*>(qp + pf), _MM_HINT_T0);
            if (NV > 2) _mm_prefetch(reinterpret_cast<const char*>(qp + pf + 32), _MM_HINT_T0);
          }
          __m512 w[NV];
#pragma GCC unroll 16
          for (int v = 0; v < NV; ++v) {
            __m128i b;
            if (tail && v == NV - 1)
              b = _mm_maskz_loadu_epi8(tmask, qp + 16 * v);
            else
              b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qp + 16 * v));
            w[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
          }
#pragma GCC unroll 16
          for (int m = 0; m < MB; ++m) {
            const __m512 xb = _mm512_set1_ps(xp[m * K + kk]);
#pragma GCC unroll 16
            for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_fmadd_ps(xb, w[v], acc[m][v]);
          }
        }
      } else {
        const uint8_t* qp = J.q + gi * (g / 2) * N + c;
        const int64_t pf = mb != 0 ? 0 : prefetch_offset(J, gi);
        for (int64_t kk = 0; kk < g / 2; ++kk, qp += N) {
          if (QMM_PREFETCH && pf) {
            _mm_prefetch(reinterpret_cast<const char*>(qp + pf), _MM_HINT_T0);
            if (NV > 2) _mm_prefetch(reinterpret_cast<const char*>(qp + pf + 32), _MM_HINT_T0);
          }
          __m512 wl[NV], wh[NV];
#pragma GCC unroll 16
          for (int v = 0; v < NV; ++v) {
            __m128i b;
            if (tail && v == NV - 1)
              b = _mm_maskz_loadu_epi8(tmask, qp + 16 * v);
            else
              b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qp + 16 * v));
            const __m512i d = _mm512_cvtepu8_epi32(b);
#if QMM_INT4_LUT
            // vpermps reads only the low 4 bits of each index: a 16-entry table lookup.
            wl[v] = _mm512_permutexvar_ps(d, lut);
            wh[v] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), lut);
#else
            wl[v] = _mm512_cvtepi32_ps(_mm512_and_si512(d, lo_mask));
            wh[v] = _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4));
#endif
          }
#pragma GCC unroll 16
          for (int m = 0; m < MB; ++m) {
            const __m512 x0 = _mm512_set1_ps(xp[m * K + 2 * kk]);
            const __m512 x1 = _mm512_set1_ps(xp[m * K + 2 * kk + 1]);
#pragma GCC unroll 16
            for (int v = 0; v < NV; ++v) {
              acc[m][v] = _mm512_fmadd_ps(x0, wl[v], acc[m][v]);
              acc[m][v] = _mm512_fmadd_ps(x1, wh[v], acc[m][v]);
            }
          }
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

constexpr int kMaxMB = 4;
constexpr int kMaxNV = 4;

// Instantiated: 64-column chunks (NV=4) and single vectors (NV=1, the band remainders), the
// latter also with a masked tail; MB = 1..4.
template <bool INT4, bool OFF>
struct TileTable {
  static constexpr TileFn wide[kMaxMB] = {tile_avx512<1, 4, INT4, OFF, false>, tile_avx512<2, 4, INT4, OFF, false>,
                                          tile_avx512<3, 4, INT4, OFF, false>, tile_avx512<4, 4, INT4, OFF, false>};
  static constexpr TileFn one[kMaxMB] = {tile_avx512<1, 1, INT4, OFF, false>, tile_avx512<2, 1, INT4, OFF, false>,
                                         tile_avx512<3, 1, INT4, OFF, false>, tile_avx512<4, 1, INT4, OFF, false>};
  static constexpr TileFn tail[kMaxMB] = {tile_avx512<1, 1, INT4, OFF, true>, tile_avx512<2, 1, INT4, OFF, true>,
                                          tile_avx512<3, 1, INT4, OFF, true>, tile_avx512<4, 1, INT4, OFF, true>};
};

// kind: 0 wide (NV=4), 1 one vector, 2 one masked vector.
TileFn lookup_tile(bool int4, bool off, int kind, int mb) {
  const int i = mb - 1;
#define QMM_PICK(I4, OF) \
  (kind == 0 ? TileTable<I4, OF>::wide[i] : kind == 1 ? TileTable<I4, OF>::one[i] : TileTable<I4, OF>::tail[i])
  if (int4) return off ? QMM_PICK(true, true) : QMM_PICK(true, false);
  return off ? QMM_PICK(false, true) : QMM_PICK(false, false);
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
QMM_TARGET void fill_panel(const Job& J, int64_t gi, int64_t k0, int64_t rows, int64_t c, int ncols,
                           Panel& P) {
  const int64_t N = J.N, g = J.g;
  __mmask16 vm[4];
  for (int v = 0; v < 4; ++v) {
    const int n = std::max(0, std::min(16, ncols - 16 * v));
    vm[v] = static_cast<__mmask16>((1u << n) - 1u);
  }
  if (J.bits == 8) {
    const int8_t* qp = reinterpret_cast<const int8_t*>(J.q) + (gi * g + k0) * N + c;
    const int64_t pf = prefetch_offset(J, gi);
    for (int64_t k = 0; k < rows; ++k, qp += N) {
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(qp + pf), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const __m128i b = _mm_maskz_loadu_epi8(vm[v], qp + 16 * v);
        _mm512_store_ps(&P.w[k][16 * v], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
      }
    }
  } else {
    const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const uint8_t* qp = J.q + (gi * g + k0) / 2 * N + c;
    const int64_t pf = prefetch_offset(J, gi);
    for (int64_t k = 0; k < rows; k += 2, qp += N) {
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(qp + pf), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const __m512i d = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(vm[v], qp + 16 * v));
        _mm512_store_ps(&P.w[k][16 * v], _mm512_permutexvar_ps(d, lut));
        _mm512_store_ps(&P.w[k + 1][16 * v], _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), lut));
      }
    }
  }
}

QMM_TARGET void fill_panel_scales(const Job& J, int64_t gi, int64_t c, int ncols, Panel& P) {
  for (int v = 0; v < 4; ++v) {
    const int n = std::max(0, std::min(16, ncols - 16 * v));
    const __mmask16 m = static_cast<__mmask16>((1u << n) - 1u);
    _mm512_store_ps(&P.s[16 * v], _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, J.scale + gi * J.N + c + 16 * v)));
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
        for (int64_t k0 = 0; k0 < g; k0 += kMaxGroup) {
          const int64_t rows = std::min<int64_t>(kMaxGroup, g - k0);
          const bool first = k0 == 0, last = k0 + rows == g;
          fill_panel(J, gi, k0, rows, c, ncols, *P);
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

  const bool int4 = J.bits == 4, off = J.off != nullptr;
  const int64_t rem = N % 16;
  const __mmask16 tmask = rem ? static_cast<__mmask16>((1u << rem) - 1u) : static_cast<__mmask16>(0xffff);
  // M-blocks: as many full blocks of kMaxMB as fit, then one smaller block.
  const int64_t mfull = J.M / kMaxMB, mlast = J.M % kMaxMB;
  // Band width in units of 16 columns (a multiple of kMaxNV).
  int64_t band = kBandYBytes / (J.M * 64);
  band = std::max<int64_t>(kMaxNV, band / kMaxNV * kMaxNV);
  for (int64_t ub = u0; ub < u1; ub += band) {
    const int64_t ue = std::min(ub + band, u1);
    const bool has_tail = rem != 0 && ue == J.units;
    // 64-column chunks, then single vectors, the very last one masked when N % 16 != 0.
    const int64_t nvec = ue - ub - (has_tail ? 1 : 0);
    const int64_t nwide = nvec / kMaxNV, nsingle = nvec % kMaxNV;
    const int64_t c_single = (ub + nwide * kMaxNV) * 16, c_tail = (ue - 1) * 16;
    for (int64_t gi = 0; gi < J.G; ++gi) {
      for (int pass = 0; pass < 2; ++pass) {
        const int64_t mblocks = pass == 0 ? mfull : (mlast ? 1 : 0);
        const int mb = pass == 0 ? kMaxMB : static_cast<int>(mlast);
        if (mblocks == 0) continue;
        const int64_t m0 = pass == 0 ? 0 : mfull * kMaxMB;
        if (nwide > 0) lookup_tile(int4, off, 0, mb)(J, m0, mblocks, ub * 16, nwide, tmask, gi);
        if (nsingle > 0) lookup_tile(int4, off, 1, mb)(J, m0, mblocks, c_single, nsingle, tmask, gi);
        if (has_tail) lookup_tile(int4, off, 2, mb)(J, m0, mblocks, c_tail, 1, tmask, gi);
      }
    }
  }
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
inline unsigned get_fp_mode() { return _mm_getcsr(); }
inline void set_fp_mode(unsigned v) { _mm_setcsr(v); }

#else  // !QMM_X86

void avx512_range(const Job& J, int64_t u0, int64_t u1) { scalar_range(J, u0, u1); }
bool cpu_has_avx512() { return false; }
inline void cpu_relax() {}
inline unsigned get_fp_mode() { return 0; }
inline void set_fp_mode(unsigned) {}

#endif  // QMM_X86

// ---------------------------------------------------------------------------------------------
// Thread pool: the calling thread takes part; workers spin on the work word for spin_us after
// each job, then sleep on a condition variable.
// ---------------------------------------------------------------------------------------------

using RangeFn = void (*)(const Job&, int64_t, int64_t);


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

// Work is handed out in chunks (column ranges) through one atomic word
//   work_ = [job serial : 24][participants : 8][chunk count : 16][next chunk : 16]
// that the caller and the workers claim from with compare-and-swap.  A claim succeeds only
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
                       (static_cast<uint64_t>(nchunks) << 16);
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
      const uint64_t n = (w >> 16) & 0xffff, i = w & 0xffff;
      if (i >= n) break;
      if (!work_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel, std::memory_order_acquire))
        continue;
      const Job& J = *job_;
      const int64_t u0 = J.chunk_units * static_cast<int64_t>(i);
      const int64_t u1 = std::min(J.units, u0 + J.chunk_units);
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
// 4 such calls in a window of 16 switch to one thread for 100 ms (doubling, up to 5 s, while it
// keeps happening), then parallel calls resume and are judged again.
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
  static constexpr int kWindow = 16, kBadLimit = 4, kMinBackoffMs = 100, kMaxBackoffMs = 5000;
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

void run_job(Job& J, bool use_simd) {
  const RangeFn fn = use_simd ? avx512_range : scalar_range;
  const int64_t qbytes = (J.bits == 8 ? J.K : J.K / 2) * J.N;
  int want = 1;
  if (qbytes * std::max<int64_t>(1, J.M) >= g_min_parallel_bytes.load(std::memory_order_relaxed) &&
      J.units >= 8) {
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
        // About kChunksPerThread chunks per thread, each a multiple of 4 units (64 columns).
        constexpr int64_t kChunksPerThread = 4;
        int64_t cu = (J.units + want * kChunksPerThread - 1) / (want * kChunksPerThread);
        cu = std::max<int64_t>(4, (cu + 3) / 4 * 4);
        int64_t nchunks = (J.units + cu - 1) / cu;
        while (nchunks > 0xffff) {
          cu *= 2;
          nchunks = (J.units + cu - 1) / cu;
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
  J.chunk_units = J.units;
  fn(J, 0, J.units);
}

// ---------------------------------------------------------------------------------------------
// Driver shared by the FFI handler and the raw C entry point
// ---------------------------------------------------------------------------------------------

// impl: 0 auto, 1 scalar, 2 simd (falls back to scalar if unsupported)
void qmatmul_2d(const float* x, const uint8_t* q, const uint16_t* scale, const uint16_t* off,
                float* y, int64_t M, int64_t K, int64_t N, int bits, int64_t g, int impl,
                std::vector<float>& xsum_buf) {
  if (M == 0 || N == 0) return;
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
  J.G = K / g;
  J.units = (N + 15) / 16;
  J.bits = bits;
  J.xsum = nullptr;
  if (K == 0) {
    for (int64_t i = 0; i < M * N; ++i) y[i] = 0.f;
    return;
  }
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
  const bool simd = impl != 1 && cpu_has_avx512();
  run_job(J, simd);
}

int64_t prod(ffi::Span<const int64_t> d, size_t from, size_t to) {
  int64_t p = 1;
  for (size_t i = from; i < to; ++i) p *= d[i];
  return p;
}

ffi::Error QMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::Buffer<ffi::F16> scale,
                       ffi::Buffer<ffi::F16> offset, ffi::ResultBuffer<ffi::F32> y, int64_t bits,
                       int64_t group_size, bool has_offset, int64_t impl) {
  if (bits != 4 && bits != 8) return ffi::Error::InvalidArgument("qmatmul: bits must be 4 or 8");
  const auto xd = x.dimensions();
  const auto qd = q.dimensions();
  const auto sd = scale.dimensions();
  const auto yd = y->dimensions();
  const size_t r = yd.size();
  if (r < 2 || xd.size() != r || qd.size() != r || sd.size() != r)
    return ffi::Error::InvalidArgument("qmatmul: operands must share a rank >= 2");
  if (has_offset && offset.dimensions().size() != r)
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
  if (has_offset) {
    const auto od = offset.dimensions();
    if (od[r - 2] != G || od[r - 1] != N) return ffi::Error::InvalidArgument("qmatmul: offset shape");
  }
  // Leading (vmap) dimensions: each operand's are 1 or equal to the result's.
  auto od = offset.dimensions();
  bool weights_batched = false;
  for (size_t i = 0; i + 2 < r; ++i) {
    const int64_t b = yd[i];
    auto ok = [b](int64_t d) { return d == 1 || d == b; };
    if (!ok(xd[i]) || !ok(qd[i]) || !ok(sd[i]) || (has_offset && !ok(od[i])))
      return ffi::Error::InvalidArgument("qmatmul: batch dimension mismatch");
    if (qd[i] != 1 || sd[i] != 1 || (has_offset && od[i] != 1)) weights_batched = true;
  }
  const float* xp = x.typed_data();
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.untyped_data());
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.typed_data());
  const uint16_t* op = has_offset ? reinterpret_cast<const uint16_t*>(offset.typed_data()) : nullptr;
  float* yp = y->typed_data();
  const int impl_i = static_cast<int>(impl);
  thread_local std::vector<float> xsum_buf;
  const int64_t B = prod(yd, 0, r - 2);
  if (!weights_batched) {
    // x's leading dims are all 1 or all equal to y's; either way its rows are contiguous.
    const int64_t xB = prod(xd, 0, r - 2);
    if (xB == B) {
      qmatmul_2d(xp, qp, sp, op, yp, B * M, K, N, static_cast<int>(bits), g, impl_i, xsum_buf);
    } else {  // x broadcast along some batch dims: each batch element is the same product.
      qmatmul_2d(xp, qp, sp, op, yp, M, K, N, static_cast<int>(bits), g, impl_i, xsum_buf);
      for (int64_t b = 1; b < B; ++b) std::memcpy(yp + b * M * N, yp, sizeof(float) * M * N);
    }
    return ffi::Error::Success();
  }
  // General broadcasting over the leading dims.
  for (int64_t b = 0; b < B; ++b) {
    int64_t rem = b, xi = 0, qi = 0, si = 0, oi = 0;
    int64_t xs = 1, qs = 1, ss = 1, os = 1;
    for (size_t i = r - 2; i-- > 0;) {
      const int64_t idx = rem % yd[i];
      rem /= yd[i];
      if (xd[i] != 1) xi += idx * xs;
      if (qd[i] != 1) qi += idx * qs;
      if (sd[i] != 1) si += idx * ss;
      if (has_offset && od[i] != 1) oi += idx * os;
      xs *= xd[i];
      qs *= qd[i];
      ss *= sd[i];
      if (has_offset) os *= od[i];
    }
    qmatmul_2d(xp + xi * M * K, qp + qi * Kq * N, sp + si * G * N, op ? op + oi * G * N : nullptr,
               yp + b * M * N, M, K, N, static_cast<int>(bits), g, impl_i, xsum_buf);
  }
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

extern "C" {

// 1 if the AVX-512 path is used on this CPU.
int jaxdec_qmm_has_simd() { return cpu_has_avx512() ? 1 : 0; }

// Threads the pool has (the caller included); creates nothing.
int jaxdec_qmm_pool_threads() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  return pool_threads_locked();
}

// Cap on threads used per call (0: all the pool's).
void jaxdec_qmm_set_active_threads(int n) { g_active_threads.store(n < 0 ? 0 : n); }
void jaxdec_qmm_set_panel_min_m(int m) { g_panel_min_m.store(m); }
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
void jaxdec_qmm_set_spin_us(int us) { g_spin_us.store(us < 0 ? 0 : us); }
void jaxdec_qmm_set_min_parallel_bytes(long long b) { g_min_parallel_bytes.store(b < 0 ? 0 : b); }

// Raw entry point (no XLA): for benchmarks of the kernel alone.
void jaxdec_qmm_raw(const float* x, const void* q, const uint16_t* scale, const uint16_t* off,
                    float* y, long long M, long long K, long long N, int bits, long long g,
                    int impl) {
  thread_local std::vector<float> buf;
  qmatmul_2d(x, reinterpret_cast<const uint8_t*>(q), scale, off, y, M, K, N, bits, g, impl, buf);
}

}  // extern "C"
