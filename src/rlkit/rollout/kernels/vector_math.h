// The vector types and the few vector and scalar helpers rlkit's decode kernel files share (decode_attention.cpp,
// decode_glue.cpp, sampling.cpp), written with GCC's vector extensions so one source compiles to AVX-512 or
// AVX2 code.
// RLKIT_VEC is the floats per vector register the build targets: 16 (AVX-512) or 8 (AVX2); rlkit.rollout.
// cpu_kernels passes it, and hashes this file with the sources into the library's name.
#pragma once

#include <cstdint>
#include <cstring>

#ifndef RLKIT_VEC
#define RLKIT_VEC 16
#endif

namespace rlkit_vec {

constexpr int kW = RLKIT_VEC;
typedef float vf __attribute__((vector_size(kW * 4)));
typedef int32_t vi __attribute__((vector_size(kW * 4)));
typedef uint32_t vu __attribute__((vector_size(kW * 4)));
typedef uint16_t vh __attribute__((vector_size(kW * 2)));
typedef char vc __attribute__((vector_size(kW)));

inline vf load(const float* p) {
  vf x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline vf load(const uint16_t* p) {  // kW bf16 values widened to fp32 (exact: bf16 is fp32's top half)
  vh h;
  std::memcpy(&h, p, sizeof(h));
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline void store(float* p, vf x) { std::memcpy(p, &x, sizeof(x)); }

inline float sum_lanes(vf x) {  // the lanes added in order, 0 first
  float total = 0.0f;
  for (int c = 0; c < kW; ++c) total += x[c];
  return total;
}

inline float widen(float x) { return x; }

inline float widen(uint16_t b) {  // one bf16 value as fp32 (exact: bf16 is fp32's top half)
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t to_bf16(float f) {  // round to nearest even, NaN kept quiet: c10::BFloat16's conversion
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline void store_bf16(uint16_t* p, vf f) {
  vu u;
  std::memcpy(&u, &f, sizeof(u));
  const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vu nan = (u & 0x7fffffffu) > 0x7f800000u;  // all ones where NaN
  const vu kept = (rounded & ~nan) | (0x7fc0u & nan);
  const vh h = __builtin_convertvector(kept, vh);
  std::memcpy(p, &h, sizeof(h));
}

inline vf exp_clamped(vf x) {  // Cephes' expf over [-87, 88] (inputs clamped to it), 2^n from the exponent bits
  x = x < -87.0f ? (vf){} - 87.0f : x;
  x = x > 88.0f ? (vf){} + 88.0f : x;
  const vf fx = x * 1.44269504088896341f + 0.5f;
  const vi truncated = __builtin_convertvector(fx, vi);
  const vi n = __builtin_convertvector(truncated, vf) > fx ? truncated - 1 : truncated;  // floor
  const vf nf = __builtin_convertvector(n, vf);
  const vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vf y = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
          1.6666665459e-1f) * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  vf pow2;
  const vi bits = (n + 127) << 23;
  std::memcpy(&pow2, &bits, sizeof(pow2));
  return y * pow2;
}

}  // namespace rlkit_vec
