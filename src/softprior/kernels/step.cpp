// The whole forward and backward of softprior's token model in one operator, for the fast path's
// commonest case (src/softprior/kernels/step.py says which: the soft prior, no positional scheme,
// pre-LayerNorm, a token task whose last layer reads a few positions).
//
// It computes what fastpath.fast_forward computes (src/softprior/fastpath.py, points 1-5), logits at
// the loss positions from the run-stacked parameters, and its backward, without an autograd graph:
// - layer 0 on the vocabulary: tab = LN(E) W_in^T ([V, 3d + 2Hr], fastpath point 3); each
//   (head, example) block gathers its rows of tab by token into a thread-local buffer, forms
//   S = q k^T / sqrt(d_head) + g_c (x U)(x W)^T + g_p B^pos[i - j] with the causal mask (the paper's
//   logits, section 2), its softmax and P v there, and the backward scatters dq, dk, dv straight
//   back into d tab (no [B, H, T, .] gathered tensors, no index_add over them);
// - middle layers the same with the rows of LN(x) W_in^T;
// - the last layer at the loss positions only, re-associated (fastpath point 4):
//   s_j = (W_{K,W}^T q_ext) . LN(x_j) and sum_j P_j W_V LN(x_j) = W_V (sum_j P_j LN(x_j));
// - the final LayerNorm and the tied unembedding at the loss positions.
// Backward: the softmax Jacobian row-wise (dS = P * (dP - sum_j dP P)); the position bias's gradient
// summed over the batch per head and gathered onto B^pos's offsets and g_pos; the content gate's
// gradient from the U columns; LayerNorm by ATen's native_layer_norm and its backward, but for the
// weight's and bias's gradients, summed over the rows here (ln_backward).
//
// Determinism: each run is computed alone (its own ATen calls, its own blocks), so its numbers do not
// depend on the runs beside it; every block and every reduction over the batch (a head's position
// bias, the LayerNorms' weights) runs in one thread in a fixed order, whatever the thread count.
// With K >= 2 runs and several threads the runs go in parallel, one thread each (for_runs); one run
// alone splits its blocks and rows across the threads. The BLAS products are the one part whose split
// the library decides: the shapes tested give the same bits at 1 and 2 threads
// (tests/test_kernels_step.py).
#include "blocks.h"

#include <ATen/ThreadLocalState.h>

namespace {

using at::Tensor;

// LayerNorm's backward (torch.nn.LayerNorm, eps 1e-5): dx from ATen's native_layer_norm_backward
// (each row on its own), the weight's and bias's gradients here, dw = sum_rows dy xhat and
// db = sum_rows dy with xhat = (x - mean) rstd, the rows added in order in one thread (ATen splits
// those two sums across threads, so their bits depended on the thread count)
template <typename scalar_t>
Tensor ln_backward(const Tensor& dy_, const Tensor& x, const Tensor& mean, const Tensor& rstd, const Tensor& w,
                   const Tensor& b, scalar_t* dw, scalar_t* db) {
  const Tensor dy = dy_.contiguous();
  const int64_t d = x.size(-1), n = x.numel() / d;
  Tensor dx = std::get<0>(at::native_layer_norm_backward(dy, x, {d}, mean, rstd, w, b, {true, false, false}));
  const scalar_t *X = x.const_data_ptr<scalar_t>(), *DY = dy.const_data_ptr<scalar_t>();
  const scalar_t *M = mean.const_data_ptr<scalar_t>(), *S = rstd.const_data_ptr<scalar_t>();
  std::fill(dw, dw + d, scalar_t(0));
  std::fill(db, db + d, scalar_t(0));
  for (int64_t r = 0; r < n; ++r) {
    const scalar_t *xr = X + r * d, *dyr = DY + r * d;
    for (int64_t i = 0; i < d; ++i) {
      dw[i] += dyr[i] * ((xr[i] - M[r]) * S[r]);
      db[i] += dyr[i];
    }
  }
  return dx.contiguous();
}

struct Dims {
  int64_t B, T, d, H, dh, r, e, W, V, P, nctx, L;
  bool full;  // each layer's bias input is a family's whole B^pos [H, T, T], not the soft prior's table
};

// where B^pos_h(i, j) sits in a layer's bias input: the soft prior's table [H, n_ctx] over offsets, at
// min(i - j, n_ctx - 1) (fastpath._pos_bias), or a registered family's whole bias [H, T, T], evaluated
// by its own code (fastpath._family_bias): the bias is data here, and its gradient goes back as data
inline int64_t bias_index(const Dims& D, int64_t h, int64_t i, int64_t j) {
  return D.full ? (h * D.T + i) * D.T + j : h * D.nctx + std::min(i - j, D.nctx - 1);
}

// whether layer 0 runs on vocabulary pairs (vocab_forward): fewer pairs than (example, query, key) triples
inline bool pairs(const Dims& D) { return D.V * D.V <= D.B * D.T * D.T; }

// the rows of a layer's in_proj output: row (b, i) is base[idx(b, i)] with idx the token (layer 0, on
// the vocabulary) or b*T + i (a middle layer's projection of every position)
template <typename scalar_t>
struct Rows0 {
  scalar_t* base;
  const int64_t* tok;  // [B, T] or null
  int64_t T, W;
  scalar_t* row(int64_t b, int64_t i) const { return base + (tok ? tok[b * T + i] : b * T + i) * W; }
};

// the causal mask with the prior's bias, per head: bias[h][i][j] = g_pos,h B^pos_h(i, j) (bias_index) for
// j <= i, -inf after (fastpath._prior_bias)
template <typename scalar_t>
std::vector<scalar_t> full_bias(const scalar_t* bpos, const scalar_t* gp, const Dims& D) {
  const scalar_t ninf = -std::numeric_limits<scalar_t>::infinity();
  std::vector<scalar_t> out(D.H * D.T * D.T);
  for (int64_t h = 0; h < D.H; ++h)
    for (int64_t i = 0; i < D.T; ++i)
      for (int64_t j = 0; j < D.T; ++j)
        out[(h * D.T + i) * D.T + j] = j <= i ? gp[h] * bpos[bias_index(D, h, i, j)] : ninf;
  return out;
}

// that bias's backward for head h: from its gradient dbias (query q's row at dbias + q * stride, at position
// qpos[q], or at q itself where qpos is null), d g_pos,h += sum_(q, j) dbias B^pos_h(i, j) and
// d B^pos_h(i, j) += g_pos,h dbias (at bias_index), over the keys each query sees, in order
template <typename scalar_t>
void bias_backward(const Dims& D, int64_t h, const scalar_t* dbias, int64_t stride, int64_t nq, const int64_t* qpos,
                   const scalar_t* bpos, scalar_t gp, scalar_t* dbpos, scalar_t& dgp) {
  scalar_t g = 0;
  for (int64_t q = 0; q < nq; ++q) {
    const int64_t i = qpos ? qpos[q] : q;
    for (int64_t j = 0; j <= i; ++j) {
      const int64_t o = bias_index(D, h, i, j);
      g += dbias[q * stride + j] * bpos[o];
      dbpos[o] += gp * dbias[q * stride + j];
    }
  }
  dgp += g;
}

// Scratch of one thread for the blocks of a full layer
template <typename scalar_t>
struct Scratch {
  int64_t TP, EP, DP, QR;
  Buffer<scalar_t> qe, ke, keT, vv, vT, s, dp, ds, dz, out, out2;
  explicit Scratch(const Dims& D)
      : TP(padded(D.T)), EP(padded(D.e)), DP(padded(D.dh)), QR(rounded(D.T, R)),
        qe(QR * EP), ke(TP * EP), keT(D.e * TP), vv(TP * DP), vT(D.dh * TP), s(QR * TP), dp(QR * TP), ds(QR * TP),
        dz(QR * DP), out(std::max(QR, rounded(D.T, R)) * std::max(EP, DP)), out2(rounded(D.T, R) * DP) {}
};

// a block's q_ext = [q / sqrt(d_head), g_c u] rows (qe), k_ext = [k, w] rows (ke) or transposed (keT),
// v rows (vv) or transposed (vT), from the in_proj rows (stored Q | K | V | U | W)
template <typename scalar_t>
void load_block(const Dims& D, const Rows0<scalar_t>& src, int64_t b, int64_t h, scalar_t qs, scalar_t gc,
                Scratch<scalar_t>& w, bool rows_k, bool cols_k, bool rows_v, bool cols_v) {
  const int64_t d = D.d, dh = D.dh, r = D.r, Hr = D.H * D.r;
  for (int64_t i = 0; i < D.T; ++i) {
    const scalar_t* x = src.row(b, i);
    scalar_t* q = w.qe.get() + i * w.EP;
    for (int64_t c = 0; c < dh; ++c) q[c] = qs * x[h * dh + c];
    for (int64_t c = 0; c < r; ++c) q[dh + c] = gc * x[3 * d + h * r + c];
    if (rows_k) {
      scalar_t* k = w.ke.get() + i * w.EP;
      for (int64_t c = 0; c < dh; ++c) k[c] = x[d + h * dh + c];
      for (int64_t c = 0; c < r; ++c) k[dh + c] = x[3 * d + Hr + h * r + c];
    }
    if (cols_k) {
      for (int64_t c = 0; c < dh; ++c) w.keT[c * w.TP + i] = x[d + h * dh + c];
      for (int64_t c = 0; c < r; ++c) w.keT[(dh + c) * w.TP + i] = x[3 * d + Hr + h * r + c];
    }
    if (rows_v) copy_n(x + 2 * d + h * dh, dh, w.vv.get() + i * w.DP);
    if (cols_v)
      for (int64_t c = 0; c < dh; ++c) w.vT[c * w.TP + i] = x[2 * d + h * dh + c];
  }
}

// one (head, example) block forward: P (saved, [T, TP]) and z into Z's columns of head h ([B*T, d])
template <typename scalar_t>
void block_forward(const Dims& D, const Mask<scalar_t>& mask, const Rows0<scalar_t>& src, int64_t b, int64_t h,
                   scalar_t qs, scalar_t gc, Scratch<scalar_t>& w, scalar_t* P, scalar_t* Z) {
  const int64_t TP = w.TP, EP = w.EP, DP = w.DP, G = w.QR / R;
  load_block(D, src, b, h, qs, gc, w, false, true, true, false);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t glim = mask.group_lim(h, D.T, g), tiles = (glim + VL - 1) / VL;
    rows_times(Rows<scalar_t>(w.qe.get(), EP, g * R, D.T).p, 1, 0, D.e, w.keT.get(), TP, tiles, w.s.get() + g * R * TP,
               TP);
    for (int64_t i = g * R; i < std::min(D.T, g * R + R); ++i)
      softmax_row(w.s.get() + i * TP, mask.bias.get() + (h * D.T + i) * TP, tiles, TP);
    rows_times(Rows<scalar_t>(w.s.get(), TP, g * R, w.QR).p, 1, 0, glim, w.vv.get(), DP, DP / VL,
               w.out.get() + g * R * DP, DP);
  }
  for (int64_t i = 0; i < D.T; ++i) {
    copy_n(w.out.get() + i * DP, D.dh, Z + (b * D.T + i) * D.d + h * D.dh);
    copy_n(w.s.get() + i * TP, TP, P + i * TP);
  }
}

// one (head, example) block backward: adds dq, dk, dv into the rows' gradient (dsrc, same indexing as
// src), dS into dbias ([T, TP], this head's sum over the batch) and the content gate's gradient into dgc
template <typename scalar_t>
void block_backward(const Dims& D, const Mask<scalar_t>& mask, const Rows0<scalar_t>& src, const Rows0<scalar_t>& dsrc,
                    int64_t b, int64_t h, scalar_t qs, scalar_t gc, Scratch<scalar_t>& w, const scalar_t* P,
                    const scalar_t* dZ, scalar_t* dbias, scalar_t& dgc) {
  const int64_t TP = w.TP, EP = w.EP, DP = w.DP, G = w.QR / R, GK = rounded(D.T, R) / R;
  const int64_t d = D.d, dh = D.dh, r = D.r, Hr = D.H * D.r;
  load_block(D, src, b, h, qs, gc, w, true, false, false, true);
  for (int64_t i = 0; i < D.T; ++i) copy_n(dZ + (b * D.T + i) * d + h * dh, dh, w.dz.get() + i * DP);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t glim = mask.group_lim(h, D.T, g), tiles = (glim + VL - 1) / VL;
    rows_times(Rows<scalar_t>(w.dz.get(), DP, g * R, D.T).p, 1, 0, dh, w.vT.get(), TP, tiles, w.dp.get() + g * R * TP,
               TP);
    for (int64_t i = g * R; i < std::min(D.T, g * R + R); ++i) {
      softmax_grad_row(P + i * TP, w.dp.get() + i * TP, w.ds.get() + i * TP, tiles, TP);
      add_tiles(dbias + i * TP, w.ds.get() + i * TP, tiles);
    }
    // dq_ext = dS k_ext for the group's rows
    rows_times(Rows<scalar_t>(w.ds.get(), TP, g * R, w.QR).p, 1, 0, glim, w.ke.get(), EP, EP / VL,
               w.out.get() + g * R * EP, EP);
  }
  for (int64_t i = 0; i < D.T; ++i) {  // q_ext = [qs q, g_c u]: back onto the Q and U columns
    const scalar_t* dq = w.out.get() + i * EP;
    const scalar_t* x = src.row(b, i);
    scalar_t* gx = dsrc.row(b, i);
    for (int64_t c = 0; c < dh; ++c) gx[h * dh + c] += qs * dq[c];
    for (int64_t c = 0; c < r; ++c) {
      gx[3 * d + h * r + c] += gc * dq[dh + c];
      dgc += dq[dh + c] * x[3 * d + h * r + c];
    }
  }
  // dk_ext = dS^T q_ext and dv = P^T dz, R keys at a time, over the queries from the first that sees one
  for (int64_t g = 0; g < GK; ++g) {
    const int64_t* f = mask.first.data() + h * rounded(D.T, R) + g * R;
    const int64_t i0 = *std::min_element(f, f + R);
    rows_times(Rows<scalar_t>(w.ds.get(), 1, g * R, D.T).p, TP, i0, D.T, w.qe.get(), EP, EP / VL,
               w.out.get() + g * R * EP, EP);
    rows_times(Rows<scalar_t>(P, 1, g * R, D.T).p, TP, i0, D.T, w.dz.get(), DP, DP / VL, w.out2.get() + g * R * DP, DP);
    for (int64_t j = g * R; j < std::min(D.T, g * R + R); ++j) {
      const scalar_t* dk = w.out.get() + j * EP;
      const scalar_t* dv = w.out2.get() + j * DP;
      scalar_t* gx = dsrc.row(b, j);
      for (int64_t c = 0; c < dh; ++c) gx[d + h * dh + c] += dk[c];
      for (int64_t c = 0; c < r; ++c) gx[3 * d + Hr + h * r + c] += dk[dh + c];
      for (int64_t c = 0; c < dh; ++c) gx[2 * d + h * dh + c] += dv[c];
    }
  }
}

// A full layer's attention forward for one run: Z [B*T, d] (heads' z side by side) and P [H, B, T, TP]
template <typename scalar_t>
void full_forward(const Dims& D, const Rows0<scalar_t>& src, const scalar_t* bpos, const scalar_t* gp,
                  const scalar_t* gc, scalar_t qs, scalar_t* Z, scalar_t* P) {
  const auto bias = full_bias(bpos, gp, D);
  const Mask<scalar_t> mask(bias.data(), D.H, D.T, D.T);
  const int64_t TP = padded(D.T);
  at::parallel_for(0, D.H * D.B, 1, [&](int64_t begin, int64_t end) {
    Scratch<scalar_t> w(D);
    for (int64_t n = begin; n < end; ++n) {
      const int64_t h = n / D.B, b = n % D.B;
      block_forward(D, mask, src, b, h, qs, gc[h], w, P + n * D.T * TP, Z);
    }
  });
}

// its backward: d rows (dsrc, accumulated), and per head d B^pos, d g_pos and d g_content (added)
template <typename scalar_t>
void full_backward(const Dims& D, const Rows0<scalar_t>& src, const Rows0<scalar_t>& dsrc, const scalar_t* bpos,
                   const scalar_t* gp, const scalar_t* gc, scalar_t qs, const scalar_t* P, const scalar_t* dZ,
                   scalar_t* dbpos, scalar_t* dgp, scalar_t* dgc) {
  const auto bias = full_bias(bpos, gp, D);
  const Mask<scalar_t> mask(bias.data(), D.H, D.T, D.T);
  const int64_t TP = padded(D.T);
  at::parallel_for(0, D.H, 1, [&](int64_t begin, int64_t end) {
    Scratch<scalar_t> w(D);
    Buffer<scalar_t> dbias(D.T * TP);
    for (int64_t h = begin; h < end; ++h) {
      std::fill(dbias.get(), dbias.get() + D.T * TP, scalar_t(0));
      scalar_t g = 0;
      for (int64_t b = 0; b < D.B; ++b)
        block_backward(D, mask, src, dsrc, b, h, qs, gc[h], w, P + (h * D.B + b) * D.T * TP, dZ, dbias.get(), g);
      dgc[h] += g;
      bias_backward(D, h, dbias.get(), TP, D.T, static_cast<const int64_t*>(nullptr), bpos, gp[h], dbpos, dgp[h]);
    }
  });
}

// Layer 0 on vocabulary pairs: its q_ext, k_ext and v are functions of the token alone (fastpath point 3),
// so the content part of every logit is a score of a (query token, key token) pair,
// S^v_h[a, c] = q_ext,h(a) . k_ext,h(c), formed once per head ([V, V]) and gathered per block:
// S_ij = S^v_h[tok_i, tok_j] + bias_ij. The backward sums dS onto the same pairs (dS^v_h) and takes
// dq_ext = dS^v k_ext and dk_ext = dS^v^T q_ext once per head. Used where the pairs are fewer than a
// layer's (example, query, key) triples (V^2 <= B T^2: the vocabularies of the paper's token tasks).
template <typename scalar_t>
struct VocabHead {  // one head's tables, rows padded to whole tiles
  int64_t V, VR, VP, EP, DP;
  Buffer<scalar_t> qe, ke, keT, vv, vT, sv;
  VocabHead(const Dims& D)
      : V(D.V), VR(rounded(D.V, R)), VP(padded(D.V)), EP(padded(D.e)), DP(padded(D.dh)), qe(VR * EP), ke(VR * EP),
        keT(D.e * VP), vv(D.V * DP), vT(D.dh * VP), sv(VR * VP) {}
};

template <typename scalar_t>
void vocab_tables(const Dims& D, const scalar_t* tab, int64_t h, scalar_t qs, scalar_t gc, VocabHead<scalar_t>& t) {
  const int64_t d = D.d, dh = D.dh, r = D.r, Hr = D.H * D.r;
  for (int64_t a = 0; a < D.V; ++a) {
    const scalar_t* x = tab + a * D.W;
    for (int64_t c = 0; c < dh; ++c) {
      t.qe[a * t.EP + c] = qs * x[h * dh + c];
      t.ke[a * t.EP + c] = t.keT[c * t.VP + a] = x[d + h * dh + c];
      t.vv[a * t.DP + c] = t.vT[c * t.VP + a] = x[2 * d + h * dh + c];
    }
    for (int64_t c = 0; c < r; ++c) {
      t.qe[a * t.EP + dh + c] = gc * x[3 * d + h * r + c];
      t.ke[a * t.EP + dh + c] = t.keT[(dh + c) * t.VP + a] = x[3 * d + Hr + h * r + c];
    }
  }
  for (int64_t g = 0; g < t.VR / R; ++g)  // S^v = q_ext k_ext^T
    rows_times(Rows<scalar_t>(t.qe.get(), t.EP, g * R, D.V).p, 1, 0, D.e, t.keT.get(), t.VP, t.VP / VL,
               t.sv.get() + g * R * t.VP, t.VP);
}

template <typename scalar_t>
void vocab_forward(const Dims& D, const scalar_t* tab, const int64_t* tok, const scalar_t* bpos, const scalar_t* gp,
                   const scalar_t* gc, scalar_t qs, scalar_t* Z, scalar_t* P) {
  const auto bias = full_bias(bpos, gp, D);
  const Mask<scalar_t> mask(bias.data(), D.H, D.T, D.T);
  std::vector<VocabHead<scalar_t>> heads;
  for (int64_t h = 0; h < D.H; ++h) heads.emplace_back(D);
  at::parallel_for(0, D.H, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) vocab_tables(D, tab, h, qs, gc[h], heads[h]);
  });
  const int64_t T = D.T, TP = padded(T), QR = rounded(T, R), G = QR / R, dh = D.dh;
  at::parallel_for(0, D.H * D.B, 1, [&](int64_t begin, int64_t end) {
    Buffer<scalar_t> S(QR * TP), vb(TP * padded(dh)), out(QR * padded(dh));
    Buffer<int32_t> idx(TP);  // the block's key tokens, padded with token 0 (masked: the bias is -inf there)
    for (int64_t n = begin; n < end; ++n) {
      const int64_t h = n / D.B, b = n % D.B, DP = heads[h].DP, VP = heads[h].VP;
      const int64_t* tk = tok + b * T;
      const scalar_t* sv = heads[h].sv.get();
      for (int64_t j = 0; j < T; ++j) idx[j] = static_cast<int32_t>(tk[j]);
      // the softmax is formed in P itself where its rows come in whole groups (P is kept for the backward)
      scalar_t* Sn = T % R == 0 ? P + n * T * TP : S.get();
      for (int64_t j = 0; j < T; ++j) copy_n(heads[h].vv.get() + tk[j] * DP, DP, vb.get() + j * DP);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t glim = mask.group_lim(h, T, g), tiles = (glim + VL - 1) / VL;
        for (int64_t i = g * R; i < std::min(T, g * R + R); ++i) {
          scalar_t* row = Sn + i * TP;
          gather_tiles(sv + tk[i] * VP, VP, idx.get(), tiles, row);  // past glim: masked, whatever it holds
          softmax_row(row, mask.bias.get() + (h * T + i) * TP, tiles, TP);
        }
        rows_times(Rows<scalar_t>(Sn, TP, g * R, QR).p, 1, 0, glim, vb.get(), DP, DP / VL, out.get() + g * R * DP, DP);
      }
      for (int64_t i = 0; i < T; ++i) {
        copy_n(out.get() + i * DP, dh, Z + (b * T + i) * D.d + h * dh);
        if (Sn != P + n * T * TP) copy_n(Sn + i * TP, TP, P + (n * T + i) * TP);
      }
    }
  });
}

template <typename scalar_t>
void vocab_backward(const Dims& D, const scalar_t* tab, const int64_t* tok, const scalar_t* bpos, const scalar_t* gp,
                    const scalar_t* gc, scalar_t qs, const scalar_t* P, const scalar_t* dZ, scalar_t* dtab,
                    scalar_t* dbpos, scalar_t* dgp, scalar_t* dgc) {
  const auto bias = full_bias(bpos, gp, D);
  const Mask<scalar_t> mask(bias.data(), D.H, D.T, D.T);
  const int64_t T = D.T, TP = padded(T), QR = rounded(T, R), G = QR / R, GK = QR / R, dh = D.dh, r = D.r, d = D.d;
  const int64_t Hr = D.H * r;
  at::parallel_for(0, D.H, 1, [&](int64_t h0, int64_t h1) {
    VocabHead<scalar_t> t(D);
    const int64_t VP = t.VP, DP = t.DP, EP = t.EP;
    Buffer<scalar_t> dbias(T * TP), dsv(t.VR * VP), dvv(D.V * DP), dz(QR * DP), dpv(QR * VP), dp(QR * TP), ds(QR * TP),
        out(QR * DP), dq(t.VR * EP), dk(t.VR * EP);
    Buffer<int32_t> idx(TP);
    for (int64_t h = h0; h < h1; ++h) {
      vocab_tables(D, tab, h, qs, gc[h], t);
      std::fill(dbias.get(), dbias.get() + T * TP, scalar_t(0));
      std::fill(dsv.get(), dsv.get() + t.VR * VP, scalar_t(0));
      std::fill(dvv.get(), dvv.get() + D.V * DP, scalar_t(0));
      for (int64_t b = 0; b < D.B; ++b) {
        const int64_t* tk = tok + b * T;
        const scalar_t* Pn = P + (h * D.B + b) * T * TP;
        for (int64_t j = 0; j < T; ++j) idx[j] = static_cast<int32_t>(tk[j]);
        for (int64_t i = 0; i < T; ++i) copy_n(dZ + (b * T + i) * d + h * dh, dh, dz.get() + i * DP);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t glim = mask.group_lim(h, T, g), tiles = (glim + VL - 1) / VL;
          // dP_ij = dz_i . v(tok_j): dz v^T on the vocabulary, gathered by key token
          rows_times(Rows<scalar_t>(dz.get(), DP, g * R, T).p, 1, 0, dh, t.vT.get(), VP, VP / VL, dpv.get() + g * R * VP, VP);
          for (int64_t i = g * R; i < std::min(T, g * R + R); ++i) {
            scalar_t* dpi = dp.get() + i * TP;
            gather_tiles(dpv.get() + i * VP, VP, idx.get(), tiles, dpi);  // past glim: times P = 0
            softmax_grad_row(Pn + i * TP, dpi, ds.get() + i * TP, tiles, TP);
            const scalar_t* dsi = ds.get() + i * TP;
            add_tiles(dbias.get() + i * TP, dsi, tiles);
            scalar_t* pair = dsv.get() + tk[i] * VP;  // dS onto the (query token, key token) pairs, keys in order
            for (int64_t j = 0, n = mask.lim[h * T + i]; j < n; ++j) pair[tk[j]] += dsi[j];
          }
        }
        // dv = P^T dz, R keys at a time, onto the key tokens' rows
        for (int64_t g = 0; g < GK; ++g) {
          const int64_t* f = mask.first.data() + h * QR + g * R;
          const int64_t i0 = *std::min_element(f, f + R);
          rows_times(Rows<scalar_t>(Pn, 1, g * R, T).p, TP, i0, T, dz.get(), DP, DP / VL, out.get() + g * R * DP, DP);
          for (int64_t j = g * R; j < std::min(T, g * R + R); ++j) {
            scalar_t* o = dvv.get() + tk[j] * DP;
            const scalar_t* x = out.get() + j * DP;
            for (int64_t c = 0; c < DP; ++c) o[c] += x[c];
          }
        }
      }
      // dq_ext = dS^v k_ext, dk_ext = dS^v^T q_ext, once per head
      for (int64_t g = 0; g < t.VR / R; ++g) {
        rows_times(Rows<scalar_t>(dsv.get(), VP, g * R, D.V).p, 1, 0, D.V, t.ke.get(), EP, EP / VL, dq.get() + g * R * EP, EP);
        rows_times(Rows<scalar_t>(dsv.get(), 1, g * R, D.V).p, VP, 0, D.V, t.qe.get(), EP, EP / VL, dk.get() + g * R * EP, EP);
      }
      scalar_t g = 0;
      for (int64_t a = 0; a < D.V; ++a) {
        scalar_t* gx = dtab + a * D.W;
        const scalar_t* x = tab + a * D.W;
        const scalar_t *q = dq.get() + a * EP, *k = dk.get() + a * EP, *v = dvv.get() + a * DP;
        for (int64_t c = 0; c < dh; ++c) {
          gx[h * dh + c] = qs * q[c];
          gx[d + h * dh + c] = k[c];
          gx[2 * d + h * dh + c] = v[c];
        }
        for (int64_t c = 0; c < r; ++c) {
          gx[3 * d + h * r + c] = gc[h] * q[dh + c];
          g += q[dh + c] * x[3 * d + h * r + c];
          gx[3 * d + Hr + h * r + c] = k[dh + c];
        }
      }
      dgc[h] += g;
      bias_backward(D, h, dbias.get(), TP, T, static_cast<const int64_t*>(nullptr), bpos, gp[h], dbpos, dgp[h]);
    }
  });
}

// dst[index[n]] += src[n] for the rows n = 0..rows-1 in order (index_add_ without its sort): the rows
// of a [rows, d] and a [*, d] tensor, both contiguous
template <typename scalar_t>
void add_rows(Tensor& dst, const int64_t* index, const Tensor& src, int64_t rows) {
  const int64_t d = src.size(-1);
  scalar_t* o = dst.mutable_data_ptr<scalar_t>();
  const scalar_t* x = src.const_data_ptr<scalar_t>();
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t c = 0; c < d; ++c) o[index[n] * d + c] += x[n * d + c];
}

// the rows of [B*T, d] at the loss positions of each example: b*T + pos[p], [B*P]
std::vector<int64_t> query_rows(const std::vector<int64_t>& pos, int64_t B, int64_t T) {
  std::vector<int64_t> rows;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p : pos) rows.push_back(b * T + p);
  return rows;
}

// sum_c a[c] b[c] over n elements: the lanes of a tile (VL) accumulated in order, reduced in a fixed
// order, then the tail
template <typename scalar_t>
inline scalar_t dot(const scalar_t* a, const scalar_t* b, int64_t n) {
  using N = Reg<scalar_t>;
  using U = typename Native<scalar_t>::any;
  constexpr int64_t P = Native<scalar_t>::parts, NL = Native<scalar_t>::lanes;
  N acc[P];
  for (int64_t k = 0; k < P; ++k) acc[k] = N{};
  int64_t c = 0;
  for (; c + VL <= n; c += VL)
    for (int64_t k = 0; k < P; ++k)
      acc[k] += *reinterpret_cast<const U*>(a + c + k * NL) * *reinterpret_cast<const U*>(b + c + k * NL);
  scalar_t s = lane_sum<scalar_t>(acc);
  for (; c < n; ++c) s += a[c] * b[c];
  return s;
}

// out[c] += w x[c] for c < n
template <typename scalar_t>
inline void axpy(scalar_t w, const scalar_t* x, scalar_t* out, int64_t n) {
  for (int64_t c = 0; c < n; ++c) out[c] += w * x[c];
}

// The last layer's attention at the loss positions (fastpath point 4), one example at a time: with
// qt = W_{K,W}^T q_ext per (head, position) (QT [H, B*P, d]) and A = LN(x) ([B*T, d]),
// s_j = qt . A_j + g_pos,h B^pos[h, pos - j] for j <= pos, P = softmax(s) ([B, H, P, T], zero past
// each query) and abar = sum_j P_j A_j ([H, B*P, d]).
template <typename scalar_t>
void last_forward(const Dims& D, const std::vector<int64_t>& pos, const scalar_t* QT, const scalar_t* A,
                  const scalar_t* bpos, const scalar_t* gp, scalar_t* Pr, scalar_t* abar) {
  const int64_t B = D.B, T = D.T, d = D.d, H = D.H, P = D.P, TP = padded(T);
  const scalar_t ninf = -std::numeric_limits<scalar_t>::infinity();
  Buffer<scalar_t> bias(H * P * TP);  // -inf past each query, so its softmax is 0 there
  for (int64_t h = 0; h < H; ++h)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t j = 0; j < TP; ++j)
        bias[(h * P + p) * TP + j] = j <= pos[p] ? gp[h] * bpos[bias_index(D, h, pos[p], j)] : ninf;
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    Buffer<scalar_t> row(TP);
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t p = 0; p < P; ++p) {
          const int64_t n = pos[p] + 1, hbp = h * B * P + b * P + p;
          for (int64_t j = 0; j < TP; ++j) row[j] = j < n ? dot(QT + hbp * d, A + (b * T + j) * d, d) : scalar_t(0);
          softmax_row(row.get(), bias.get() + (h * P + p) * TP, (n + VL - 1) / VL, TP);
          copy_n(row.get(), T, Pr + ((b * H + h) * P + p) * T);
          scalar_t* out = abar + hbp * d;
          std::fill(out, out + d, scalar_t(0));
          for (int64_t j = 0; j < n; ++j) axpy(row[j], A + (b * T + j) * d, out, d);
        }
  });
}

// its backward, one example at a time: from dabar ([H, B*P, d]), dP_j = dabar . A_j, dS = P * (dP -
// sum_j dP_j P_j), dqt = sum_j dS_j A_j (dQT, [H, B*P, d]), dA_j += P_j dabar + dS_j qt (dA [B*T, d],
// zeroed by the caller), dS kept per example ([B, H, P, T]) for the bias's gradient
template <typename scalar_t>
void last_backward(const Dims& D, const std::vector<int64_t>& pos, const scalar_t* QT, const scalar_t* A,
                   const scalar_t* Pr, const scalar_t* dabar, scalar_t* dQT, scalar_t* dA, scalar_t* dS) {
  const int64_t B = D.B, T = D.T, d = D.d, H = D.H, P = D.P;
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t p = 0; p < P; ++p) {
          const int64_t n = pos[p] + 1, hbp = h * B * P + b * P + p, r = ((b * H + h) * P + p) * T;
          const scalar_t *pr = Pr + r, *da = dabar + hbp * d, *qt = QT + hbp * d;
          scalar_t* ds = dS + r;
          scalar_t sum = 0;
          for (int64_t j = 0; j < n; ++j) {
            ds[j] = dot(da, A + (b * T + j) * d, d);
            sum += ds[j] * pr[j];
          }
          scalar_t* dq = dQT + hbp * d;
          std::fill(dq, dq + d, scalar_t(0));
          for (int64_t j = 0; j < T; ++j) {
            ds[j] = j < n ? pr[j] * (ds[j] - sum) : scalar_t(0);
            if (j >= n) continue;
            const scalar_t* a = A + (b * T + j) * d;
            scalar_t* g = dA + (b * T + j) * d;
            axpy(ds[j], a, dq, d);
            for (int64_t c = 0; c < d; ++c) g[c] += pr[j] * da[c] + ds[j] * qt[c];
          }
        }
  });
}

// f(k) for the runs k < K: with K >= 2 runs and more than one thread, the runs in parallel, each run
// in one thread (its ATen calls, BLAS included, single-threaded inside the parallel region, with the
// caller's thread-local state: no autograd); else one after the other, each with every thread (its
// blocks and LayerNorms split across them, each block and each reduction in one thread, in order, so
// the same bits). `last_first`: each thread takes its runs last first (the backward: the last run's
// forward is the likeliest in cache)
template <typename F>
void for_runs(int64_t K, const F& f, bool last_first = false) {
  const auto order = [&](int64_t k0, int64_t k1) {
    for (int64_t i = k0; i < k1; ++i) f(last_first ? k1 - 1 - (i - k0) : i);
  };
  if (K < 2 || at::get_num_threads() < 2 || at::in_parallel_region()) return order(0, K);
  const at::ThreadLocalState state;
  at::parallel_for(0, K, 1, [&](int64_t k0, int64_t k1) {
    at::ThreadLocalStateGuard guard(state);
    order(k0, k1);
  });
}

// The parameters of one run, in the order step.py passes them, named in one list that step.py reads too
// (``step.param_names`` parses these three macros): the embedding, each layer's LAYER_PARAMS, then
// FINAL_PARAMS (the final LayerNorm).
#define SOFTPRIOR_EMBED_PARAM(X) X(kEmbed, "embed.weight")
#define SOFTPRIOR_LAYER_PARAMS(X) X(kLnW, "ln.weight") X(kLnB, "ln.bias") X(kWin, "attn.in_proj.weight") X(kWout, "attn.out_proj.weight") X(kBpos, "attn.pos_bias")
#define SOFTPRIOR_FINAL_PARAMS(X) X(kLnfW, "ln_final.weight") X(kLnfB, "ln_final.bias")
#define SOFTPRIOR_ENUM(name, ...) name,
enum LayerParam : int64_t { SOFTPRIOR_LAYER_PARAMS(SOFTPRIOR_ENUM) kLayerParams };
enum FinalParam : int64_t { SOFTPRIOR_FINAL_PARAMS(SOFTPRIOR_ENUM) kFinalParams };
enum EmbedParam : int64_t { SOFTPRIOR_EMBED_PARAM(SOFTPRIOR_ENUM) kEmbedParams };
// where parameter p of layer l (of the final LayerNorm, after L layers) sits in the list
inline int64_t layer_param(int64_t l, LayerParam p) { return kEmbedParams + kLayerParams * l + p; }
inline int64_t final_param(int64_t L, FinalParam p) { return kEmbedParams + kLayerParams * L + p; }
inline int64_t layers_of(int64_t n) { return (n - kEmbedParams - kFinalParams) / kLayerParams; }

struct Params {  // one run's parameters, by name
  Tensor E, lnfw, lnfb;
  std::vector<Tensor> lnw, lnb, win, wout, bpos;
  Params(const std::vector<Tensor>& all, int64_t k, int64_t L) {
    E = all[kEmbed][k];
    for (int64_t l = 0; l < L; ++l) {
      lnw.push_back(all[layer_param(l, kLnW)][k]);
      lnb.push_back(all[layer_param(l, kLnB)][k]);
      win.push_back(all[layer_param(l, kWin)][k]);
      wout.push_back(all[layer_param(l, kWout)][k]);
      bpos.push_back(all[layer_param(l, kBpos)][k].contiguous());
    }
    lnfw = all[final_param(L, kLnfW)][k];
    lnfb = all[final_param(L, kLnfB)][k];
  }
};

Dims dims_of(const std::vector<Tensor>& params, const Tensor& tokens, int64_t H, int64_t r, int64_t P) {
  const int64_t n = static_cast<int64_t>(params.size()), L = layers_of(n);
  TORCH_CHECK(n == final_param(L, kFinalParams) && L >= 2, "softprior step: ", kLayerParams, " L + ",
              kEmbedParams + kFinalParams, " parameters, L >= 2");
  const Tensor& b0 = params[layer_param(0, kBpos)];  // [K, H, n_ctx] (the soft prior's table) or [K, H, T, T]
  const int64_t V = params[kEmbed].size(1), d = params[kEmbed].size(2), nctx = b0.size(2);
  const bool full = b0.dim() == 4;
  TORCH_CHECK(d % H == 0, "softprior step: d_model must be a multiple of the heads");
  TORCH_CHECK(tokens.dim() == 3, "softprior step: tokens [K or 1, B, T] expected");
  const int64_t B = tokens.size(1), T = tokens.size(2), dh = d / H;
  TORCH_CHECK(T <= nctx, "softprior step: the context (", T, ") must fit the position table (", nctx, ")");
  TORCH_CHECK(!full || (b0.size(2) == T && b0.size(3) == T), "softprior step: a layer's bias [K, H, T, T] expected");
  TORCH_CHECK(params[layer_param(0, kWin)].size(1) == 3 * d + 2 * H * r, "softprior step: in_proj [3d + 2Hr, d] expected");
  return Dims{B, T, d, H, dh, r, dh + r, 3 * d + 2 * H * r, V, P, nctx, L, full};
}

// What the backward of one run reads, each tensor named once: layer 0's, each middle layer's, then the
// last layer's (at the loss positions). The forward saves them in these lists' order (as an initializer
// list of the same names) and the backward binds the same names to them.
#define SOFTPRIOR_SAVED_FIRST(X) X(tab) X(A0) X(mean0) X(rstd0) X(P0) X(Z0)
#define SOFTPRIOR_SAVED_MIDDLE(X) X(xm) X(Am) X(meanm) X(rstdm) X(proj) X(Pm) X(Zm)
#define SOFTPRIOR_SAVED_LAST(X) \
  X(x) X(A) X(mean) X(rstd) X(Q) X(U) X(QW) X(UW) X(QT) X(Pr) X(abar) X(z) X(xL) X(meanf) X(rstdf) X(Y)
#define SOFTPRIOR_SLOT(name) k_##name,
#define SOFTPRIOR_TENSOR(name) name,
enum SavedFirst : int64_t { SOFTPRIOR_SAVED_FIRST(SOFTPRIOR_SLOT) kSavedFirst };
enum SavedMiddle : int64_t { SOFTPRIOR_SAVED_MIDDLE(SOFTPRIOR_SLOT) kSavedMiddle };
enum SavedLast : int64_t { SOFTPRIOR_SAVED_LAST(SOFTPRIOR_SLOT) kSavedLast };
inline int64_t saved_per_run(int64_t L) { return kSavedFirst + kSavedMiddle * (L - 2) + kSavedLast; }

template <typename scalar_t>
std::vector<Tensor> run_forward(const Params& W, const Dims& D, const Tensor& tok, const Tensor& gp, const Tensor& gc,
                                const std::vector<int64_t>& pos, scalar_t qs, Tensor logits) {
  const int64_t B = D.B, T = D.T, d = D.d, H = D.H, dh = D.dh, r = D.r, P = D.P, L = D.L, TP = padded(T);
  std::vector<Tensor> saved;
  const int64_t* tk = tok.const_data_ptr<int64_t>();
  // layer 0 on the vocabulary (fastpath point 3)
  auto [A0, mean0, rstd0] = at::native_layer_norm(W.E, {d}, W.lnw[0], W.lnb[0], 1e-5);
  Tensor tab = at::mm(A0, W.win[0].t());  // [V, W]
  Tensor x = W.E.index_select(0, tok.reshape(-1));  // [B*T, d]
  Tensor P0 = at::empty({H, B, T, TP}, x.options()), Z0 = at::empty({B * T, d}, x.options());
  if (pairs(D))
    vocab_forward<scalar_t>(D, tab.const_data_ptr<scalar_t>(), tk, W.bpos[0].const_data_ptr<scalar_t>(),
                            gp[0].const_data_ptr<scalar_t>(), gc[0].const_data_ptr<scalar_t>(), qs,
                            Z0.mutable_data_ptr<scalar_t>(), P0.mutable_data_ptr<scalar_t>());
  else
    full_forward<scalar_t>(D, Rows0<scalar_t>{tab.mutable_data_ptr<scalar_t>(), tk, T, D.W}, W.bpos[0].const_data_ptr<scalar_t>(),
                         gp[0].const_data_ptr<scalar_t>(), gc[0].const_data_ptr<scalar_t>(), qs,
                         Z0.mutable_data_ptr<scalar_t>(), P0.mutable_data_ptr<scalar_t>());
  saved.insert(saved.end(), {SOFTPRIOR_SAVED_FIRST(SOFTPRIOR_TENSOR)});
  x = at::addmm(x, Z0, W.wout[0].t());
  for (int64_t l = 1; l < L - 1; ++l) {  // middle layers: every position
    const Tensor& xm = x;
    auto [Am, meanm, rstdm] = at::native_layer_norm(xm, {d}, W.lnw[l], W.lnb[l], 1e-5);
    Tensor proj = at::mm(Am, W.win[l].t());  // [B*T, W]
    Tensor Pm = at::empty({H, B, T, TP}, x.options()), Zm = at::empty({B * T, d}, x.options());
    full_forward<scalar_t>(D, Rows0<scalar_t>{proj.mutable_data_ptr<scalar_t>(), nullptr, T, D.W},
                           W.bpos[l].const_data_ptr<scalar_t>(), gp[l].const_data_ptr<scalar_t>(),
                           gc[l].const_data_ptr<scalar_t>(), qs, Zm.mutable_data_ptr<scalar_t>(),
                           Pm.mutable_data_ptr<scalar_t>());
    saved.insert(saved.end(), {SOFTPRIOR_SAVED_MIDDLE(SOFTPRIOR_TENSOR)});
    x = at::addmm(x, Zm, W.wout[l].t());
  }
  // the last layer at the loss positions, re-associated (fastpath point 4)
  const int64_t l = L - 1;
  const Tensor& Wl = W.win[l];
  Tensor posT = at::tensor(pos, tok.options());
  auto [A, mean, rstd] = at::native_layer_norm(x, {d}, W.lnw[l], W.lnb[l], 1e-5);
  Tensor A3 = A.view({B, T, d});
  Tensor Aq = A3.index_select(1, posT).reshape({B * P, d});
  Tensor Q = at::mm(Aq, Wl.narrow(0, 0, d).t()).view({B * P, H, dh}).transpose(0, 1);       // [H, B*P, dh]
  Tensor U = at::mm(Aq, Wl.narrow(0, 3 * d, H * r).t()).view({B * P, H, r}).transpose(0, 1);  // [H, B*P, r]
  Tensor QW = at::bmm(Q, Wl.narrow(0, d, d).view({H, dh, d}));                             // [H, B*P, d]
  Tensor UW = at::bmm(U, Wl.narrow(0, 3 * d + H * r, H * r).view({H, r, d}));
  Tensor gcl = gc[l].view({H, 1, 1});
  Tensor QT = at::add(QW.mul(qs), UW.mul(gcl));  // [H, B*P, d] = W_{K,W}^T q_ext
  Tensor Pr = at::empty({B, H, P, T}, x.options()), abar = at::empty({H, B * P, d}, x.options());
  last_forward<scalar_t>(D, pos, QT.const_data_ptr<scalar_t>(), A.const_data_ptr<scalar_t>(),
                         W.bpos[l].const_data_ptr<scalar_t>(), gp[l].const_data_ptr<scalar_t>(),
                         Pr.mutable_data_ptr<scalar_t>(), abar.mutable_data_ptr<scalar_t>());
  Tensor O = at::bmm(abar, Wl.narrow(0, 2 * d, d).view({H, dh, d}).transpose(1, 2));     // [H, B*P, dh]
  Tensor z = O.transpose(0, 1).reshape({B * P, d});
  Tensor xq = x.view({B, T, d}).index_select(1, posT).reshape({B * P, d});
  Tensor xL = at::addmm(xq, z, W.wout[l].t());
  auto [Y, meanf, rstdf] = at::native_layer_norm(xL, {d}, W.lnfw, W.lnfb, 1e-5);
  logits.copy_(at::mm(Y, W.E.t()).view({B, P, D.V}));
  saved.insert(saved.end(), {SOFTPRIOR_SAVED_LAST(SOFTPRIOR_TENSOR)});
  return saved;
}

std::vector<Tensor> step_forward(const std::vector<Tensor>& params_, const Tensor& gp_, const Tensor& gc_,
                                 const Tensor& tokens_, at::IntArrayRef pos_, double qs, int64_t rank, bool save) {
  std::vector<Tensor> params;
  for (const auto& p : params_) params.push_back(p.contiguous());
  const Tensor gp = gp_.contiguous(), gc = gc_.contiguous(), tokens = tokens_.contiguous();
  const std::vector<int64_t> pos(pos_.begin(), pos_.end());
  const int64_t K = params[kEmbed].size(0), H = gp.size(2);
  const Dims D = dims_of(params, tokens, H, rank, static_cast<int64_t>(pos.size()));
  TORCH_CHECK(gp.size(0) == K && gp.size(1) == D.L && gc.sizes() == gp.sizes(), "softprior step: gates [K, L, H]");
  TORCH_CHECK(tokens.size(0) == 1 || tokens.size(0) == K, "softprior step: tokens [K or 1, B, T]");
  for (int64_t p : pos) TORCH_CHECK(p >= 0 && p < D.T, "softprior step: a loss position outside the context");
  Tensor logits = at::empty({K, D.B, D.P, D.V}, params[kEmbed].options());
  std::vector<std::vector<Tensor>> saved(K);
  AT_DISPATCH_FLOATING_TYPES(params[kEmbed].scalar_type(), "softprior_step_forward", [&] {
    for_runs(K, [&](int64_t k) {
      const Params W(params, k, D.L);
      saved[k] = run_forward<scalar_t>(W, D, tokens[tokens.size(0) == 1 ? 0 : k], gp[k], gc[k], pos,
                                       static_cast<scalar_t>(qs), logits[k]);
      if (!save) saved[k].clear();
    });
  });
  std::vector<Tensor> out{logits};
  for (const auto& sv : saved) out.insert(out.end(), sv.begin(), sv.end());
  return out;
}

template <typename scalar_t>
void run_backward(const Params& W, const Dims& D, const Tensor& tok, const Tensor& gp, const Tensor& gc,
                  const std::vector<int64_t>& pos, scalar_t qs, const std::vector<Tensor>& sv, const Tensor& G,
                  const std::vector<Tensor>& grads, int64_t k, Tensor dgp, Tensor dgc) {
  const int64_t B = D.B, T = D.T, d = D.d, H = D.H, dh = D.dh, r = D.r, P = D.P, L = D.L, V = D.V, Hr = H * r;
  int64_t base = static_cast<int64_t>(sv.size()) - kSavedLast;  // where the saved tensors being bound start
#define SOFTPRIOR_BIND(name) const Tensor& name = sv[base + k_##name];
  SOFTPRIOR_SAVED_LAST(SOFTPRIOR_BIND)
  Tensor Gf = G.reshape({B * P, V});
  const auto slot = [&](int64_t i) { return grads[i][k].mutable_data_ptr<scalar_t>(); };  // run k's gradient i
  // the tied unembedding and the final LayerNorm
  Tensor dE = at::mm(Gf.t(), Y);
  Tensor dxL = ln_backward<scalar_t>(at::mm(Gf, W.E), xL, meanf, rstdf, W.lnfw, W.lnfb, slot(final_param(L, kLnfW)), slot(final_param(L, kLnfB)));
  // the last layer
  const int64_t l = L - 1;
  const Tensor& Wl = W.win[l];
  Tensor posT = at::tensor(pos, tok.options());
  grads[layer_param(l, kWout)][k].copy_(at::mm(dxL.t(), z));
  Tensor dO = at::mm(dxL, W.wout[l]).view({B * P, H, dh}).transpose(0, 1);  // [H, B*P, dh]
  Tensor dWin = at::zeros_like(Wl);
  dWin.narrow(0, 2 * d, d).copy_(at::bmm(dO.transpose(1, 2), abar).reshape({d, d}));
  Tensor dabar = at::bmm(dO, Wl.narrow(0, 2 * d, d).view({H, dh, d}));  // [H, B*P, d]
  Tensor dQT = at::empty({H, B * P, d}, A.options()), dA3 = at::zeros({B, T, d}, A.options());
  Tensor dS = at::empty({B, H, P, T}, A.options());
  last_backward<scalar_t>(D, pos, QT.const_data_ptr<scalar_t>(), A.const_data_ptr<scalar_t>(),
                          Pr.const_data_ptr<scalar_t>(), dabar.const_data_ptr<scalar_t>(),
                          dQT.mutable_data_ptr<scalar_t>(), dA3.mutable_data_ptr<scalar_t>(),
                          dS.mutable_data_ptr<scalar_t>());
  {  // the position bias at the loss positions: d g_pos and d B^pos, the batch summed in order
    const scalar_t* ds = dS.const_data_ptr<scalar_t>();
    const scalar_t* bp = W.bpos[l].const_data_ptr<scalar_t>();
    scalar_t* dbp = grads[layer_param(l, kBpos)][k].mutable_data_ptr<scalar_t>();
    const scalar_t* g = gp[l].const_data_ptr<scalar_t>();
    scalar_t* dg = dgp[l].mutable_data_ptr<scalar_t>();
    std::vector<scalar_t> db(H * P * T, scalar_t(0));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t n = 0; n < H * P * T; ++n) db[n] += ds[b * H * P * T + n];
    for (int64_t h = 0; h < H; ++h) bias_backward(D, h, db.data() + h * P * T, T, P, pos.data(), bp, g[h], dbp, dg[h]);
  }
  Tensor gcl = gc[l].view({H, 1, 1});
  dgc[l].add_((dQT * UW).sum({1, 2}));
  Tensor dQW = dQT.mul(qs), dUW = dQT.mul(gcl);
  Tensor dQ = at::bmm(dQW, Wl.narrow(0, d, d).view({H, dh, d}).transpose(1, 2));          // [H, B*P, dh]
  Tensor dU = at::bmm(dUW, Wl.narrow(0, 3 * d + Hr, Hr).view({H, r, d}).transpose(1, 2));  // [H, B*P, r]
  dWin.narrow(0, d, d).copy_(at::bmm(Q.transpose(1, 2), dQW).reshape({d, d}));
  dWin.narrow(0, 3 * d + Hr, Hr).copy_(at::bmm(U.transpose(1, 2), dUW).reshape({Hr, d}));
  Tensor dQf = dQ.transpose(0, 1).reshape({B * P, d}), dUf = dU.transpose(0, 1).reshape({B * P, Hr});
  Tensor Aq = A.view({B, T, d}).index_select(1, posT).reshape({B * P, d});
  dWin.narrow(0, 0, d).copy_(at::mm(dQf.t(), Aq));
  dWin.narrow(0, 3 * d, Hr).copy_(at::mm(dUf.t(), Aq));
  Tensor dAq = at::addmm(at::mm(dQf, Wl.narrow(0, 0, d)), dUf, Wl.narrow(0, 3 * d, Hr));
  const std::vector<int64_t> qrows = query_rows(pos, B, T);
  Tensor dAf = dA3.view({B * T, d});
  add_rows<scalar_t>(dAf, qrows.data(), dAq.contiguous(), B * P);
  grads[layer_param(l, kWin)][k].copy_(dWin);
  Tensor dx = ln_backward<scalar_t>(dA3.view({B * T, d}), x, mean, rstd, W.lnw[l], W.lnb[l], slot(layer_param(l, kLnW)), slot(layer_param(l, kLnB)));
  add_rows<scalar_t>(dx, qrows.data(), dxL.contiguous(), B * P);  // the residual at the loss positions
  // middle layers, last first
  for (int64_t m = L - 2; m >= 1; --m) {
    base = kSavedFirst + kSavedMiddle * (m - 1);
    SOFTPRIOR_SAVED_MIDDLE(SOFTPRIOR_BIND)
    grads[layer_param(m, kWout)][k].copy_(at::mm(dx.t(), Zm));
    Tensor dZ = at::mm(dx, W.wout[m]);
    Tensor dproj = at::zeros_like(proj);
    full_backward<scalar_t>(D, Rows0<scalar_t>{const_cast<scalar_t*>(proj.const_data_ptr<scalar_t>()), nullptr, T, D.W},
                            Rows0<scalar_t>{dproj.mutable_data_ptr<scalar_t>(), nullptr, T, D.W},
                            W.bpos[m].const_data_ptr<scalar_t>(), gp[m].const_data_ptr<scalar_t>(),
                            gc[m].const_data_ptr<scalar_t>(), qs, Pm.const_data_ptr<scalar_t>(),
                            dZ.const_data_ptr<scalar_t>(), grads[layer_param(m, kBpos)][k].mutable_data_ptr<scalar_t>(),
                            dgp[m].mutable_data_ptr<scalar_t>(), dgc[m].mutable_data_ptr<scalar_t>());
    grads[layer_param(m, kWin)][k].copy_(at::mm(dproj.t(), Am));
    Tensor dxm = ln_backward<scalar_t>(at::mm(dproj, W.win[m]), xm, meanm, rstdm, W.lnw[m], W.lnb[m], slot(layer_param(m, kLnW)),
                                       slot(layer_param(m, kLnB)));
    dx = dx + dxm;
  }
  // layer 0 on the vocabulary
  base = 0;
  SOFTPRIOR_SAVED_FIRST(SOFTPRIOR_BIND)
#undef SOFTPRIOR_BIND
  grads[layer_param(0, kWout)][k].copy_(at::mm(dx.t(), Z0));
  Tensor dZ0 = at::mm(dx, W.wout[0]);
  Tensor dtab = at::zeros_like(tab);
  const int64_t* tk = tok.const_data_ptr<int64_t>();
  if (pairs(D))
    vocab_backward<scalar_t>(D, tab.const_data_ptr<scalar_t>(), tk, W.bpos[0].const_data_ptr<scalar_t>(),
                             gp[0].const_data_ptr<scalar_t>(), gc[0].const_data_ptr<scalar_t>(), qs,
                             P0.const_data_ptr<scalar_t>(), dZ0.const_data_ptr<scalar_t>(),
                             dtab.mutable_data_ptr<scalar_t>(), grads[layer_param(0, kBpos)][k].mutable_data_ptr<scalar_t>(),
                             dgp[0].mutable_data_ptr<scalar_t>(), dgc[0].mutable_data_ptr<scalar_t>());
  else
    full_backward<scalar_t>(D, Rows0<scalar_t>{const_cast<scalar_t*>(tab.const_data_ptr<scalar_t>()), tk, T, D.W},
                          Rows0<scalar_t>{dtab.mutable_data_ptr<scalar_t>(), tk, T, D.W},
                          W.bpos[0].const_data_ptr<scalar_t>(), gp[0].const_data_ptr<scalar_t>(),
                          gc[0].const_data_ptr<scalar_t>(), qs, P0.const_data_ptr<scalar_t>(),
                          dZ0.const_data_ptr<scalar_t>(), grads[layer_param(0, kBpos)][k].mutable_data_ptr<scalar_t>(),
                          dgp[0].mutable_data_ptr<scalar_t>(), dgc[0].mutable_data_ptr<scalar_t>());
  grads[layer_param(0, kWin)][k].copy_(at::mm(dtab.t(), A0));
  Tensor dEn = ln_backward<scalar_t>(at::mm(dtab, W.win[0]), W.E, mean0, rstd0, W.lnw[0], W.lnb[0], slot(layer_param(0, kLnW)), slot(layer_param(0, kLnB)));
  dE.add_(dEn);
  add_rows<scalar_t>(dE, tk, dx.contiguous(), B * T);  // x_0 = E[tok]
  grads[kEmbed][k].copy_(dE);
}

std::vector<Tensor> step_backward(const std::vector<Tensor>& params_, const Tensor& gp_, const Tensor& gc_,
                                  const Tensor& tokens_, at::IntArrayRef pos_, double qs, int64_t rank,
                                  const std::vector<Tensor>& saved, const Tensor& dlogits_) {
  std::vector<Tensor> params;
  for (const auto& p : params_) params.push_back(p.contiguous());
  const Tensor gp = gp_.contiguous(), gc = gc_.contiguous(), tokens = tokens_.contiguous();
  const Tensor dlogits = dlogits_.contiguous().to(params[kEmbed].scalar_type());
  const std::vector<int64_t> pos(pos_.begin(), pos_.end());
  const int64_t K = params[kEmbed].size(0), H = gp.size(2);
  const Dims D = dims_of(params, tokens, H, rank, static_cast<int64_t>(pos.size()));
  const int64_t per = static_cast<int64_t>(saved.size()) / K;
  TORCH_CHECK(per * K == static_cast<int64_t>(saved.size()) && per == saved_per_run(D.L),
              "softprior step: the saved tensors do not match the model");
  std::vector<Tensor> grads;
  for (const auto& p : params) grads.push_back(at::zeros_like(p));
  Tensor dgp = at::zeros_like(gp), dgc = at::zeros_like(gc);
  AT_DISPATCH_FLOATING_TYPES(params[kEmbed].scalar_type(), "softprior_step_backward", [&] {
    for_runs(K, [&](int64_t k) {
      const Params W(params, k, D.L);
      const std::vector<Tensor> sv(saved.begin() + k * per, saved.begin() + (k + 1) * per);
      run_backward<scalar_t>(W, D, tokens[tokens.size(0) == 1 ? 0 : k], gp[k], gc[k], pos, static_cast<scalar_t>(qs),
                             sv, dlogits[k], grads, k, dgp[k], dgc[k]);
    }, true);
  });
  grads.push_back(dgp);
  grads.push_back(dgc);
  return grads;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(softprior, m) {
  m.def("step_forward(Tensor[] params, Tensor gp, Tensor gc, Tensor tokens, int[] pos, float qs, int rank, "
        "bool save) -> Tensor[]");
  m.def("step_backward(Tensor[] params, Tensor gp, Tensor gc, Tensor tokens, int[] pos, float qs, int rank, "
        "Tensor[] saved, Tensor dlogits) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(softprior, CPU, m) {
  m.impl("step_forward", &step_forward);
  m.impl("step_backward", &step_backward);
}
