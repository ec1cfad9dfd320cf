// Which decode GEMV (1 to 8 tokens) runs BF16 weight matrices on CUDA: a backend option
// (BackendOptions::cuda_decode_gemv) and the MatMul kernels' argument (cuda::MatMulParams), so
// this header stays free of both.
#pragma once

namespace nq::kernels {

// kAuto takes the tensor cores where they pay for the matrix (kernels/cuda/matmul_params.h,
// MmaGemvPays); the others force one kernel for every matrix, for tests and measurements of one
// against the other, and as an operator's way around one.
enum class DecodeGemv {
  kAuto,
  kFp32Fma,      // MatMulGemvKernel, kernels/cuda/matmul_gemv.cuh
  kTensorCores,  // MatMulGemvMmaKernel, kernels/cuda/matmul_gemv_mma.cuh
};

}  // namespace nq::kernels
