#pragma once
#include <ATen/ATen.h>

#include <tuple>

namespace distributed_ext {

// out[i] = table[bits of src[i]]: an elementwise function of a 2-byte value, tabulated over
// all 65536 of them (table: uint8 [65536]). src: a contiguous CPU tensor of a 2-byte dtype;
// out: ``into`` where given (a contiguous 1-byte CPU tensor of src's numel: the bytes where
// the caller writes them from), else a new uint8 tensor of src's shape. GIL released.
at::Tensor map_through_table(const at::Tensor& src, const at::Tensor& table,
                             const c10::optional<at::Tensor>& into);

// FP8 (E4M3) bytes of a bfloat16 tensor divided by a float32 ``scale`` as torch computes
// ``(src / scale).to(float8_e4m3fn)`` -- the quotient rounded to bfloat16 first where
// ``bf16_quotient`` (a 0-dim scale's), else kept in float32 --, with each infinite or NaN
// value's byte taken from ``table`` (as map_through_table). Arithmetic, not a lookup: 2.87 G
// values/s a thread where map_through_table gives 1.81-2.42 (its rate moves with the build's
// code layout); checked against ModelOpt's bytes before use (plan/row_kernels.py). ``into``
// as there. GIL released.
at::Tensor fp8_divide(const at::Tensor& src, double scale, bool bf16_quotient,
                      const at::Tensor& table, const c10::optional<at::Tensor>& into);

// NVFP4 of the rows of src (contiguous CPU [rows, cols], bfloat16, float16 or float32; cols a
// multiple of block, block even), with the global scale scale_2 (a float32 value): the packed
// 4-bit codes (uint8 [rows, cols / 2], the even column in the low nibble) and each block's
// E4M3 scale (uint8 [rows, cols / block]). A block with a NaN: a NaN scale (0x7F), codes 7.
// The arithmetic is ModelOpt 0.47's NVFP4QTensor (get_weights_scaling_factor, then quantize)
// as torch evaluates it on the CPU, operation by operation in float32;
// tests/test_row_kernels.py compares it with ModelOpt's on every bfloat16 and float16
// value. GIL released.
std::tuple<at::Tensor, at::Tensor> nvfp4_rows(const at::Tensor& src, double scale_2,
                                              int64_t block);

// The block scales of nvfp4_rows alone (the same bytes; no codes computed): for a scales
// tensor written before its weight's rows are computed. GIL released.
at::Tensor nvfp4_scales(const at::Tensor& src, double scale_2, int64_t block);

// INT4 AWQ of the rows of src (contiguous CPU [rows, cols], bfloat16, float16 or float32;
// rows even, cols a multiple of block) with the per-group scales ``scale`` (contiguous
// float32 [rows, cols / block]): each value's code is round-half-even(x / its group's
// scale) clamped to [-8, 7] (a NaN: 0), and each pair of rows 2i, 2i + 1 is packed into row
// i of the output (uint8 [rows / 2, cols]): row 2i's code in the low nibble. ModelOpt
// 0.47's pack_int4_in_uint8 as torch evaluates it on the CPU (the division in float32);
// checked against it before use (plan/row_kernels.py). GIL released.
at::Tensor int4_rows(const at::Tensor& src, const at::Tensor& scale, int64_t block);

}  // namespace distributed_ext
