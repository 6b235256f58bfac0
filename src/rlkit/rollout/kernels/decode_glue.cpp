// The lean decode step's elementwise work between its GEMMs, fused per row, on the CPU: the implementation of
// the operators rlkit::rms_norm_cast, rlkit::add_rms_norm_cast, rlkit::rotary_write and rlkit::silu_mul_cast,
// whose schemas rlkit.rollout.cpu_kernels defines (it compiles this file with the attention kernel; the
// fused layer loop of rlkit.rollout.scripted_step calls them). Each replaces a run of small operators (casts,
// slices, norms, rotary, the K/V writes, SiLU) with one pass over a row; the arithmetic is fp32, the outputs rounded to bf16 (round to
// nearest even, as torch's casts) where the next GEMM takes bf16.
//
// rms_norm_cast(x [A, N] fp32, weight [N], eps, bf16) -> [A, N]: x / sqrt(mean(x²) + eps) * weight.
// add_rms_norm_cast(x [A, N] fp32, y [A, N] fp32|bf16, bias [N]?, weight [N], eps, bf16)
//     -> (x + y + bias [A, N] fp32, its rms_norm_cast).
// rotary_write(y [A, (H + 2 Hkv) D] fp32|bf16, bias?, cos [A, 1, D], sin [A, 1, D] (rotate_half's signs
//     folded in), q_norm [D]?, k_norm [D]?, eps, key_slab [A, Hkv, C, D], value_slab [A, Hkv, C, D],
//     key_slab_t [A, Hkv, D, C']?, start, heads, kv_heads) -> q [A, H, 1, D] fp32: y's q and k heads
//     (RMS-normed per head where norms are given) rotated (x cos + roll(x, D/2) sin), k and v written into
//     the slabs (fp32 or bf16) at position start; where start ends a block of RLKIT_VEC positions, that
//     block of keys copied into key_slab_t (one whole vector per head dim, where a position at a time wrote
//     D scattered columns): rlkit::decode_attention, given the key slab, reads the positions after the last
//     whole block from it.
// silu_mul_cast(gate_up [A, 2I] fp32|bf16, bias [2I]?, bf16) -> [A, I]: silu(gate) * up.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "vector_math.h"

namespace {

using namespace rlkit_vec;

// row of n values of t (fp32 or bf16) from column offset, plus bias[offset:] (or none), into out as fp32
inline void load_row(const at::Tensor& t, int64_t row, int64_t offset, int64_t n, const float* bias,
                     float* out) {
  int64_t i = 0;
  if (t.scalar_type() == at::kBFloat16) {
    const uint16_t* p =
        reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()) + row * t.stride(0) + offset;
    for (; i + kW <= n; i += kW) store(out + i, load(p + i));
    for (; i < n; ++i) out[i] = widen(p[i]);
  } else {
    const float* p = t.data_ptr<float>() + row * t.stride(0) + offset;
    std::memcpy(out, p, n * sizeof(float));
  }
  if (bias != nullptr)
    for (i = 0; i < n; ++i) out[i] += bias[offset + i];
}

inline void store_row(at::Tensor& t, int64_t row, int64_t n, const float* in) {
  int64_t i = 0;
  if (t.scalar_type() == at::kBFloat16) {
    uint16_t* p = reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()) + row * t.stride(0);
    for (; i + kW <= n; i += kW) store_bf16(p + i, load(in + i));
    for (; i < n; ++i) p[i] = to_bf16(in[i]);
  } else {
    std::memcpy(t.data_ptr<float>() + row * t.stride(0), in, n * sizeof(float));
  }
}

inline void rms_norm_into(const float* x, const float* weight, int64_t n, double eps, float* out) {
  vf lanes = {};
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    const vf v = load(x + i);
    lanes += v * v;
  }
  float sum = sum_lanes(lanes);
  for (; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + static_cast<float>(eps));
  for (i = 0; i + kW <= n; i += kW) store(out + i, load(x + i) * inv * load(weight + i));
  for (; i < n; ++i) out[i] = x[i] * inv * weight[i];
}

const float* optional_data(const c10::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "rlkit glue: fp32 contiguous bias/norm");
  return t->data_ptr<float>();
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, "rlkit glue: ", name, " must be 2-d with a contiguous last dim");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "rlkit glue: ", name,
              " must be fp32 or bf16");
}

at::TensorOptions out_options(const at::Tensor& like, bool bf16) {
  return like.options().dtype(bf16 ? at::kBFloat16 : at::kFloat);
}

at::Tensor rms_norm_cast(const at::Tensor& x, const at::Tensor& weight, double eps, bool bf16) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "rlkit::rms_norm_cast: fp32 x");
  const int64_t a = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n, "rlkit::rms_norm_cast: weight size");
  const at::Tensor w = weight.contiguous().to(at::kFloat);
  at::Tensor out = at::empty({a, n}, out_options(x, bf16));
  at::parallel_for(0, a, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> row(n), normed(n);
    for (int64_t r = begin; r < end; ++r) {
      load_row(x, r, 0, n, nullptr, row.data());
      rms_norm_into(row.data(), w.data_ptr<float>(), n, eps, normed.data());
      store_row(out, r, n, normed.data());
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cast(const at::Tensor& x, const at::Tensor& y,
                                                     const c10::optional<at::Tensor>& bias,
                                                     const at::Tensor& weight, double eps, bool bf16) {
  check_rows(x, "x");
  check_rows(y, "y");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "rlkit::add_rms_norm_cast: fp32 x");
  const int64_t a = x.size(0), n = x.size(1);
  TORCH_CHECK(y.size(0) == a && y.size(1) == n && weight.numel() == n, "rlkit::add_rms_norm_cast: sizes");
  const at::Tensor w = weight.contiguous().to(at::kFloat);
  const float* b = optional_data(bias);
  at::Tensor sum = at::empty({a, n}, x.options());
  at::Tensor out = at::empty({a, n}, out_options(x, bf16));
  at::parallel_for(0, a, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> row(n), added(n), normed(n);
    for (int64_t r = begin; r < end; ++r) {
      load_row(y, r, 0, n, b, row.data());
      const float* xp = x.data_ptr<float>() + r * x.stride(0);
      for (int64_t i = 0; i < n; ++i) added[i] = xp[i] + row[i];
      store_row(sum, r, n, added.data());
      rms_norm_into(added.data(), w.data_ptr<float>(), n, eps, normed.data());
      store_row(out, r, n, normed.data());
    }
  });
  return {sum, out};
}

at::Tensor silu_mul_cast(const at::Tensor& gate_up, const c10::optional<at::Tensor>& bias, bool bf16) {
  check_rows(gate_up, "gate_up");
  const int64_t a = gate_up.size(0), width = gate_up.size(1), n = width / 2;
  TORCH_CHECK(width % 2 == 0, "rlkit::silu_mul_cast: an even width (gate then up)");
  const float* b = optional_data(bias);
  at::Tensor out = at::empty({a, n}, out_options(gate_up, bf16));
  at::parallel_for(0, a, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> row(width), product(n);
    for (int64_t r = begin; r < end; ++r) {
      load_row(gate_up, r, 0, width, b, row.data());
      int64_t i = 0;
      for (; i + kW <= n; i += kW) {
        const vf g = load(row.data() + i);
        store(product.data() + i, g / (1.0f + exp_clamped(-g)) * load(row.data() + n + i));
      }
      for (; i < n; ++i) {
        vf g = {};
        g[0] = row[i];
        product[i] = row[i] / (1.0f + exp_clamped(-g)[0]) * row[n + i];
      }
      store_row(out, r, n, product.data());
    }
  });
  return out;
}

struct Slab {  // one K or V slab's data and strides [A, Hkv, C, D] (or transposed: [A, Hkv, D, C])
  char* data;
  int64_t row, head, position, dim;  // element strides
};

Slab slab_of(at::Tensor& t, bool transposed) {
  return {static_cast<char*>(t.data_ptr()), t.stride(0), t.stride(1), t.stride(transposed ? 3 : 2),
          t.stride(transposed ? 2 : 3)};
}

// head g of row r at position start: d values of x, as fp32 or rounded to bf16
template <typename T>
void put_head(const Slab& slab, int64_t r, int64_t g, int64_t start, int64_t d, const float* x) {
  T* p = reinterpret_cast<T*>(slab.data) + r * slab.row + g * slab.head + start * slab.position;
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t i = 0; i < d; ++i) p[i * slab.dim] = x[i];
  } else {
    for (int64_t i = 0; i < d; ++i) p[i * slab.dim] = to_bf16(x[i]);
  }
}

// the keys of positions first .. first + kW of head g of row r, copied from keys into keys_t
template <typename T>
void put_block(const Slab& keys, const Slab& keys_t, int64_t r, int64_t g, int64_t first, int64_t d) {
  const T* src = reinterpret_cast<const T*>(keys.data) + r * keys.row + g * keys.head + first * keys.position;
  T* dst = reinterpret_cast<T*>(keys_t.data) + r * keys_t.row + g * keys_t.head + first * keys_t.position;
  for (int64_t i = 0; i < d; ++i)
    for (int64_t j = 0; j < kW; ++j) dst[i * keys_t.dim + j * keys_t.position] = src[j * keys.position + i * keys.dim];
}

at::Tensor rotary_write(const at::Tensor& y, const c10::optional<at::Tensor>& bias, const at::Tensor& cos,
                        const at::Tensor& sin, const c10::optional<at::Tensor>& q_norm,
                        const c10::optional<at::Tensor>& k_norm, double eps, at::Tensor& key_slab,
                        at::Tensor& value_slab, c10::optional<at::Tensor> key_slab_t, int64_t start,
                        int64_t heads, int64_t kv_heads) {
  check_rows(y, "y");
  const int64_t a = y.size(0), d = cos.size(-1), half = d / 2;
  TORCH_CHECK(y.size(1) == (heads + 2 * kv_heads) * d, "rlkit::rotary_write: y's width is (H + 2 Hkv) D");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.numel() == a * d &&
                  sin.numel() == a * d && d % 2 == 0,
              "rlkit::rotary_write: fp32 cos/sin [A, 1, D], D even");
  TORCH_CHECK(key_slab.dim() == 4 && value_slab.dim() == 4 && key_slab.size(0) == a && value_slab.size(0) == a &&
                  key_slab.size(1) == kv_heads && key_slab.size(3) == d && start < key_slab.size(2) &&
                  start < value_slab.size(2) && key_slab.scalar_type() == value_slab.scalar_type() &&
                  (key_slab.scalar_type() == at::kFloat || key_slab.scalar_type() == at::kBFloat16),
              "rlkit::rotary_write: slabs [A, Hkv, C, D] of one dtype (fp32 or bf16) with room at start");
  const bool transposed = key_slab_t.has_value() && key_slab_t->defined();
  if (transposed)
    TORCH_CHECK(key_slab_t->scalar_type() == key_slab.scalar_type() && key_slab_t->size(0) == a &&
                    key_slab_t->size(2) == d && start < key_slab_t->size(3),
                "rlkit::rotary_write: key_slab_t [A, Hkv, D, C] in the slabs' dtype with room at start");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  const float* b = optional_data(bias);
  const float* qn = optional_data(q_norm);
  const float* kn = optional_data(k_norm);
  at::Tensor q = at::empty({a, heads, 1, d}, y.options().dtype(at::kFloat));
  const bool bf16_slabs = key_slab.scalar_type() == at::kBFloat16;
  const Slab keys = slab_of(key_slab, false), values = slab_of(value_slab, false);
  const Slab keys_t = transposed ? slab_of(*key_slab_t, true) : Slab{};
  const int64_t width = y.size(1);
  float* q_data = q.data_ptr<float>();
  const float* cos_data = c.data_ptr<float>();
  const float* sin_data = s.data_ptr<float>();
  at::parallel_for(0, a, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> row(width), normed(d), rotated(d);
    for (int64_t r = begin; r < end; ++r) {
      load_row(y, r, 0, width, b, row.data());
      const float* cr = cos_data + r * d;
      const float* sr = sin_data + r * d;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        float* x = row.data() + h * d;
        const float* norm = h < heads ? qn : kn;
        if (norm != nullptr) {
          rms_norm_into(x, norm, d, eps, normed.data());
          std::memcpy(x, normed.data(), d * sizeof(float));
        }
        for (int64_t i = 0; i < half; ++i) rotated[i] = x[i] * cr[i] + x[i + half] * sr[i];
        for (int64_t i = half; i < d; ++i) rotated[i] = x[i] * cr[i] + x[i - half] * sr[i];
        if (h < heads) {
          std::memcpy(q_data + (r * heads + h) * d, rotated.data(), d * sizeof(float));
        } else {
          const int64_t g = h - heads;
          const float* v = row.data() + (heads + kv_heads + g) * d;
          if (bf16_slabs) {
            put_head<uint16_t>(keys, r, g, start, d, rotated.data());
            put_head<uint16_t>(values, r, g, start, d, v);
          } else {
            put_head<float>(keys, r, g, start, d, rotated.data());
            put_head<float>(values, r, g, start, d, v);
          }
          if (transposed && (start + 1) % kW == 0) {  // a block of positions complete: into keys_t
            if (bf16_slabs) put_block<uint16_t>(keys, keys_t, r, g, start + 1 - kW, d);
            else put_block<float>(keys, keys_t, r, g, start + 1 - kW, d);
          }
        }
      }
    }
  });
  return q;
}

}  // namespace

TORCH_LIBRARY_IMPL(rlkit, CPU, m) {
  m.impl("rms_norm_cast", &rms_norm_cast);
  m.impl("add_rms_norm_cast", &add_rms_norm_cast);
  m.impl("silu_mul_cast", &silu_mul_cast);
  m.impl("rotary_write", &rotary_write);
}
