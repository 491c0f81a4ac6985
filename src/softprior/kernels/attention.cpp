// Fused attention for softprior's fast path: z = softmax(q k^T + bias) v and its backward, one
// (run, head, batch) block at a time, the block's scores kept in a thread-local buffer.
//
// The operator softprior::attention_forward / attention_backward computes what
// fastpath._Attention computes (src/softprior/fastpath.py): q [N, Tq, e], k [N, T, e],
// v [N, T, dh] with N = K*H*B blocks in head-major order [K, H, B]; bias [K, H, Tq, T] shared by the
// B blocks of one (run, head). Backward (the softmax Jacobian applied row-wise, as fastpath's
// docstring): dP = dz v^T, dS = P * (dP - sum_j dP P), dq = dS k, dk = dS^T q, dv = P^T dz,
// dbias = sum over the batch of dS.
//
// Determinism: every block is computed by one thread with one loop order on buffers of one
// alignment and padding, whatever N, the thread count or the block's place in memory, and dbias
// sums the batch in the order b = 0..B-1 for each (run, head); so a run's numbers do not depend on
// how many runs share the call (tests/test_kernels.py holds a block alone and in a group of 5 equal
// bitwise). Products are accumulated over the contracted index in order, one output element per
// vector lane (never a reduction across lanes); rows sum sequentially.
#include "blocks.h"

namespace {

struct Shape {
  int64_t N, B, Tq, T, e, dh;
};

template <typename scalar_t>
void forward_blocks(const Shape& s, const Mask<scalar_t>& mask, const scalar_t* q, const scalar_t* k,
                    const scalar_t* v, scalar_t* z, scalar_t* p, int64_t begin, int64_t end) {
  const int64_t TP = padded(s.T), DP = padded(s.dh), QR = rounded(s.Tq, R), G = QR / R;
  Buffer<scalar_t> kT(s.e * TP), vb(TP * DP), sc(QR * TP), zb(QR * DP);
  // rows of whole tiles, whole groups of rows, aligned: the softmax is formed in P itself, not copied there
  const bool direct = s.T % VL == 0 && s.Tq % R == 0 && reinterpret_cast<uintptr_t>(p) % 64 == 0;
  for (int64_t n = begin; n < end; ++n) {
    const int64_t kh = n / s.B;
    const scalar_t* qn = q + n * s.Tq * s.e;
    load_transposed(k + n * s.T * s.e, s.T, s.e, kT.get(), TP);
    const scalar_t* vn = as_tiles(v + n * s.T * s.dh, s.T, s.dh, vb.get());
    scalar_t* S = direct ? p + n * s.Tq * s.T : sc.get();
    for (int64_t g = 0; g < G; ++g) {
      const int64_t glim = mask.group_lim(kh, s.Tq, g), tiles = (glim + VL - 1) / VL;
      // S = q k^T for R query rows, over the keys some row of the group sees
      rows_times(Rows<scalar_t>(qn, s.e, g * R, s.Tq).p, 1, 0, s.e, kT.get(), TP, tiles, S + g * R * TP, TP);
      for (int64_t i = g * R; i < std::min(s.Tq, g * R + R); ++i) {  // softmax of S + bias, row by row
        softmax_row(S + i * TP, mask.bias.get() + (kh * s.Tq + i) * TP, tiles, TP);
        if (!direct) copy_n(S + i * TP, s.T, p + (n * s.Tq + i) * s.T);
      }
      // z = P v for the group's rows, over the keys it sees, in order
      rows_times(Rows<scalar_t>(S, TP, g * R, QR).p, 1, 0, glim, vn, DP, DP / VL, zb.get() + g * R * DP, DP);
    }
    for (int64_t i = 0; i < s.Tq; ++i) copy_n(zb.get() + i * DP, s.dh, z + (n * s.Tq + i) * s.dh);
  }
}

template <typename scalar_t>
void backward_blocks(const Shape& s, const Mask<scalar_t>& mask, const scalar_t* dz, const scalar_t* q,
                     const scalar_t* k, const scalar_t* v, const scalar_t* p, scalar_t* dq, scalar_t* dk,
                     scalar_t* dv, scalar_t* ds_all, int64_t begin, int64_t end) {
  const int64_t TP = padded(s.T), DP = padded(s.dh), EP = padded(s.e), QR = rounded(s.Tq, R), G = QR / R,
                KR = rounded(s.T, R), GK = KR / R;
  Buffer<scalar_t> vT(s.dh * TP), kb(TP * EP), qb(QR * EP), dzb(QR * DP), pb(QR * TP), dpb(QR * TP), ds(QR * TP),
      out(std::max(QR, KR) * std::max(EP, DP));
  // as in the forward: P read and dS written in place where their rows are whole, aligned tiles
  const bool direct = s.T % VL == 0 && s.Tq % R == 0 && reinterpret_cast<uintptr_t>(p) % 64 == 0 &&
                      reinterpret_cast<uintptr_t>(ds_all) % 64 == 0;
  for (int64_t n = begin; n < end; ++n) {
    const int64_t kh = n / s.B;
    const scalar_t* dzn = dz + n * s.Tq * s.dh;
    load_transposed(v + n * s.T * s.dh, s.T, s.dh, vT.get(), TP);
    if (!direct) load_rows(p + n * s.Tq * s.T, s.Tq, s.T, pb.get(), TP);
    const scalar_t* Pn = direct ? p + n * s.Tq * s.T : pb.get();
    scalar_t* D = direct ? ds_all + n * s.Tq * s.T : ds.get();
    const scalar_t* kn = as_tiles(k + n * s.T * s.e, s.T, s.e, kb.get());
    const scalar_t* qn = as_tiles(q + n * s.Tq * s.e, s.Tq, s.e, qb.get());
    const scalar_t* dzt = as_tiles(dzn, s.Tq, s.dh, dzb.get());
    for (int64_t g = 0; g < G; ++g) {
      const int64_t glim = mask.group_lim(kh, s.Tq, g), tiles = (glim + VL - 1) / VL;
      // dP = dz v^T over the keys the group sees; dS = P * (dP - sum_j dP P), row by row
      rows_times(Rows<scalar_t>(dzn, s.dh, g * R, s.Tq).p, 1, 0, s.dh, vT.get(), TP, tiles, dpb.get() + g * R * TP,
                 TP);
      for (int64_t i = g * R; i < std::min(s.Tq, g * R + R); ++i) {
        softmax_grad_row(Pn + i * TP, dpb.get() + i * TP, D + i * TP, tiles, TP);
        if (!direct) copy_n(D + i * TP, s.T, ds_all + (n * s.Tq + i) * s.T);
      }
      // dq = dS k for the group's rows
      rows_times(Rows<scalar_t>(D, TP, g * R, QR).p, 1, 0, glim, kn, EP, EP / VL, out.get() + g * R * EP, EP);
    }
    for (int64_t i = 0; i < s.Tq; ++i) copy_n(out.get() + i * EP, s.e, dq + (n * s.Tq + i) * s.e);
    // dk = dS^T q and dv = P^T dz, R keys (columns of dS and P) at a time, over the queries from the
    // first that sees one of them
    for (int64_t g = 0; g < GK; ++g) {
      const int64_t* f = mask.first.data() + kh * KR + g * R;
      const int64_t i0 = *std::min_element(f, f + R);
      rows_times(Rows<scalar_t>(D, 1, g * R, s.T).p, TP, i0, s.Tq, qn, EP, EP / VL, out.get() + g * R * EP, EP);
      for (int64_t j = g * R; j < std::min(s.T, g * R + R); ++j) copy_n(out.get() + j * EP, s.e, dk + (n * s.T + j) * s.e);
      rows_times(Rows<scalar_t>(Pn, 1, g * R, s.T).p, TP, i0, s.Tq, dzt, DP, DP / VL, out.get() + g * R * DP, DP);
      for (int64_t j = g * R; j < std::min(s.T, g * R + R); ++j)
        copy_n(out.get() + j * DP, s.dh, dv + (n * s.T + j) * s.dh);
    }
  }
}

Shape check_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t bias_blocks) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "softprior attention: q, k, v must be 3-d");
  TORCH_CHECK(q.device().is_cpu(), "softprior attention: CPU tensors only");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "softprior attention: q, k, v must share a dtype");
  const int64_t N = q.size(0);
  TORCH_CHECK(k.size(0) == N && v.size(0) == N && k.size(1) == v.size(1) && k.size(2) == q.size(2),
              "softprior attention: q [N, Tq, e], k [N, T, e], v [N, T, dh] expected");
  TORCH_CHECK(bias_blocks > 0 && N % bias_blocks == 0, "softprior attention: the blocks (", N,
              ") must be a multiple of the bias's K*H (", bias_blocks, ")");
  return Shape{N, N / bias_blocks, q.size(1), k.size(1), q.size(2), v.size(2)};
}

at::Tensor checked_bias(const at::Tensor& bias, const Shape& s, const at::Tensor& q) {
  TORCH_CHECK(bias.dim() == 4 && bias.size(2) == s.Tq && bias.size(3) == s.T && bias.scalar_type() == q.scalar_type(),
              "softprior attention: bias [K, H, Tq, T] of q's dtype expected");
  return bias.contiguous();
}

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                                     const at::Tensor& bias_) {
  TORCH_CHECK(bias_.dim() == 4, "softprior attention: bias [K, H, Tq, T] expected");
  const Shape s = check_shapes(q_, k_, v_, bias_.size(0) * bias_.size(1));
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous(), bias = checked_bias(bias_, s, q);
  at::Tensor z = at::empty({s.N, s.Tq, s.dh}, q.options());
  at::Tensor p = at::empty({s.N, s.Tq, s.T}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "softprior_attention_forward", [&] {
    const Mask<scalar_t> mask(bias.const_data_ptr<scalar_t>(), s.N / s.B, s.Tq, s.T);
    at::parallel_for(0, s.N, 1, [&](int64_t begin, int64_t end) {
      forward_blocks<scalar_t>(s, mask, q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(),
                               v.const_data_ptr<scalar_t>(), z.mutable_data_ptr<scalar_t>(),
                               p.mutable_data_ptr<scalar_t>(), begin, end);
    });
  });
  return {z, p};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& dz_, const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& p_,
    const at::Tensor& bias_) {
  TORCH_CHECK(bias_.dim() == 4, "softprior attention: bias [K, H, Tq, T] expected");
  const int64_t KH = bias_.size(0) * bias_.size(1);
  const Shape s = check_shapes(q_, k_, v_, KH);
  TORCH_CHECK(dz_.sizes() == at::IntArrayRef({s.N, s.Tq, s.dh}) && p_.sizes() == at::IntArrayRef({s.N, s.Tq, s.T}),
              "softprior attention: dz [N, Tq, dh] and p [N, Tq, T] expected");
  const at::Tensor dz = dz_.contiguous().to(q_.scalar_type()), q = q_.contiguous(), k = k_.contiguous(),
                   v = v_.contiguous(), p = p_.contiguous(), bias = checked_bias(bias_, s, q_);
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  at::Tensor ds = at::empty({s.N, s.Tq, s.T}, q.options());
  at::Tensor db = at::empty(bias.sizes(), q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "softprior_attention_backward", [&] {
    const Mask<scalar_t> mask(bias.const_data_ptr<scalar_t>(), KH, s.Tq, s.T);
    at::parallel_for(0, s.N, 1, [&](int64_t begin, int64_t end) {
      backward_blocks<scalar_t>(s, mask, dz.const_data_ptr<scalar_t>(), q.const_data_ptr<scalar_t>(),
                                k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
                                p.const_data_ptr<scalar_t>(), dq.mutable_data_ptr<scalar_t>(),
                                dk.mutable_data_ptr<scalar_t>(), dv.mutable_data_ptr<scalar_t>(),
                                ds.mutable_data_ptr<scalar_t>(), begin, end);
    });
    // dbias[kh] = sum over b = 0..B-1, in that order, of dS[kh*B + b]: per (run, head) and query row
    const scalar_t* dsp = ds.const_data_ptr<scalar_t>();
    scalar_t* dbp = db.mutable_data_ptr<scalar_t>();
    const int64_t T = s.T, Tq = s.Tq, B = s.B;
    at::parallel_for(0, KH * Tq, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t kh = r / Tq, i = r % Tq;
        scalar_t* out = dbp + r * T;
        std::fill(out, out + T, scalar_t(0));
        for (int64_t b = 0; b < B; ++b) {
          const scalar_t* src = dsp + ((kh * B + b) * Tq + i) * T;
          for (int64_t j = 0; j < T; ++j) out[j] += src[j];
        }
      }
    });
  });
  return {dq, dk, dv, db};
}

}  // namespace

TORCH_LIBRARY(softprior, m) {
  m.def("attention_forward(Tensor q, Tensor k, Tensor v, Tensor bias) -> (Tensor, Tensor)");
  m.def("attention_backward(Tensor dz, Tensor q, Tensor k, Tensor v, Tensor p, Tensor bias) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(softprior, CPU, m) {
  m.impl("attention_forward", &attention_forward);
  m.impl("attention_backward", &attention_backward);
}
