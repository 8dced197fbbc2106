// Row quantizers for writing a ModelOpt-quantized weight from the rows a rank holds
// (distributed_ext/export/plan/quantized.py). ModelOpt's own arithmetic is a chain of torch
// ops over float32 temporaries: several passes over the rows and four to eight bytes of
// temporaries per weight byte. These do the same arithmetic in one pass per row, into the
// final bytes, and must give the same bytes: the Python side checks them against ModelOpt's
// own functions before using them (once per process and dtype), and falls back to ModelOpt's
// where they differ.
#include "quantize.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <pybind11/pybind11.h>
#include <torch/extension.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace distributed_ext {

namespace {

// The checks of a 65536-byte table and the output of map_through_table and fp8_divide (one
// byte per element of src): ``into`` where given, else a new uint8 tensor of src's shape.
at::Tensor table_output(const char* what, const at::Tensor& src, const at::Tensor& table,
                        const c10::optional<at::Tensor>& into) {
  TORCH_CHECK_VALUE(table.device().is_cpu() && table.is_contiguous() &&
                  table.scalar_type() == at::kByte && table.numel() == 65536,
              what, ": table must be a contiguous CPU uint8 tensor of 65536 values");
  if (!into.has_value()) return at::empty(src.sizes(), src.options().dtype(at::kByte));
  const at::Tensor& out = *into;
  TORCH_CHECK_VALUE(out.device().is_cpu() && out.is_contiguous() && out.element_size() == 1 &&
                        out.numel() == src.numel(),
                    what, ": into must be a contiguous 1-byte CPU tensor of ", src.numel(),
                    " elements (src's), got ", out.dtype(), " of ", out.numel());
  return out;
}

}  // namespace

at::Tensor map_through_table(const at::Tensor& src, const at::Tensor& table,
                             const c10::optional<at::Tensor>& into) {
  TORCH_CHECK_VALUE(src.device().is_cpu() && src.is_contiguous() && src.element_size() == 2,
              "map_through_table: src must be a contiguous CPU tensor of a 2-byte dtype, got ",
              src.dtype(), " on ", src.device());
  at::Tensor out = table_output("map_through_table", src, table, into);
  const uint16_t* in = static_cast<const uint16_t*>(src.data_ptr());
  const uint8_t* lut = table.data_ptr<uint8_t>();
  uint8_t* dst = static_cast<uint8_t*>(out.data_ptr());
  const int64_t n = src.numel();
  {
    pybind11::gil_scoped_release no_gil;
    at::parallel_for(0, n, int64_t{1} << 16, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) dst[i] = lut[in[i]];
    });
  }
  return out;
}

namespace {

// E2M1 (FP4) code of a float32 value as ModelOpt's NVFP4QTensor._cast_fp4 computes it: the
// sign of (v < 0), the count of bounds b with !(b >= |v|) (torch.searchsorted's lower bound:
// NaN counts all seven), plus one at the ties 0.75, 1.75 and 3.5 (round half to even).
// Branch-free, so that the compiler vectorizes the loop over a row.
inline uint8_t fp4_code(float v) {
  const float a = std::fabs(v);
  const int ord = !(0.25f >= a) + !(0.75f >= a) + !(1.25f >= a) + !(1.75f >= a) +
                  !(2.5f >= a) + !(3.5f >= a) + !(5.0f >= a);
  const int tie = (a == 0.75f) + (a == 1.75f) + (a == 3.5f);
  return static_cast<uint8_t>(((v < 0.0f) << 3) + ord + tie);
}

inline float to_float(c10::BFloat16 x) {  // (exact: the upper half of a float32)
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(float x) { return x; }

// Every E4M3 byte's float32 value (c10's conversion, tabulated once): the block scale's
// value back in float32 without the conversion's branches, once per block.
const float* e4m3_values() {
  static const std::vector<float> values = [] {
    std::vector<float> v(256);
    for (int i = 0; i < 256; ++i) {
      v[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i),
                                                   c10::Float8_e4m3fn::from_bits()));
    }
    return v;
  }();
  return values.data();
}

// One row (in float32) of NVFP4: each block's amax, then the E4M3 scales and divisors of
// the row's blocks as one loop (the divisor spread over the block's columns), then the codes
// of the whole row as one loop and their packing, each a loop the compiler vectorizes -- the
// codes' loop over the row rather than a block, at the full vector width, and each block's
// scale back in float32 by table
// (measured, bf16 rows of 4096, one thread: 1.26-1.53 GiB/s; 0.89-1.23 converting the scale
// back per block; 0.67-0.79 with a loop per block as well). ``B``: the block size where it
// is known when compiling (16: NVFP4's), else 0 (``block`` then). IEEE division and
// comparisons give the same results at any vector width. The block amax is an integer max of
// the values' magnitude bits (|x| orders as its bits; a NaN's bits exceed infinity's, so a
// NaN propagates, as in torch's amax). Scratch: div, code and mag [cols], top and dq
// [cols / block]. ``CODES`` false:
// the block scales alone (``packed``, ``div`` and ``code`` unused): what the scales' tensor
// is written from where the weight's rows were not computed first.
template <int64_t B, bool CODES = true>
inline __attribute__((always_inline)) void nvfp4_row_impl(
    const float* xf, int64_t cols, int64_t block_rt, float scale_2, uint8_t* packed,
    uint8_t* scales, float* div, uint8_t* code, uint32_t* mag, uint32_t* top, float* dq) {
  const int64_t block = B ? B : block_rt;
  const int64_t blocks = cols / block;
  // E2M1_MAX * weights_scaling_factor_2, a float32 product.
  const float divisor = 6.0f * scale_2;
  const float* e4m3 = e4m3_values();
  for (int64_t j = 0; j < cols; ++j) {
    uint32_t bits;
    std::memcpy(&bits, xf + j, sizeof bits);
    mag[j] = bits & 0x7FFFFFFFu;
  }
  for (int64_t k = 0; k < blocks; ++k) {
    const uint32_t* m = mag + k * block;
    uint32_t t = 0;
    for (int64_t j = 0; j < block; ++j) t = std::max(t, m[j]);
    top[k] = t;
  }
  // Each block's scale, as a loop over the row's blocks (not a block at a time).
  for (int64_t k = 0; k < blocks; ++k) {
    float amax;
    std::memcpy(&amax, top + k, sizeof amax);
    amax = top[k] > 0x7F800000u ? std::numeric_limits<float>::quiet_NaN() : amax;
    float scale = amax / divisor;
    scale = scale == 0.0f ? 1.0f : scale;
    // torch.clamp(scale, 2**-9, 448): a NaN stays NaN
    scale = scale < 0.001953125f ? 0.001953125f : scale;
    scale = 448.0f < scale ? 448.0f : scale;
    const uint8_t fp8 = c10::detail::fp8e4m3fn_from_fp32_value(scale);
    scales[k] = fp8;
    // weights_scaling_factor.to(float32) * weights_scaling_factor_2: float32.
    if (CODES) dq[k] = e4m3[fp8] * scale_2;
  }
  if (!CODES) return;
  for (int64_t k = 0; k < blocks; ++k) {
    float* dk = div + k * block;
    for (int64_t j = 0; j < block; ++j) dk[j] = dq[k];
  }
  for (int64_t j = 0; j < cols; ++j) code[j] = fp4_code(xf[j] / div[j]);
  for (int64_t j = 0; j < cols / 2; ++j) {
    packed[j] = static_cast<uint8_t>((code[2 * j + 1] << 4) | code[2 * j]);
  }
}

// Compiled for AVX2 as well where the compiler can (picked at load time by the CPU).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DEXT_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DEXT_CLONES
#endif

// NVFP4's block (16), by far the most rows: where the CPU has AVX-512, also compiled for
// 512-bit vectors, which the compiler otherwise leaves at 256 (bf16 rows of 4096, one
// thread: 1.52-1.63 GiB/s against 1.03-1.22 before, three runs of each build alternating).
DEXT_CLONES
void nvfp4_row16_any(const float* xf, int64_t cols, float scale_2, uint8_t* packed,
                     uint8_t* scales, float* div, uint8_t* code, uint32_t* mag, uint32_t* top,
                     float* dq) {
  nvfp4_row_impl<16>(xf, cols, 16, scale_2, packed, scales, div, code, mag, top, dq);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 8
#define DEXT_AVX512 1
__attribute__((target("avx2,avx512f,avx512bw,avx512vl,avx512dq,prefer-vector-width=512")))
void nvfp4_row16_avx512(const float* xf, int64_t cols, float scale_2, uint8_t* packed,
                        uint8_t* scales, float* div, uint8_t* code, uint32_t* mag,
                        uint32_t* top, float* dq) {
  nvfp4_row_impl<16>(xf, cols, 16, scale_2, packed, scales, div, code, mag, top, dq);
}
#endif

#ifdef DEXT_AVX512
// Whether the 512-bit clones may run: asked of the CPU once a process.
bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq");
  return yes;
}
#endif

void nvfp4_row16(const float* xf, int64_t cols, float scale_2, uint8_t* packed,
                 uint8_t* scales, float* div, uint8_t* code, uint32_t* mag, uint32_t* top,
                 float* dq) {
#ifdef DEXT_AVX512
  if (has_avx512()) {
    nvfp4_row16_avx512(xf, cols, scale_2, packed, scales, div, code, mag, top, dq);
    return;
  }
#endif
  nvfp4_row16_any(xf, cols, scale_2, packed, scales, div, code, mag, top, dq);
}

DEXT_CLONES
void nvfp4_row(const float* xf, int64_t cols, int64_t block, float scale_2, uint8_t* packed,
               uint8_t* scales, float* div, uint8_t* code, uint32_t* mag, uint32_t* top,
               float* dq) {
  nvfp4_row_impl<0>(xf, cols, block, scale_2, packed, scales, div, code, mag, top, dq);
}

DEXT_CLONES
void nvfp4_scales_row(const float* xf, int64_t cols, int64_t block, float scale_2,
                      uint8_t* scales, uint32_t* mag, uint32_t* top) {
  nvfp4_row_impl<0, false>(xf, cols, block, scale_2, nullptr, scales, nullptr, nullptr, mag,
                           top, nullptr);
}

// A block with a NaN gets a NaN scale (0x7F) and every code 7, as in ModelOpt's, whose own
// NaN's sign bit varies with how many rows torch computes at once (vector or scalar code).
// ``packed`` null: the block scales alone.
template <typename T>
void nvfp4_rows_typed(const T* src, int64_t rows, int64_t cols, float scale_2, int64_t block,
                      uint8_t* packed, uint8_t* scales) {
  const int64_t blocks = cols / block;
  const bool codes = packed != nullptr;
  at::parallel_for(0, rows, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> xf(cols), div(codes ? cols : 0);
    std::vector<uint8_t> code(codes ? cols : 0);
    std::vector<uint32_t> mag(cols), top(blocks);
    std::vector<float> dq(codes ? blocks : 0);
    for (int64_t r = lo; r < hi; ++r) {
      const T* x = src + r * cols;
      for (int64_t j = 0; j < cols; ++j) xf[j] = to_float(x[j]);
      uint8_t* s = scales + r * blocks;
      if (!codes) {
        nvfp4_scales_row(xf.data(), cols, block, scale_2, s, mag.data(), top.data());
        continue;
      }
      uint8_t* p = packed + r * (cols / 2);
      if (block == 16) {
        nvfp4_row16(xf.data(), cols, scale_2, p, s, div.data(), code.data(), mag.data(),
                    top.data(), dq.data());
      } else {
        nvfp4_row(xf.data(), cols, block, scale_2, p, s, div.data(), code.data(), mag.data(),
                  top.data(), dq.data());
      }
    }
  });
}

}  // namespace

namespace {

// The checks and the dispatch by dtype of nvfp4_rows and nvfp4_scales (``packed`` undefined:
// the scales alone).
void run_nvfp4(const char* what, const at::Tensor& src, double scale_2, int64_t block,
               at::Tensor* packed, at::Tensor& scales) {
  TORCH_CHECK_VALUE(src.device().is_cpu() && src.is_contiguous() && src.dim() == 2, what,
              ": src must be a contiguous 2-D CPU tensor, got ", src.dim(), "-D on ",
              src.device());
  TORCH_CHECK_VALUE(block > 0 && block % 2 == 0 && src.size(1) % block == 0, what,
              ": block must be even and divide the columns (", src.size(1), "), got ", block);
  const auto dtype = src.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat, what,
              ": src must be bfloat16, float16 or float32, got ", src.dtype());
  const int64_t rows = src.size(0), cols = src.size(1);
  if (packed != nullptr) *packed = at::empty({rows, cols / 2}, src.options().dtype(at::kByte));
  scales = at::empty({rows, cols / block}, src.options().dtype(at::kByte));
  const float s2 = static_cast<float>(scale_2);
  uint8_t* p = packed != nullptr ? packed->data_ptr<uint8_t>() : nullptr;
  uint8_t* s = scales.data_ptr<uint8_t>();
  pybind11::gil_scoped_release no_gil;
  if (dtype == at::kBFloat16) {
    nvfp4_rows_typed(static_cast<const c10::BFloat16*>(src.data_ptr()), rows, cols, s2, block,
                     p, s);
  } else if (dtype == at::kHalf) {
    nvfp4_rows_typed(static_cast<const c10::Half*>(src.data_ptr()), rows, cols, s2, block, p,
                     s);
  } else {
    nvfp4_rows_typed(src.data_ptr<float>(), rows, cols, s2, block, p, s);
  }
}

}  // namespace

namespace {

// One INT4 code per value of a group (``n`` values, one scale): x / scale in float32 (IEEE
// division, as torch's), rounded as torch.round does (``nearbyint``: in the current rounding
// mode, half to even by default; ``rint`` here, which the compiler vectorizes where it does
// not ``roundeven``), clamped to [-8, 7]
// (torch.clamp; a NaN stays NaN, and its int8 cast is 0 here, as torch's on this CPU:
// tests/test_row_kernels.py compares every bf16/fp16 value, NaNs included). The clamp of
// the whole number q is -8 plus the count of the half-integers -7.5 .. 6.5 it reaches, and a
// NaN (which reaches none) gets 8 more: comparisons summed as integers, which the compiler
// vectorizes, where it keeps a select of floats as branches (bf16 rows of 4096 x 4096, one
// thread: 1.40-1.46 GiB/s; 0.73-0.96 with roundeven and the selects, scalar).
inline void int4_codes(const float* x, int64_t n, float scale, int8_t* code) {
  for (int64_t j = 0; j < n; ++j) {
    const float q = __builtin_rintf(x[j] / scale);
    int c = -8 + 8 * (q != q);
    for (int b = 0; b < 15; ++b) c += q >= static_cast<float>(b) - 7.5f;
    code[j] = static_cast<int8_t>(c);
  }
}

DEXT_CLONES
void int4_pair(const float* x0, const float* x1, const float* s0, const float* s1,
               int64_t cols, int64_t block, uint8_t* out, int8_t* c0, int8_t* c1) {
  for (int64_t g = 0; g < cols / block; ++g) {
    int4_codes(x0 + g * block, block, s0[g], c0 + g * block);
    int4_codes(x1 + g * block, block, s1[g], c1 + g * block);
  }
  for (int64_t j = 0; j < cols; ++j) {
    out[j] = static_cast<uint8_t>((c0[j] & 0x0F) | ((c1[j] & 0x0F) << 4));
  }
}

template <typename T>
void int4_rows_typed(const T* src, const float* scale, int64_t rows, int64_t cols,
                     int64_t block, uint8_t* out) {
  const int64_t groups = cols / block;
  at::parallel_for(0, rows / 2, 8, [&](int64_t lo, int64_t hi) {
    std::vector<float> x0(cols), x1(cols);
    std::vector<int8_t> c0(cols), c1(cols);
    for (int64_t p = lo; p < hi; ++p) {
      const T* a = src + (2 * p) * cols;
      const T* b = a + cols;
      for (int64_t j = 0; j < cols; ++j) {
        x0[j] = to_float(a[j]);
        x1[j] = to_float(b[j]);
      }
      int4_pair(x0.data(), x1.data(), scale + (2 * p) * groups, scale + (2 * p + 1) * groups,
                cols, block, out + p * cols, c0.data(), c1.data());
    }
  });
}

}  // namespace

at::Tensor int4_rows(const at::Tensor& src, const at::Tensor& scale, int64_t block) {
  TORCH_CHECK_VALUE(src.device().is_cpu() && src.is_contiguous() && src.dim() == 2,
              "int4_rows: src must be a contiguous 2-D CPU tensor, got ", src.dim(), "-D on ",
              src.device());
  const auto dtype = src.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
              "int4_rows: src must be bfloat16, float16 or float32, got ", src.dtype());
  const int64_t rows = src.size(0), cols = src.size(1);
  TORCH_CHECK_VALUE(rows % 2 == 0, "int4_rows: src must have an even number of rows (they "
              "are packed in pairs), got ", rows);
  TORCH_CHECK_VALUE(block > 0 && cols % block == 0, "int4_rows: block must divide the "
              "columns (", cols, "), got ", block);
  TORCH_CHECK_VALUE(scale.device().is_cpu() && scale.is_contiguous() &&
              scale.scalar_type() == at::kFloat && scale.dim() == 2 &&
              scale.size(0) == rows && scale.size(1) == cols / block,
              "int4_rows: scale must be a contiguous float32 CPU tensor of shape [", rows,
              ", ", cols / block, "], got ", scale.dtype(), " ", scale.sizes());
  at::Tensor out = at::empty({rows / 2, cols}, src.options().dtype(at::kByte));
  const float* s = scale.data_ptr<float>();
  uint8_t* o = out.data_ptr<uint8_t>();
  pybind11::gil_scoped_release no_gil;
  if (dtype == at::kBFloat16) {
    int4_rows_typed(static_cast<const c10::BFloat16*>(src.data_ptr()), s, rows, cols, block, o);
  } else if (dtype == at::kHalf) {
    int4_rows_typed(static_cast<const c10::Half*>(src.data_ptr()), s, rows, cols, block, o);
  } else {
    int4_rows_typed(src.data_ptr<float>(), s, rows, cols, block, o);
  }
  return out;
}

namespace {

// One bfloat16 value's FP8 byte as torch computes ``(w / scale).to(float8_e4m3fn)`` for a
// bfloat16 tensor ``w`` and a float32 scale: the value in float32 (exact), divided (IEEE,
// as torch's kernel for a scalar divisor), the quotient rounded to bfloat16 half to even
// (``bf16_quotient``: the result's dtype where the scale is a 0-dim tensor; else it stays
// float32), then c10's fp8e4m3fn_from_fp32_value restated without branches, so that the
// loop over a block vectorizes -- except that a value that rounds past E4M3's range
// saturates to its largest (448), as torch 2.13's cast does on this CPU, where c10's gives
// a NaN. Wrong for an infinite or NaN ``w`` (the caller's table gives those); checked
// once per process, on every finite bfloat16 value and the infinities, against ModelOpt's
// export before use (plan/row_kernels.py); tests/test_row_kernels.py compares it on every
// bfloat16 value for 206 scales.
template <bool BF16_QUOTIENT>
inline uint8_t fp8_of_quotient(uint16_t w, float scale) {
  const uint32_t wb = static_cast<uint32_t>(w) << 16;
  float x;
  std::memcpy(&x, &wb, sizeof x);
  const float q = x / scale;
  uint32_t u;
  std::memcpy(&u, &q, sizeof u);
  if (BF16_QUOTIENT) u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  const uint32_t sign = u & 0x80000000u;
  const uint32_t a = u ^ sign;
  // a normal E4M3: the exponent rebiased, rounded half to even at mantissa bit 20
  const uint32_t normal =
      (a + (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  // a subnormal one: the float32 addition of 2^-6's magic number does the rounding
  const uint32_t magic = 141u << 23;
  float af, mf;
  std::memcpy(&af, &a, sizeof af);
  std::memcpy(&mf, &magic, sizeof mf);
  const float sum = af + mf;
  uint32_t sb;
  std::memcpy(&sb, &sum, sizeof sb);
  const uint32_t subnormal = sb - magic;
  const uint32_t rounded = a < (121u << 23) ? subnormal : normal;
  // what rounds past E4M3's range: its largest finite value (torch saturates); a NaN stays
  // (c10's test of a >= 480 is the same as rounded > 0x7E, 480's code being 0x7F)
  const uint32_t finite = std::min(rounded, 0x7Eu);
  const uint32_t code = a > 0x7F800000u ? 0x7Fu : finite;
  return static_cast<uint8_t>(code | (sign >> 24));
}

// One block of fp8_divide: the quotients' bytes, then any infinite or NaN input's byte from
// the table (rare: a pass of its own only where the block has one).
template <bool BF16_QUOTIENT>
inline __attribute__((always_inline)) void fp8_divide_impl(const uint16_t* in, int64_t n,
                                                           float scale, const uint8_t* lut,
                                                           uint8_t* out) {
  uint32_t special = 0;
  for (int64_t i = 0; i < n; ++i) {
    out[i] = fp8_of_quotient<BF16_QUOTIENT>(in[i], scale);
    special |= static_cast<uint32_t>((in[i] & 0x7F80u) == 0x7F80u);
  }
  if (special) {
    for (int64_t i = 0; i < n; ++i) {
      if ((in[i] & 0x7F80u) == 0x7F80u) out[i] = lut[in[i]];
    }
  }
}

inline __attribute__((always_inline)) void fp8_divide_either(
    const uint16_t* in, int64_t n, float scale, bool bf16_quotient, const uint8_t* lut,
    uint8_t* out) {
  if (bf16_quotient) {
    fp8_divide_impl<true>(in, n, scale, lut, out);
  } else {
    fp8_divide_impl<false>(in, n, scale, lut, out);
  }
}

// (the same loop compiled for each target, as nvfp4_row16's)
DEXT_CLONES
void fp8_divide_block(const uint16_t* in, int64_t n, float scale, bool bf16_quotient,
                      const uint8_t* lut, uint8_t* out) {
  fp8_divide_either(in, n, scale, bf16_quotient, lut, out);
}

#ifdef DEXT_AVX512
__attribute__((target("avx2,avx512f,avx512bw,avx512vl,avx512dq,prefer-vector-width=512")))
void fp8_divide_block_avx512(const uint16_t* in, int64_t n, float scale, bool bf16_quotient,
                             const uint8_t* lut, uint8_t* out) {
  fp8_divide_either(in, n, scale, bf16_quotient, lut, out);
}
#endif

}  // namespace

at::Tensor fp8_divide(const at::Tensor& src, double scale, bool bf16_quotient,
                      const at::Tensor& table, const c10::optional<at::Tensor>& into) {
  TORCH_CHECK_VALUE(src.device().is_cpu() && src.is_contiguous() &&
                  src.scalar_type() == at::kBFloat16,
              "fp8_divide: src must be a contiguous bfloat16 CPU tensor, got ", src.dtype(),
              " on ", src.device());
  at::Tensor out = table_output("fp8_divide", src, table, into);
  const uint16_t* in = static_cast<const uint16_t*>(src.data_ptr());
  const uint8_t* lut = table.data_ptr<uint8_t>();
  uint8_t* dst = static_cast<uint8_t*>(out.data_ptr());
  const float s = static_cast<float>(scale);
  const int64_t n = src.numel();
#ifdef DEXT_AVX512
  const bool avx512 = has_avx512();
#endif
  {
    pybind11::gil_scoped_release no_gil;
    at::parallel_for(0, n, int64_t{1} << 16, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; b += 4096) {
        const int64_t m = std::min<int64_t>(4096, hi - b);
#ifdef DEXT_AVX512
        if (avx512) {
          fp8_divide_block_avx512(in + b, m, s, bf16_quotient, lut, dst + b);
          continue;
        }
#endif
        fp8_divide_block(in + b, m, s, bf16_quotient, lut, dst + b);
      }
    });
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> nvfp4_rows(const at::Tensor& src, double scale_2,
                                              int64_t block) {
  at::Tensor packed, scales;
  run_nvfp4("nvfp4_rows", src, scale_2, block, &packed, scales);
  return {packed, scales};
}

at::Tensor nvfp4_scales(const at::Tensor& src, double scale_2, int64_t block) {
  at::Tensor scales;
  run_nvfp4("nvfp4_scales", src, scale_2, block, nullptr, scales);
  return scales;
}

}  // namespace distributed_ext
