// One decode step's attention over rlkit's slab cache, on the CPU: the implementation of the operator
// rlkit::decode_attention, whose schema rlkit.rollout.attention_kernel defines (it compiles this file with
// g++ for the CPU it runs on, caches the library and loads it; see that module for when the lean step uses
// it).
//
// decode_attention(q [A, H, 1, D], keys_t [A, Hkv, D, C], values [A, Hkv, C', D], attend [A, 1, 1, L'] bool,
//                  length L, scale, keys [A, Hkv, C', D]?, bf16_out) -> [A, H, 1, D]; q fp32, keys_t, values
//                  and keys all fp32 or all bf16 (rlkit.rollout.bf16_kv's cache: widened to fp32 as they are
//                  loaded, the arithmetic fp32 either way); the output fp32, or with bf16_out rounded to bf16
//                  (round to nearest even, as torch's cast: the packed output projection's input dtype);
//                  query head h reads KV head h / (H / Hkv).
// keys_t holds each KV head's keys transposed (position fastest) with C >= L rounded up to RLKIT_VEC; values
// are read at positions < L, attend at positions < L (1: attended). With keys (the untransposed key slab),
// keys_t is read only for the whole RLKIT_VEC-position blocks below L and the positions after them from keys:
// rlkit::rotary_write fills keys_t a whole block at a time (decode_glue.cpp), so a step writes no scattered
// transposed column. Per (row, KV head): the scores of its
// H / Hkv queries, RLKIT_VEC positions at a time, as register accumulators (no horizontal sums); a vectorised
// softmax (Cephes' expf polynomial: vector_math.h); the weighted sum of the value rows with the outputs held
// in registers. RLKIT_VEC is the floats per vector register the build targets: 16 (AVX-512) or 8 (AVX2).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vector_math.h"

namespace {

using namespace rlkit_vec;

template <typename T>  // the cache's element: float, or uint16_t for bf16
struct Pair {  // one (row, KV head): where its queries, keys, values, mask and outputs are
  const float* q;
  int64_t q_stride;  // between two of its query heads
  const T* keys_t;
  int64_t key_stride;  // between two of the D rows of keys_t
  const T* values;
  int64_t value_stride;  // between two positions
  const bool* attend;
  int64_t attend_stride;
  float* out;  // fp32 outputs, or nullptr where out_bf16 takes them
  uint16_t* out_bf16;
  const T* keys;  // the untransposed keys (nullptr: every position from keys_t)
  int64_t key_row_stride;  // between two positions of keys
  int64_t transposed;  // positions read from keys_t: keys is read from here on
};

template <typename T>
inline float dot(const float* q, const T* k, int d) {  // d a multiple of kW
  vf sum = {};
  for (int t = 0; t < d; t += kW) sum += load(q + t) * load(k + t);
  return sum_lanes(sum);
}

template <typename T, int Per, int D>
void attend_pair(const Pair<T>& pair, int64_t len, float scale, float* scores) {
  static_assert(D % kW == 0, "head size must be a multiple of the vector width");
  const int64_t blocks = (len + kW - 1) / kW, width = blocks * kW;
  const vf zero = {}, minus_inf = zero - INFINITY;
  for (int64_t b = 0; b < blocks; ++b) {  // scores [Per, width]
    vf acc[Per] = {};
    const int64_t filled = std::min<int64_t>(kW, len - b * kW);
    if (b * kW < pair.transposed) {
      for (int t = 0; t < D; ++t) {
        const vf k = load(pair.keys_t + t * pair.key_stride + b * kW);
        for (int p = 0; p < Per; ++p) acc[p] += pair.q[p * pair.q_stride + t] * k;
      }
    } else {  // the positions after keys_t's whole blocks, from the untransposed keys
      for (int64_t c = 0; c < filled; ++c) {
        const T* k = pair.keys + (b * kW + c) * pair.key_row_stride;
        for (int p = 0; p < Per; ++p) acc[p][c] = dot(pair.q + p * pair.q_stride, k, D);
      }
    }
    vc bytes = {};
    for (int64_t c = 0; c < filled; ++c) bytes[c] = pair.attend[(b * kW + c) * pair.attend_stride] ? 1 : 0;
    const vf keep = __builtin_convertvector(bytes, vf);
    for (int p = 0; p < Per; ++p)
      store(scores + p * width + b * kW, keep > 0.0f ? acc[p] * scale : minus_inf);
  }
  for (int p = 0; p < Per; ++p) {  // softmax over each query's positions
    float* s = scores + p * width;
    vf top = minus_inf;
    for (int64_t b = 0; b < blocks; ++b) {
      const vf x = load(s + b * kW);
      top = x > top ? x : top;
    }
    float m = top[0];
    for (int c = 1; c < kW; ++c) m = top[c] > m ? top[c] : m;
    if (m == -INFINITY) m = 0.0f;  // nothing attended: zeros out (SDPA gives NaN; the lean step never asks)
    vf sum = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const vf x = load(s + b * kW);
      const vf e = x > minus_inf ? exp_clamped(x - m) : zero;
      store(s + b * kW, e);
      sum += e;
    }
    const float total = sum_lanes(sum);
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t b = 0; b < blocks; ++b) store(s + b * kW, load(s + b * kW) * inv);
  }
  constexpr int chunks = D / kW;
  vf o[Per][chunks] = {};
  for (int64_t j = 0; j < len; ++j) {
    const T* row = pair.values + j * pair.value_stride;
    vf v[chunks];
    for (int c = 0; c < chunks; ++c) v[c] = load(row + c * kW);
    for (int p = 0; p < Per; ++p) {
      const float w = scores[p * width + j];
      for (int c = 0; c < chunks; ++c) o[p][c] += w * v[c];
    }
  }
  for (int p = 0; p < Per; ++p)
    for (int c = 0; c < chunks; ++c) {
      if (pair.out_bf16 != nullptr)
        store_bf16(pair.out_bf16 + p * D + c * kW, o[p][c]);
      else
        store(pair.out + p * D + c * kW, o[p][c]);
    }
}

template <typename T>
using PairFn = void (*)(const Pair<T>&, int64_t, float, float*);

template <typename T, int D>
PairFn<T> for_group(int64_t per) {
  switch (per) {
    case 1: return &attend_pair<T, 1, D>;
    case 2: return &attend_pair<T, 2, D>;
    case 3: return &attend_pair<T, 3, D>;
    case 4: return &attend_pair<T, 4, D>;
    case 5: return &attend_pair<T, 5, D>;
    case 6: return &attend_pair<T, 6, D>;
    case 7: return &attend_pair<T, 7, D>;
    case 8: return &attend_pair<T, 8, D>;
    default: return nullptr;
  }
}

template <typename T>
PairFn<T> kernel_for(int64_t per, int64_t dim) {
  switch (dim) {
    case 16: return for_group<T, 16>(per);
    case 32: return for_group<T, 32>(per);
    case 64: return for_group<T, 64>(per);
    case 128: return for_group<T, 128>(per);
    default: return nullptr;
  }
}

template <typename T>
void attend_all(const at::Tensor& q, const at::Tensor& keys_t, const at::Tensor& values, const at::Tensor& attend,
                int64_t length, double scale, const at::Tensor& out, const T* kp, const T* vp,
                const at::Tensor* keys, const T* rp) {
  const int64_t a = q.size(0), h = q.size(1), d = q.size(3), hkv = keys_t.size(1);
  const PairFn<T> fn = kernel_for<T>(h / hkv, d);
  TORCH_CHECK(fn != nullptr, "rlkit::decode_attention: no kernel for ", h / hkv,
              " query heads per KV head of ", d, " (1-8 heads of 16, 32, 64 or 128)");
  const float* qp = q.data_ptr<float>();  // a view of the step's q/k projection: its strides, no copy
  const bool* mp = attend.data_ptr<bool>();
  const bool bf16_out = out.scalar_type() == at::kBFloat16;
  float* op = bf16_out ? nullptr : out.data_ptr<float>();
  uint16_t* bp = bf16_out ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  const int64_t per = h / hkv, width = (length + kW - 1) / kW * kW;
  const int64_t transposed = keys != nullptr ? length / kW * kW : width;
  at::parallel_for(0, a * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(per * width);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / hkv, g = i % hkv;
      const Pair<T> pair{qp + r * q.stride(0) + g * per * q.stride(1),
                         q.stride(1),
                         kp + r * keys_t.stride(0) + g * keys_t.stride(1),
                         keys_t.stride(2),
                         vp + r * values.stride(0) + g * values.stride(1),
                         values.stride(2),
                         mp + r * attend.stride(0),
                         attend.stride(3),
                         bf16_out ? nullptr : op + (r * h + g * per) * d,
                         bf16_out ? bp + (r * h + g * per) * d : nullptr,
                         keys != nullptr ? rp + r * keys->stride(0) + g * keys->stride(1) : nullptr,
                         keys != nullptr ? keys->stride(2) : 0,
                         transposed};
      fn(pair, length, static_cast<float>(scale), scores.data());
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys_t, const at::Tensor& values,
                            const at::Tensor& attend, int64_t length, double scale,
                            const c10::optional<at::Tensor>& keys, bool bf16_out) {
  const bool bf16 = keys_t.scalar_type() == at::kBFloat16;
  TORCH_CHECK(q.scalar_type() == at::kFloat && attend.scalar_type() == at::kBool &&
                  (keys_t.scalar_type() == at::kFloat || bf16) && values.scalar_type() == keys_t.scalar_type(),
              "rlkit::decode_attention: fp32 q, keys_t and values both fp32 or both bf16, a bool attend");
  TORCH_CHECK(q.dim() == 4 && keys_t.dim() == 4 && values.dim() == 4 && attend.dim() == 4,
              "rlkit::decode_attention: 4-d q, keys_t, values, attend");
  const int64_t a = q.size(0), h = q.size(1), d = q.size(3), hkv = keys_t.size(1);
  TORCH_CHECK(keys_t.size(0) == a && values.size(0) == a && attend.size(0) == a, "rows differ");
  TORCH_CHECK(hkv > 0 && h % hkv == 0 && keys_t.size(2) == d && values.size(3) == d,
              "heads or head size differ");
  TORCH_CHECK(length > 0 && (length + kW - 1) / kW * kW <= keys_t.size(3) && length <= values.size(2) &&
                  length <= attend.size(3),
              "rlkit::decode_attention: keys_t needs room for the length rounded up to the vector width");
  TORCH_CHECK(keys_t.stride(3) == 1 && values.stride(3) == 1, "keys_t and values: last dim contiguous");
  TORCH_CHECK(q.stride(3) == 1, "rlkit::decode_attention: q's last dim contiguous");
  const at::Tensor* k = keys.has_value() && keys->defined() ? &*keys : nullptr;
  if (k != nullptr)
    TORCH_CHECK(k->dim() == 4 && k->scalar_type() == keys_t.scalar_type() && k->size(0) == a &&
                    k->size(1) == hkv && k->size(3) == d && length <= k->size(2) && k->stride(3) == 1,
                "rlkit::decode_attention: keys [A, Hkv, C, D] in keys_t's dtype, C >= length, last dim contiguous");
  at::Tensor out = at::empty({a, h, 1, d}, q.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (bf16) {
    attend_all<uint16_t>(q, keys_t, values, attend, length, scale, out,
                         reinterpret_cast<const uint16_t*>(keys_t.data_ptr<at::BFloat16>()),
                         reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>()), k,
                         k != nullptr ? reinterpret_cast<const uint16_t*>(k->data_ptr<at::BFloat16>()) : nullptr);
  } else {
    attend_all<float>(q, keys_t, values, attend, length, scale, out, keys_t.data_ptr<float>(),
                      values.data_ptr<float>(), k, k != nullptr ? k->data_ptr<float>() : nullptr);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rlkit, CPU, m) { m.impl("decode_attention", &decode_attention); }
