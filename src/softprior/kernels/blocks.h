// Vector helpers and the causal mask shared by softprior's CPU kernels (attention.cpp, step.cpp):
// lanes of VL scalars as GCC/Clang vectors, e^x lane by lane, fixed-order lane reductions, aligned
// scratch buffers, R-row products accumulated in order (one output element per lane), and Mask.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t VL = 16;  // lanes of a tile: local rows are padded to a multiple of it
constexpr int64_t R = 8;    // rows computed together: R independent accumulator chains per tile

inline int64_t rounded(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
inline int64_t padded(int64_t n) { return rounded(n, VL); }

// A tile is VL = 16 lanes: local rows are padded to whole tiles, and every per-lane accumulation and
// lane reduction below runs in the order 16 lanes define. The arithmetic runs on the target's own
// vector registers (``Reg``): a tile is one AVX-512 register, two AVX2 registers, four NEON or SSE2
// registers, always in the same order, so the kernels' bits are the same on every ISA. (GCC lowers a
// 16-lane vector wider than the target's registers to memory, moved through general registers lane
// pair by lane pair, and a comparison on it lane by lane with a branch each: the AVX2 build was 2x
// slower than the AVX-512 one on the same CPU for that alone; docs/DESIGN.md, "ISA".)
#if defined(__AVX512F__)
constexpr int64_t NATIVE_BYTES = 64;
#elif defined(__AVX__)
constexpr int64_t NATIVE_BYTES = 32;
#else
constexpr int64_t NATIVE_BYTES = 16;  // SSE2, NEON
#endif
template <typename scalar_t>
struct Native {  // one target register of scalar_t (``type``; ``any``: loaded from or stored to any address)
  typedef scalar_t type __attribute__((vector_size(NATIVE_BYTES)));
  typedef scalar_t any __attribute__((vector_size(NATIVE_BYTES), aligned(sizeof(scalar_t))));
  static constexpr int64_t lanes = NATIVE_BYTES / sizeof(scalar_t), parts = VL / lanes;  // parts: registers a tile
  static_assert(VL % lanes == 0, "a tile holds whole registers");
};
template <typename scalar_t>
using Reg = typename Native<scalar_t>::type;

// e^x lane by lane, for the softmax: Cephes' expf (S. L. Moshier, Cephes Math Library, expf.c):
// x = n ln 2 + r with |r| <= ln(2)/2, e^r by its degree-6 polynomial, 2^n by the exponent bits;
// about 1 ulp. Below -87.3 (e^x under the smallest normal float) it gives 0, so a masked logit
// (-inf) gives an exact 0, as std::exp does.
inline Reg<float> exp_lanes(Reg<float> x) {
  using N = Reg<float>;
  typedef int32_t I __attribute__((vector_size(NATIVE_BYTES)));
  const N lo = N{} - 87.3f, hi = N{} + 88.3f;
  N xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const N n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  N r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const N z = r * r;
  N y = N{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  N scale;
  std::memcpy(&scale, &bits, sizeof(N));
  return x < lo ? N{} : y * scale;
}

inline Reg<double> exp_lanes(Reg<double> x) {  // float64: for gradcheck, not speed
  for (int64_t l = 0; l < Native<double>::lanes; ++l) x[l] = std::exp(x[l]);
  return x;
}

// one tile's lanes (its registers p[0 .. parts)) reduced in a fixed pairwise order, whatever the
// compiler and the ISA: lane l takes lane l + w for w = 8, 4, 2, 1; across registers while w spans
// whole ones, then by shuffles within one (extracting lanes one by one cost more than the rest of a
// softmax row). Overwrites p.
template <typename scalar_t, typename Op>
inline scalar_t lane_reduce(Reg<scalar_t>* p, Op op) {
  constexpr int64_t P = Native<scalar_t>::parts, NL = Native<scalar_t>::lanes;
  for (int64_t w = P / 2; w >= 1; w /= 2)
    for (int64_t k = 0; k < w; ++k) p[k] = op(p[k], p[k + w]);
  Reg<scalar_t> x = p[0];
  if constexpr (NL == 16) {
    x = op(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    x = op(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    x = op(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    x = op(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  } else if constexpr (NL == 8) {
    x = op(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3));
    x = op(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5));
    x = op(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6));
  } else if constexpr (NL == 4) {
    x = op(x, __builtin_shufflevector(x, x, 2, 3, 0, 1));
    x = op(x, __builtin_shufflevector(x, x, 1, 0, 3, 2));
  } else {
    static_assert(NL == 2, "a register of 2, 4, 8 or 16 lanes");
    x = op(x, __builtin_shufflevector(x, x, 1, 0));
  }
  return x[0];
}
static_assert(VL == 16, "lane_reduce's order is that of 16 lanes");
template <typename scalar_t>
inline scalar_t lane_sum(Reg<scalar_t>* p) { return lane_reduce<scalar_t>(p, [](auto x, auto y) { return x + y; }); }
template <typename scalar_t>
inline scalar_t lane_max(Reg<scalar_t>* p) { return lane_reduce<scalar_t>(p, [](auto x, auto y) { return x > y ? x : y; }); }

template <typename T>
struct Buffer {  // a zeroed, 64-byte aligned scratch array of n elements
  std::unique_ptr<T[], decltype(&std::free)> ptr;
  explicit Buffer(int64_t n)
      : ptr(static_cast<T*>(std::aligned_alloc(64, rounded(n * sizeof(T), 64) + 64)), &std::free) {
    TORCH_CHECK(ptr, "softprior attention: out of memory for a block buffer");
    std::fill(ptr.get(), ptr.get() + n, T(0));
  }
  T* get() const { return ptr.get(); }
  T& operator[](int64_t i) const { return ptr[i]; }
};

// out[r][c] = sum_{i0 <= i < n} a_r[i * ai] m[i][c] for r < R and c < tiles * VL, accumulated in
// order of i, one output element per lane (a_r: R row pointers, ai their element stride; m: rows of
// stride mp holding whole tiles; out: row stride os), one register of columns at a time. A term with
// a_r[i] = 0 adds an exact 0, so starting past every row's leading zeros (i0) or running past a row's
// trailing zeros (n) leaves the row's bits as they are.
template <typename scalar_t>
inline void rows_times(const scalar_t* const* a, int64_t ai, int64_t i0, int64_t n, const scalar_t* m, int64_t mp,
                       int64_t tiles, scalar_t* out, int64_t os) {
  using N = Reg<scalar_t>;
  using U = typename Native<scalar_t>::any;
  for (int64_t c = 0; c < tiles * VL; c += Native<scalar_t>::lanes) {
    N acc[R];
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) acc[r] = N{};
    for (int64_t i = i0; i < n; ++i) {
      const N mi = *reinterpret_cast<const U*>(m + i * mp + c);
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) acc[r] += a[r][i * ai] * mi;
    }
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) *reinterpret_cast<U*>(out + r * os + c) = acc[r];
  }
}

// acc[c] += x[c] for c < tiles * VL (both 64-byte aligned)
template <typename scalar_t>
inline void add_tiles(scalar_t* acc, const scalar_t* x, int64_t tiles) {
  using N = Reg<scalar_t>;
  N* a = reinterpret_cast<N*>(acc);
  const N* b = reinterpret_cast<const N*>(x);
  for (int64_t k = 0; k < tiles * Native<scalar_t>::parts; ++k) a[k] += b[k];
}

// R row pointers base + (r0 + r) * stride for r < R; rows at or past `rows` point at row 0 (their
// results are not used)
template <typename scalar_t>
struct Rows {
  const scalar_t* p[R];
  Rows(const scalar_t* base, int64_t stride, int64_t r0, int64_t rows) {
    for (int64_t r = 0; r < R; ++r) p[r] = base + (r0 + r < rows ? r0 + r : 0) * stride;
  }
};

// dst[0 .. n) = src[0 .. n), inline: rows are short, and a call to memmove per row cost more than
// the copy (the build passes -fno-tree-loop-distribute-patterns so that GCC keeps this a loop)
template <typename scalar_t>
inline void copy_n(const scalar_t* src, int64_t n, scalar_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}

// copies src [rows, cols] (row stride cols) into dst with row stride dp, or transposed into
// dst[c][r] with row stride dp; the padding stays as it was (zero)
template <typename scalar_t>
inline void load_rows(const scalar_t* src, int64_t rows, int64_t cols, scalar_t* dst, int64_t dp) {
  for (int64_t r = 0; r < rows; ++r) copy_n(src + r * cols, cols, dst + r * dp);
}
template <typename scalar_t>
inline void load_transposed(const scalar_t* src, int64_t rows, int64_t cols, scalar_t* dst, int64_t dp) {
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = 0; r < rows; ++r) dst[c * dp + r] = src[r * cols + c];
}

// What the bias masks, per (run, head): lim[kh][i], one past the last key query i sees; first[kh][j],
// the first query that sees key j (Tq where none); the bias padded to TP columns with -inf (and -inf
// past lim). The B blocks of a (run, head) share it, so it is found once per call.
template <typename scalar_t>
struct Mask {
  std::vector<int64_t> lim, first;
  Buffer<scalar_t> bias;
  Mask(const scalar_t* b, int64_t KH, int64_t Tq, int64_t T)
      : lim(rounded(KH * Tq, R) + R, 0), first(KH * rounded(T, R) + R, Tq), bias(KH * Tq * padded(T)) {
    const scalar_t ninf = -std::numeric_limits<scalar_t>::infinity();
    const int64_t TP = padded(T), KR = rounded(T, R);
    for (int64_t kh = 0; kh < KH; ++kh)
      for (int64_t i = 0; i < Tq; ++i) {
        const scalar_t* row = b + (kh * Tq + i) * T;
        int64_t j = T;
        while (j > 0 && row[j - 1] == ninf) --j;
        lim[kh * Tq + i] = j;
        scalar_t* out = bias.get() + (kh * Tq + i) * TP;
        for (int64_t c = 0; c < TP; ++c) out[c] = c < j ? row[c] : ninf;
        for (int64_t c = 0; c < j; ++c)
          if (row[c] != ninf && first[kh * KR + c] == Tq) first[kh * KR + c] = i;
      }
  }
  // the largest lim of query rows g*R .. g*R+R-1 of (run, head) kh (rows past Tq count 0)
  int64_t group_lim(int64_t kh, int64_t Tq, int64_t g) const {
    int64_t m = 0;
    for (int64_t i = g * R; i < std::min(Tq, g * R + R); ++i) m = std::max(m, lim[kh * Tq + i]);
    return m;
  }
};

// out[j] = row[idx[j]] for j < tiles * VL (idx: indices into row, every one valid; width: the row's
// padded length). Where the row is at most two tiles (a vocabulary of up to 32 tokens) and held in
// registers: on AVX-512 each tile is one two-table permute (vpermt2ps); on AVX2 each register of the
// output is a permute (vpermps) of each of the row's four registers, chosen between by bits 3 and 4 of
// the index (two blends); elsewhere element by element. A copy either way: the same bits.
template <typename scalar_t>
inline void gather_tiles(const scalar_t* row, int64_t width, const int32_t* idx, int64_t tiles, scalar_t* out) {
#if defined(__AVX512F__)
  static_assert(VL == 16, "one permute fills 16 lanes");
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (width <= 2 * VL) {
      const __m512 lo = _mm512_loadu_ps(row), hi = width > VL ? _mm512_loadu_ps(row + VL) : lo;
      for (int64_t t = 0; t < tiles; ++t)
        _mm512_storeu_ps(out + t * VL, _mm512_permutex2var_ps(lo, _mm512_loadu_si512(idx + t * VL), hi));
      return;
    }
  }
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (width <= 2 * VL) {
      __m256 r[4];
      for (int64_t k = 0; k < 4; ++k) r[k] = 8 * k < width ? _mm256_loadu_ps(row + 8 * k) : r[0];
      for (int64_t j = 0; j < tiles * VL; j += 8) {
        const __m256i i = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + j));
        const __m256 b3 = _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)), b4 = _mm256_castsi256_ps(_mm256_slli_epi32(i, 27));
        const __m256 lo = _mm256_blendv_ps(_mm256_permutevar8x32_ps(r[0], i), _mm256_permutevar8x32_ps(r[1], i), b3);
        const __m256 hi = _mm256_blendv_ps(_mm256_permutevar8x32_ps(r[2], i), _mm256_permutevar8x32_ps(r[3], i), b3);
        _mm256_storeu_ps(out + j, _mm256_blendv_ps(lo, hi, b4));
      }
      return;
    }
  }
#endif
  for (int64_t j = 0; j < tiles * VL; ++j) out[j] = row[idx[j]];
}

// src itself where its rows (stride cols) are whole tiles, else a copy in buf with rows padded to tiles
template <typename scalar_t>
inline const scalar_t* as_tiles(const scalar_t* src, int64_t rows, int64_t cols, scalar_t* buf) {
  if (cols % VL == 0) return src;
  load_rows(src, rows, cols, buf, padded(cols));
  return buf;
}

// row (TP lanes) <- softmax(row + bias) over its first `tiles` tiles, zero past them (bias: -inf past
// the keys the row sees); a row whose every key is masked becomes NaN, as torch.softmax gives. Lane l
// of a tile's register k is lane k * lanes + l of the tile: the order of 16 lanes on every ISA.
template <typename scalar_t>
inline void softmax_row(scalar_t* row, const scalar_t* bias, int64_t tiles, int64_t TP) {
  using N = Reg<scalar_t>;
  constexpr int64_t P = Native<scalar_t>::parts;
  const scalar_t ninf = -std::numeric_limits<scalar_t>::infinity();
  N* x = reinterpret_cast<N*>(row);
  const N* b = reinterpret_cast<const N*>(bias);
  N mx[P], sum[P];
  for (int64_t k = 0; k < P; ++k) mx[k] = N{} + ninf, sum[k] = N{};
  for (int64_t t = 0; t < tiles * P; t += P)
    for (int64_t k = 0; k < P; ++k) {
      x[t + k] += b[t + k];
      mx[k] = mx[k] > x[t + k] ? mx[k] : x[t + k];
    }
  const scalar_t m = lane_max<scalar_t>(mx);
  if (m == ninf) {
    std::fill(row, row + TP, std::numeric_limits<scalar_t>::quiet_NaN());
    return;
  }
  for (int64_t t = 0; t < tiles * P; t += P)
    for (int64_t k = 0; k < P; ++k) {
      x[t + k] = exp_lanes(x[t + k] - m);
      sum[k] += x[t + k];
    }
  const scalar_t inv = scalar_t(1) / lane_sum<scalar_t>(sum);
  for (int64_t t = 0; t < tiles * P; ++t) x[t] *= inv;
  for (int64_t t = tiles * P; t < TP / VL * P; ++t) x[t] = N{};
}

// the softmax's backward for one row: ds = p * (dp - sum_j dp_j p_j) over `tiles` tiles, zero past them
template <typename scalar_t>
inline void softmax_grad_row(const scalar_t* p, const scalar_t* dp, scalar_t* ds, int64_t tiles, int64_t TP) {
  using N = Reg<scalar_t>;
  constexpr int64_t P = Native<scalar_t>::parts;
  const N* pi = reinterpret_cast<const N*>(p);
  const N* dpi = reinterpret_cast<const N*>(dp);
  N* dsi = reinterpret_cast<N*>(ds);
  N acc[P];
  for (int64_t k = 0; k < P; ++k) acc[k] = N{};
  for (int64_t t = 0; t < tiles * P; t += P)
    for (int64_t k = 0; k < P; ++k) acc[k] += dpi[t + k] * pi[t + k];
  const scalar_t dot = lane_sum<scalar_t>(acc);
  for (int64_t t = 0; t < tiles * P; ++t) dsi[t] = pi[t] * (dpi[t] - dot);
  for (int64_t t = tiles * P; t < TP / VL * P; ++t) dsi[t] = N{};
}

}  // namespace
