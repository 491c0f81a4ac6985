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
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t VL = 16;  // lanes of a tile: local rows are padded to a multiple of it
constexpr int64_t R = 8;    // rows computed together: R independent accumulator chains per tile

inline int64_t rounded(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
inline int64_t padded(int64_t n) { return rounded(n, VL); }

template <typename scalar_t>
struct Lanes {  // VL lanes of scalar_t as one GCC/Clang vector, kept in registers
  typedef scalar_t type __attribute__((vector_size(VL * sizeof(scalar_t))));
};
typedef int32_t Int32Lanes __attribute__((vector_size(VL * sizeof(int32_t))));

// e^x lane by lane, for the softmax: Cephes' expf (S. L. Moshier, Cephes Math Library, expf.c):
// x = n ln 2 + r with |r| <= ln(2)/2, e^r by its degree-6 polynomial, 2^n by the exponent bits;
// about 1 ulp. Below -87.3 (e^x under the smallest normal float) it gives 0, so a masked logit
// (-inf) gives an exact 0, as std::exp does.
inline Lanes<float>::type exp_lanes(Lanes<float>::type x) {
  using V = Lanes<float>::type;
  const V lo = V{} - 87.3f, hi = V{} + 88.3f;
  V xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const V n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  V r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const V z = r * r;
  V y = V{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const Int32Lanes bits = (__builtin_convertvector(n, Int32Lanes) + 127) << 23;
  const V scale = reinterpret_cast<const V&>(bits);
  return x < lo ? V{} : y * scale;
}

inline Lanes<double>::type exp_lanes(Lanes<double>::type x) {  // float64: for gradcheck, not speed
  for (int64_t l = 0; l < VL; ++l) x[l] = std::exp(x[l]);
  return x;
}

// the lanes' sum (max) in a fixed pairwise order, whatever the compiler: lane l adds lane l + w for
// w = 8, 4, 2, 1 (by shuffles: extracting lanes one by one cost more than the rest of a softmax row)
template <typename V, typename Op>
inline auto lane_reduce(V a, Op op) {
  a = op(a, __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  a = op(a, __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  a = op(a, __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  a = op(a, __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return a[0];
}
static_assert(VL == 16, "lane_reduce's shuffles are written for 16 lanes");
template <typename V>
inline auto lane_sum(V a) { return lane_reduce(a, [](V x, V y) { return x + y; }); }
template <typename V>
inline auto lane_max(V a) { return lane_reduce(a, [](V x, V y) { return x > y ? x : y; }); }

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

template <typename scalar_t>
struct Unaligned {  // VL lanes loaded from or stored to any address
  typedef scalar_t type __attribute__((vector_size(VL * sizeof(scalar_t)), aligned(sizeof(scalar_t))));
};

// out[r][c] = sum_{i0 <= i < n} a_r[i * ai] m[i][c] for r < R and c < tiles * VL, accumulated in
// order of i, one output element per lane (a_r: R row pointers, ai their element stride; m: rows of
// stride mp holding whole tiles; out: row stride os). A term with a_r[i] = 0 adds an exact 0, so
// starting past every row's leading zeros (i0) or running past a row's trailing zeros (n) leaves the
// row's bits as they are.
template <typename scalar_t>
inline void rows_times(const scalar_t* const* a, int64_t ai, int64_t i0, int64_t n, const scalar_t* m, int64_t mp,
                       int64_t tiles, scalar_t* out, int64_t os) {
  using V = typename Lanes<scalar_t>::type;
  using U = typename Unaligned<scalar_t>::type;
  for (int64_t t = 0; t < tiles; ++t) {
    V acc[R];
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) acc[r] = V{};
    for (int64_t i = i0; i < n; ++i) {
      const V mi = *reinterpret_cast<const U*>(m + i * mp + t * VL);
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) acc[r] += a[r][i * ai] * mi;
    }
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) *reinterpret_cast<U*>(out + r * os + t * VL) = acc[r];
  }
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

// out[j] = row[idx[j]] for j < tiles * VL (idx: indices into row, every one valid). Where the CPU has
// AVX-512 and the row is at most two tiles (a vocabulary of up to 32 tokens), each tile is one
// two-table permute (vpermt2ps) of the row held in registers; elsewhere element by element.
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
// the keys the row sees); a row whose every key is masked becomes NaN, as torch.softmax gives
template <typename scalar_t>
inline void softmax_row(scalar_t* row, const scalar_t* bias, int64_t tiles, int64_t TP) {
  using V = typename Lanes<scalar_t>::type;
  const scalar_t ninf = -std::numeric_limits<scalar_t>::infinity();
  V* x = reinterpret_cast<V*>(row);
  const V* b = reinterpret_cast<const V*>(bias);
  V mx = V{} + ninf;
  for (int64_t t = 0; t < tiles; ++t) {
    x[t] += b[t];
    mx = mx > x[t] ? mx : x[t];
  }
  const scalar_t m = lane_max(mx);
  if (m == ninf) {
    std::fill(row, row + TP, std::numeric_limits<scalar_t>::quiet_NaN());
    return;
  }
  V sum = V{};
  for (int64_t t = 0; t < tiles; ++t) {
    x[t] = exp_lanes(x[t] - m);
    sum += x[t];
  }
  const scalar_t inv = scalar_t(1) / lane_sum(sum);
  for (int64_t t = 0; t < tiles; ++t) x[t] *= inv;
  for (int64_t t = tiles; t < TP / VL; ++t) x[t] = V{};
}

// the softmax's backward for one row: ds = p * (dp - sum_j dp_j p_j) over `tiles` tiles, zero past them
template <typename scalar_t>
inline void softmax_grad_row(const scalar_t* p, const scalar_t* dp, scalar_t* ds, int64_t tiles, int64_t TP) {
  using V = typename Lanes<scalar_t>::type;
  const V* pi = reinterpret_cast<const V*>(p);
  const V* dpi = reinterpret_cast<const V*>(dp);
  V* dsi = reinterpret_cast<V*>(ds);
  V acc = V{};
  for (int64_t t = 0; t < tiles; ++t) acc += dpi[t] * pi[t];
  const scalar_t dot = lane_sum(acc);
  for (int64_t t = 0; t < tiles; ++t) dsi[t] = pi[t] * (dpi[t] - dot);
  for (int64_t t = tiles; t < TP / VL; ++t) dsi[t] = V{};
}

}  // namespace
