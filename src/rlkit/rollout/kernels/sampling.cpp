// The decode loop's next-token draw over the whole vocabulary, on the CPU: the implementation of the operator
// rlkit::sample_rows, whose schema rlkit.rollout.cpu_kernels defines (it compiles this file with the other
// kernels; rlkit.rollout.sampling.sample_next calls it for an untruncated or greedy draw). It replaces the
// torch path's widening copy of the logits, its softmax over [B, V] and its block sums (three passes that
// write [B, V] floats) with two reads of each row, the logits read as they are (fp32, or the bf16 the decode
// copy's head wrote).
//
// sample_rows(logits [B, V] fp32|bf16, uniform [B, 1] fp64 or None, temperature, block)
//     -> (tokens [B] int64, log_prob [B] fp32)
// Per row, x = logits / temperature (not divided at 1, as torch's path), m = max(x):
// - greedy (uniform None): the first index of the maximum (torch.argmax's), log_prob = -log(sum exp(x - m));
// - else the inverse CDF of softmax(x) at u: the sums of exp(x - m) over blocks of `block` tokens (fp32)
//   and their fp64 cumulative sum find the block holding u * total, the fp64 cumulative sum inside it the
//   token (rlkit.rollout.sampling._sample_full_vocabulary's two levels, over unnormalised terms, so a token
//   can differ from it only for a draw within float rounding of a token boundary), and
//   log_prob = (x_t - m) - log(total) in fp64: log_softmax(x) at the token, never the log of a rounded
//   probability.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "vector_math.h"

namespace {

using namespace rlkit_vec;

template <typename T>
inline float scaled(const T* p, int64_t i, float temperature, bool divide) {  // x_i, one value
  return divide ? widen(p[i]) / temperature : widen(p[i]);
}

inline float exp_one(float x) {  // exp_clamped of one value: the same lane arithmetic as the vector passes
  const vf v = (vf){} + x;
  return exp_clamped(v)[0];
}

template <typename T>
float row_max(const T* p, int64_t v, float temperature, bool divide) {
  vf lanes = (vf){} - std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + kW <= v; i += kW) {
    vf x = load(p + i);
    if (divide) x = x / temperature;
    lanes = x > lanes ? x : lanes;
  }
  float m = lanes[0];
  for (int c = 1; c < kW; ++c) m = std::max(m, lanes[c]);
  for (; i < v; ++i) m = std::max(m, scaled(p, i, temperature, divide));
  return m;
}

// the sum of exp(x - m) over [begin, end), fp32, lanes then their sum
template <typename T>
float block_sum(const T* p, int64_t begin, int64_t end, float m, float temperature, bool divide) {
  vf lanes = {};
  int64_t i = begin;
  for (; i + kW <= end; i += kW) {
    vf x = load(p + i);
    if (divide) x = x / temperature;
    lanes += exp_clamped(x - m);
  }
  float sum = sum_lanes(lanes);
  for (; i < end; ++i) sum += exp_one(scaled(p, i, temperature, divide) - m);
  return sum;
}

template <typename T>
void sample_row(const T* p, int64_t v, float temperature, const double* u, int64_t block,
                std::vector<double>& cdf, int64_t* token, float* log_prob) {
  const bool divide = temperature != 1.0f;
  const float m = row_max(p, v, temperature, divide);
  const int64_t blocks = (v + block - 1) / block;
  double total = 0.0;
  for (int64_t c = 0; c < blocks; ++c) {
    total += static_cast<double>(block_sum(p, c * block, std::min(v, (c + 1) * block), m, temperature, divide));
    cdf[c] = total;
  }
  auto x_at = [&](int64_t i) { return scaled(p, i, temperature, divide); };
  int64_t pick = 0;
  if (u == nullptr) {  // greedy: the first maximum
    while (pick < v - 1 && !(x_at(pick) == m)) ++pick;
  } else {
    const double target = *u * total;
    int64_t c = std::upper_bound(cdf.begin(), cdf.begin() + blocks, target) - cdf.begin();
    c = std::min(c, blocks - 1);
    double running = c > 0 ? cdf[c - 1] : 0.0;
    const int64_t begin = c * block, end = std::min(v, begin + block);
    pick = std::min(begin + block - 1, v - 1);  // past the block's last boundary: its last token
    for (int64_t i = begin; i < end; ++i) {
      running += static_cast<double>(exp_one(x_at(i) - m));
      if (running > target) {
        pick = i;
        break;
      }
    }
  }
  *token = pick;
  *log_prob = static_cast<float>(static_cast<double>(x_at(pick) - m) - std::log(total));
}

std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits, const c10::optional<at::Tensor>& uniform,
                                               double temperature, int64_t block) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "rlkit::sample_rows: logits [B, V] with a contiguous last dim");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "rlkit::sample_rows: fp32 or bf16 logits");
  TORCH_CHECK(temperature > 0 && block > 0, "rlkit::sample_rows: temperature > 0 and block > 0");
  const int64_t b = logits.size(0), v = logits.size(1);
  const bool greedy = !uniform.has_value() || !uniform->defined();
  const double* u = nullptr;
  int64_t u_stride = 0;
  if (!greedy) {
    TORCH_CHECK(uniform->scalar_type() == at::kDouble && uniform->dim() == 2 && uniform->size(0) == b &&
                    uniform->size(1) == 1,
                "rlkit::sample_rows: uniform [B, 1] fp64");
    u = uniform->data_ptr<double>();
    u_stride = uniform->stride(0);
  }
  auto tokens = at::empty({b}, logits.options().dtype(at::kLong));
  auto log_prob = at::empty({b}, logits.options().dtype(at::kFloat));
  int64_t* tokens_data = tokens.data_ptr<int64_t>();
  float* log_prob_data = log_prob.data_ptr<float>();
  const float t = static_cast<float>(temperature);
  const int64_t blocks = (v + block - 1) / block;
  at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> cdf(blocks);
    for (int64_t r = begin; r < end; ++r) {
      const double* ur = greedy ? nullptr : u + r * u_stride;
      if (logits.scalar_type() == at::kBFloat16) {
        const uint16_t* p = reinterpret_cast<const uint16_t*>(logits.data_ptr<at::BFloat16>()) + r * logits.stride(0);
        sample_row(p, v, t, ur, block, cdf, tokens_data + r, log_prob_data + r);
      } else {
        sample_row(logits.data_ptr<float>() + r * logits.stride(0), v, t, ur, block, cdf, tokens_data + r,
                   log_prob_data + r);
      }
    }
  });
  return {tokens, log_prob};
}

}  // namespace

TORCH_LIBRARY_IMPL(rlkit, CPU, m) { m.impl("sample_rows", &sample_rows); }
