// Hopper's warpgroup matrix multiply (wgmma.mma_async, sm_90a) with bf16 operands in shared
// memory and fp32 accumulators: the shared-memory matrix descriptor, the ordering fences, and the
// m64n64k16 shape, the pieces an MLA decode kernel with 64 query rows a block (FlashMLA's layout)
// would be built from. tests/kernels/cuda/wgmma_probe_test.cu checks them against the CPU on the
// two operand layouts such a kernel uses: K-major A and B (scores = Q K^T) and a K-major A with an
// N-major B (O = P V, V stored a key a row).
//
// Layouts (PTX ISA, "Matrix Descriptor Format" and the canonical layouts of wgmma's shared-memory
// operands), 128-byte swizzle: a tile row is 128 bytes (64 bf16); 16-byte chunk c of row r is
// stored at chunk c ^ (r % 8), in atoms of 8 rows (1024 bytes, 1024-byte aligned). A K-major
// operand's rows are its M (or N) index with K along the row: the stride-dimension offset is the
// 1024 bytes between 8-row atoms, and each k-step of 16 moves the start address 32 bytes along the
// row. An N-major B's rows are its K index with N along the row (64 N a tile): 16 k are two atoms,
// 1024 bytes apart (the stride-dimension offset), and each k-step moves the start 2048 bytes.
#pragma once

#include <cstdint>

namespace nq::kernels::cuda::wgmma {

enum class Swizzle : std::uint64_t { kNone = 0, k128B = 1, k64B = 2, k32B = 3 };

// The 64-bit descriptor of a shared-memory operand: start address, leading- and stride-dimension
// byte offsets (each in 16-byte units, 14 bits), swizzle mode in the top two bits. The base offset
// (bits 49-51) stays 0: tiles start 1024-byte aligned.
__device__ __forceinline__ std::uint64_t Descriptor(const void* smem, std::uint32_t leading_bytes,
                                                    std::uint32_t stride_bytes, Swizzle swizzle) {
  const auto address = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
  std::uint64_t d = (address & 0x3FFFFu) >> 4;
  d |= std::uint64_t{(leading_bytes & 0x3FFFFu) >> 4} << 16;
  d |= std::uint64_t{(stride_bytes & 0x3FFFFu) >> 4} << 32;
  d |= static_cast<std::uint64_t>(swizzle) << 62;
  return d;
}

// Before the first wgmma that reads registers written by other instructions (the accumulators).
__device__ __forceinline__ void Fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
// Shared memory written by ordinary stores, made visible to wgmma's operand reads.
__device__ __forceinline__ void FenceSharedWrites() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void Commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void Wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// D[64 x 64] = A[64 x 16] B[16 x 64] (+ D when accumulate), one warpgroup. kTransposeB: B is
// N-major (its rows are k); otherwise both are K-major. d: thread t of the warpgroup holds rows
// 16 (t / 32) + (t % 32) / 4 and + 8, columns 8 j + 2 (t % 4) and + 1 for j < 8, as
// d[4 j .. 4 j + 3] = (row, col), (row, col + 1), (row + 8, col), (row + 8, col + 1).
template <bool kTransposeB>
__device__ __forceinline__ void Mma64x64x16(float (&d)[32], std::uint64_t a, std::uint64_t b, bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, %35;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)), "n"(kTransposeB ? 1 : 0));
}

}  // namespace nq::kernels::cuda::wgmma
