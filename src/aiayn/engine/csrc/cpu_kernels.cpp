// CPU kernels (not in the paper). aiayn.engine.kernels builds this file on first use; tests check
// each kernel against its formula.
//
// decode_attention: for decoding steps, attention for a few queries per row.
// label_smoothed_ce: for training, the label-smoothed cross-entropy (§5.4) and its gradient.
//
// decode_attention: scaled dot-product attention (§3.2.1, eq. 1) of a few queries per row over
// cached keys and values: softmax(Q Kᵀ / √d_k) V with a boolean mask (True = may attend).
// At a decoding step each (row, head) has 1-16 queries against <= a few hundred keys. torch's fused
// CPU kernel tiles for long queries and spends most of such a call on per-tile overhead; here each
// row's keys and values are streamed once for all of its heads and queries.
// Legend: B rows, H heads, T queries, S keys, D_k / D_v head sizes.
// q (B, H, T, D_k), k (B, H, S, D_k), v (B, H, S, D_v), any strides with the last one 1;
// mask: none or bool (B|1, 1, T|1, S), any strides. Returns (B, T, H, D_v), contiguous: the
// layout W^O takes. A query with no key to attend to gives zeros, as in aiayn's Python path.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// a · b with 8 independent partial sums: vectorizes without reassociating one running sum.
inline float dot(const float* a, const float* b, int64_t n) {
  float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) lane[j] += a[i + j] * b[i + j];
  float s = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// e^x for x <= 0 (scores minus their row maximum); -inf (masked) gives 0, NaN NaN. Cephes' expf:
// e^x = 2^n e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by a degree-7 polynomial;
// branch-free, so that loops over it vectorize (with -fno-trapping-math: kernels.py's flags).
inline float exp_nonpositive(float in) {
  const float v = in >= -87.f ? in : -87.f;  // NaN too: the int conversion below needs a number
  const float m = std::floor(v * 1.44269504088896341f + 0.5f);
  const float r = v - m * 0.693359375f + m * 2.12194440e-4f;  // ln 2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(m) + 127) << 23;  // 2^m
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return in < -87.f ? 0.f : (in == in ? p * scale : in);  // NaN stays NaN
}

// x <- e^x in place for x <= 0.
inline void exp_nonpositive(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = exp_nonpositive(x[i]);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be (B, H, L, D)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "q, k, v must be float32");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "q, k, v must be on the CPU");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), Dk = q.size(3);
  const int64_t S = k.size(2), Dv = v.size(3);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && k.size(1) == H && v.size(1) == H, "q, k, v rows and heads differ");
  TORCH_CHECK(k.size(3) == Dk && v.size(2) == S, "k must be (B, H, S, D_k) and v (B, H, S, D_v)");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "k and v need unit stride in their last dimension");

  const bool* mb = nullptr;
  int64_t ms0 = 0, ms2 = 0, ms3 = 0;
  if (mask.has_value() && mask->defined()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 4 && m.size(1) == 1, "mask must be bool (B|1, 1, T|1, S)");
    TORCH_CHECK((m.size(0) == 1 || m.size(0) == B) && (m.size(2) == 1 || m.size(2) == T) && m.size(3) == S,
                "mask must broadcast to (B, 1, T, S)");
    mb = m.data_ptr<bool>();
    ms0 = m.size(0) == 1 ? 0 : m.stride(0);
    ms2 = m.size(2) == 1 ? 0 : m.stride(2);
    ms3 = m.stride(3);
  }

  at::Tensor out = at::empty({B, T, H, Dv}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2), qs3 = q.stride(3);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const float scale = 1.f / std::sqrt(static_cast<float>(Dk));
  const float NEG_INF = -std::numeric_limits<float>::infinity();
  const int64_t M = T * H;  // query vectors of one row, in output order (t, h)

  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qb(M * Dk), p(M * S), acc(M * Dv);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t t = 0; t < T; ++t)  // queries, scaled by 1/√d_k, gathered contiguous
        for (int64_t h = 0; h < H; ++h) {
          const float* src = qp + b * qs0 + h * qs1 + t * qs2;
          float* dst = qb.data() + (t * H + h) * Dk;
          for (int64_t d = 0; d < Dk; ++d) dst[d] = src[d * qs3] * scale;
        }
      for (int64_t s = 0; s < S; ++s)  // scores, key by key: each key read once for all queries
        for (int64_t h = 0; h < H; ++h) {
          const float* key = kp + b * ks0 + h * ks1 + s * ks2;
          for (int64_t t = 0; t < T; ++t) p[(t * H + h) * S + s] = dot(qb.data() + (t * H + h) * Dk, key, Dk);
        }
      for (int64_t t = 0; t < T; ++t) {  // softmax over the keys the mask allows
        const bool* allowed = mb ? mb + b * ms0 + t * ms2 : nullptr;
        for (int64_t h = 0; h < H; ++h) {
          float* row = p.data() + (t * H + h) * S;
          if (allowed)
            for (int64_t s = 0; s < S; ++s)
              if (!allowed[s * ms3]) row[s] = NEG_INF;
          float top = NEG_INF;
          bool nan = false;
          for (int64_t s = 0; s < S; ++s) {
            top = std::max(top, row[s]);
            nan |= std::isnan(row[s]);
          }
          if (nan) {  // a NaN score gives a NaN output, as the formula does (not a masked row's zeros)
            std::fill(row, row + S, std::numeric_limits<float>::quiet_NaN());
            continue;
          }
          if (top == NEG_INF) {  // nothing to attend to: zero weights, zero output
            std::fill(row, row + S, 0.f);
            continue;
          }
          for (int64_t s = 0; s < S; ++s) row[s] -= top;
          exp_nonpositive(row, S);
          float sum = 0.f;
          for (int64_t s = 0; s < S; ++s) sum += row[s];
          const float inv = 1.f / sum;
          for (int64_t s = 0; s < S; ++s) row[s] *= inv;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = 0; s < S; ++s)  // weighted values, value by value
        for (int64_t h = 0; h < H; ++h) {
          const float* value = vp + b * vs0 + h * vs1 + s * vs2;
          for (int64_t t = 0; t < T; ++t) {
            const float w = p[(t * H + h) * S + s];
            float* a = acc.data() + (t * H + h) * Dv;
            for (int64_t d = 0; d < Dv; ++d) a[d] += w * value[d];
          }
        }
      std::copy(acc.begin(), acc.end(), op + b * M * Dv);  // (T, H, D_v) of row b
    }
  });
  return out;
}

// label_smoothed_ce: per row of logits z (N, V) and its target y, with p = softmax(z) and the
// smoothed target q = (1 - eps) onehot(y) + eps / V,
//   loss = -sum_v q_v log p_v = (1 - eps) (lse - z_y) + eps (lse - mean_v z_v),  lse = log sum_v e^z_v,
//   nll = lse - z_y, and (if want_grad) the gradient d loss / d z = p - q, in z's dtype.
// Three passes over a row that stays in cache (its maximum and sum; e^(z - max) into a float
// scratch row; p - q), instead of torch's log_softmax, exp and scatter over whole (N, V) buffers,
// and for bfloat16 logits no float32 copy of them. Accumulation in float32; logits float32 or
// bfloat16. The sums vectorize by `omp simd` (reordered float sums, as torch's are). Returns
// (loss (N,), nll (N,), grad (N, V) or empty), loss and nll float32.
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
void label_smoothed_rows(const T* z, const int64_t* y, float* loss, float* nll, T* grad, int64_t N, int64_t V,
                         float eps) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> e(V);
    float* ev = e.data();
    for (int64_t i = begin; i < end; ++i) {
      const T* x = z + i * V;
      float m = -std::numeric_limits<float>::infinity(), total = 0.f;
#pragma omp simd reduction(max : m) reduction(+ : total)
      for (int64_t v = 0; v < V; ++v) {
        const float xv = widen(x[v]);
        m = xv > m ? xv : m;
        total += xv;
      }
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t v = 0; v < V; ++v) {
        ev[v] = exp_nonpositive(widen(x[v]) - m);
        s += ev[v];
      }
      const int64_t t = y[i];
      const float lse = m + std::log(s);
      nll[i] = lse - widen(x[t]);
      loss[i] = (1.f - eps) * nll[i] + eps * (lse - total / static_cast<float>(V));
      if (grad != nullptr) {
        T* g = grad + i * V;
        const float inv = 1.f / s, uniform = eps / static_cast<float>(V);
        for (int64_t v = 0; v < V; ++v) g[v] = static_cast<T>(ev[v] * inv - uniform);
        g[t] = static_cast<T>(ev[t] * inv - uniform - (1.f - eps));
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> label_smoothed_ce(const at::Tensor& logits, const at::Tensor& target,
                                                                 double eps, bool want_grad) {
  TORCH_CHECK(logits.dim() == 2 && target.dim() == 1 && target.size(0) == logits.size(0),
              "expected logits (N, V) and target (N,)");
  TORCH_CHECK(logits.device().is_cpu() && target.device().is_cpu(), "logits and target must be on the CPU");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "logits must be float32 or bfloat16");
  const at::Tensor z = logits.contiguous();
  TORCH_CHECK(target.scalar_type() == at::kLong, "target must be int64 (as torch's gather takes it)");
  const at::Tensor y = target.contiguous();
  const int64_t N = z.size(0), V = z.size(1);
  TORCH_CHECK(V > 0, "logits need at least one class");
  const int64_t* yp = y.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(yp[i] >= 0 && yp[i] < V, "target ", yp[i], " at row ", i, " is out of bounds for ", V, " classes");
  at::Tensor loss = at::empty({N}, z.options().dtype(at::kFloat));
  at::Tensor nll = at::empty({N}, z.options().dtype(at::kFloat));
  at::Tensor grad = at::empty({want_grad ? N : 0, want_grad ? V : 0}, z.options());
  const float e = static_cast<float>(eps);
  if (z.scalar_type() == at::kFloat) {
    label_smoothed_rows<float>(z.data_ptr<float>(), yp, loss.data_ptr<float>(), nll.data_ptr<float>(),
                               want_grad ? grad.data_ptr<float>() : nullptr, N, V, e);
  } else {
    label_smoothed_rows<c10::BFloat16>(z.data_ptr<c10::BFloat16>(), yp, loss.data_ptr<float>(),
                                       nll.data_ptr<float>(), want_grad ? grad.data_ptr<c10::BFloat16>() : nullptr,
                                       N, V, e);
  }
  return {loss, nll, grad};
}

}  // namespace

TORCH_LIBRARY(aiayn_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask) -> Tensor");
  m.def("label_smoothed_ce(Tensor logits, Tensor target, float eps, bool want_grad) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(aiayn_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("label_smoothed_ce", &label_smoothed_ce);
}
