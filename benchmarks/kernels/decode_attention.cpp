// A spike, not part of rlkit: one decode step's attention for SmolLM2-like heads (head size 64) as a torch
// operator, to ask whether a hand-written CPU kernel beats torch's SDPA at decode shapes
// (benchmarks/decode_attention_kernel.py compiles, checks and times it; docs/benchmarks.md, session 30).
//
// rlkit_bench::decode_attention(q [A, H, 1, 64], keys_t [A, Hkv, 64, C], values [A, Hkv, C, 64],
//                               attend [A, L] bool, L, scale) -> [A, H, 1, 64]
// keys_t holds each KV head's keys transposed (position fastest), C >= L rounded up to 16. Query head h reads
// KV head h / (H / Hkv). Per (row, KV head): the scores of its H / Hkv queries for 16 positions at a time as
// register accumulators (no horizontal sums), a vectorised softmax (Cephes' expf polynomial), then the
// weighted sum of the value rows with the outputs held in registers. AVX-512 only (compiled with
// -march=x86-64-v4): a 16-float GCC vector is one register there.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef char c16 __attribute__((vector_size(16)));
constexpr int64_t kDim = 64;

inline v16 load(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline void store(float* p, v16 x) { std::memcpy(p, &x, sizeof(x)); }

inline v16 exp_nonpositive(v16 x) {  // exp(x) for x <= 0: Cephes' expf, 2^n from the exponent bits
  const v16 zero = {};
  x = x < -87.0f ? zero - 87.0f : x;
  const v16 fx = x * 1.44269504088896341f + 0.5f;
  const i16 truncated = __builtin_convertvector(fx, i16);
  const i16 n = __builtin_convertvector(truncated, v16) > fx ? truncated - 1 : truncated;  // floor
  const v16 nf = __builtin_convertvector(n, v16);
  const v16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  v16 y = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
           1.6666665459e-1f) * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  v16 pow2;
  const i16 bits = (n + 127) << 23;
  std::memcpy(&pow2, &bits, sizeof(pow2));
  return y * pow2;
}

template <int Per>
void attend_pair(const float* q, const float* kt, int64_t kt_stride, const float* v, int64_t v_stride,
                 const bool* attend, int64_t len, float scale, float* scores, float* out) {
  const int64_t blocks = (len + 15) / 16, width = blocks * 16;
  const v16 zero = {}, minus_inf = zero - INFINITY;
  for (int64_t b = 0; b < blocks; ++b) {  // scores [Per, width]
    v16 acc[Per] = {};
    for (int64_t t = 0; t < kDim; ++t) {
      const v16 k = load(kt + t * kt_stride + b * 16);
      for (int p = 0; p < Per; ++p) acc[p] += q[p * kDim + t] * k;
    }
    c16 mask_bytes = {};
    std::memcpy(&mask_bytes, attend + b * 16, std::min<int64_t>(16, len - b * 16));
    const v16 keep = __builtin_convertvector(mask_bytes, v16);
    for (int p = 0; p < Per; ++p)
      store(scores + p * width + b * 16, keep > 0.0f ? acc[p] * scale : minus_inf);
  }
  for (int p = 0; p < Per; ++p) {  // softmax over each query's row
    float* s = scores + p * width;
    v16 top = minus_inf;
    for (int64_t b = 0; b < blocks; ++b) top = load(s + b * 16) > top ? load(s + b * 16) : top;
    float m = top[0];
    for (int c = 1; c < 16; ++c) m = top[c] > m ? top[c] : m;
    v16 sum = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const v16 x = load(s + b * 16);
      const v16 e = x > minus_inf ? exp_nonpositive(x - m) : zero;
      store(s + b * 16, e);
      sum += e;
    }
    float total = 0.0f;
    for (int c = 0; c < 16; ++c) total += sum[c];
    const float inv = 1.0f / total;
    for (int64_t b = 0; b < blocks; ++b) store(s + b * 16, load(s + b * 16) * inv);
  }
  v16 o[Per][4] = {};
  for (int64_t j = 0; j < len; ++j) {
    const float* row = v + j * v_stride;
    const v16 v0 = load(row), v1 = load(row + 16), v2 = load(row + 32), v3 = load(row + 48);
    for (int p = 0; p < Per; ++p) {
      const float w = scores[p * width + j];
      o[p][0] += w * v0;
      o[p][1] += w * v1;
      o[p][2] += w * v2;
      o[p][3] += w * v3;
    }
  }
  for (int p = 0; p < Per; ++p)
    for (int c = 0; c < 4; ++c) store(out + p * kDim + c * 16, o[p][c]);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys_t, const at::Tensor& values,
                            const at::Tensor& attend, int64_t len, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys_t.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat && attend.scalar_type() == at::kBool,
              "decode_attention: fp32 q/K/V and a bool mask");
  const int64_t a = keys_t.size(0), hkv = keys_t.size(1), capacity = keys_t.size(3);
  const int64_t h = q.size(1), per = h / hkv;
  TORCH_CHECK(keys_t.size(2) == kDim && values.size(3) == kDim && q.size(3) == kDim, "head size 64 only");
  TORCH_CHECK(per == 3, "3 query heads per KV head only (SmolLM2)");
  TORCH_CHECK((len + 15) / 16 * 16 <= capacity, "keys_t needs room for L rounded up to 16");
  TORCH_CHECK(keys_t.is_contiguous() && values.stride(3) == 1 && attend.stride(1) == 1, "layouts");
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty({a, h, 1, kDim}, q.options());
  const float *qp = qc.data_ptr<float>(), *kp = keys_t.data_ptr<float>(), *vp = values.data_ptr<float>();
  const bool* mp = attend.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t v0 = values.stride(0), v1 = values.stride(1), v2 = values.stride(2), m0 = attend.stride(0);
  at::parallel_for(0, a * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(per * ((len + 15) / 16 * 16));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / hkv, g = i % hkv;
      attend_pair<3>(qp + (r * h + g * per) * kDim, kp + (r * hkv + g) * kDim * capacity, capacity,
                     vp + r * v0 + g * v1, v2, mp + r * m0, len, static_cast<float>(scale), scores.data(),
                     op + (r * h + g * per) * kDim);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(rlkit_bench, m) {
  m.def(
      "decode_attention(Tensor q, Tensor keys_t, Tensor values, Tensor attend, int len, float scale) -> "
      "Tensor");
}
TORCH_LIBRARY_IMPL(rlkit_bench, CPU, m) { m.impl("decode_attention", &decode_attention); }
