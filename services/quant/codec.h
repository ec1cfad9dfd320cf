// The codec interface (DESIGN.md section 6, issue #5): a weight matrix (with an optional
// Hessian) is encoded into a base plane (2 bits/weight), a residual plane (2 more bits) and
// scales; it decodes to the 2-bit or the 4-bit weight. Nested property: the base plane's
// bytes are identical whether or not a residual is kept, so the format layer can put the
// base in resident files and the residual in streamed records, and decode 2-bit from the
// base alone.
//
// Codecs live behind one interface and are found by name (MakeCodec): "nested_scalar_v1"
// (nested_scalar_codec.h) and "trellis_v1", the bitshift-trellis codec (trellis_codec.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "services/quant/hadamard.h"
#include "services/quant/nested_codebook.h"
#include "services/quant/ldlq.h"

namespace nq::quant {

enum class Precision { k2Bit, k4Bit };

class TrellisTileSearch;  // trellis_search.h

struct EncodeOptions {
  // Blend of the base's fitting target: lambda * (2-bit error) + (1 - lambda) * (4-bit error).
  double lambda = 0.5;
  // nested_scalar_v1: base levels on an even grid (the fast GPU 2-bit decode, nested_codebook.h's
  // BaseGrid), free (Lloyd), or all sixteen 4-bit levels on the even grid nested in the base's
  // (the fast GPU 4-bit decode too). Every grid decodes everywhere; only the GPU's speed and the
  // 4-bit error differ.
  BaseGrid base_grid = BaseGrid::kUniform;
  // Whether the residual plane is produced. The base plane does not depend on it.
  bool keep_residual = true;
  // Two-sided rotation: 128-wide blocks by default; a layer may widen col_block (e.g. 512
  // on down_proj) and must record it (and the seeds) in the manifest.
  RotationParams rotation;
  // LDLQ damping, relative to the Hessian's mean diagonal (GPTQ's percdamp).
  double damping = 0.01;
  // Alternating row / column RMS passes that fold the scales (2 is enough for near-rank-1
  // scale structure; each pass is one sweep of the matrix).
  int scale_passes = 2;
  // Lloyd refits of the codebook to this matrix's own targets (each one more quantisation
  // pass). 0 keeps the Gaussian design, a pure function of lambda (DefaultParams). With
  // refits the codebook differs per matrix and the release must store CodecParams'
  // base_codebook / residual_codebook (20 floats) beside the scales. Under LDLQ the targets
  // drift from N(0,1) and one refit recovers part of it (i.i.d. Gaussian W, correlated X,
  // 256 x 256: relative output error 0.166 -> 0.161 at 2 bits, 0.084 -> 0.077 at 4 bits);
  // without a Hessian it gains nothing measurable.
  int codebook_refinements = 0;
  // trellis_v1: where its tiles are searched (not owned; null: one CPU thread). The bytes are
  // the same wherever they are searched.
  TrellisTileSearch* trellis_search = nullptr;
  // trellis_v1: threads for LDLQ's feedback between column blocks, split by rows (each row's
  // arithmetic is unchanged, so the bytes do not depend on it); 1 keeps it on the calling thread.
  int host_threads = 1;
};

// Everything needed to decode, apart from the planes and scales.
struct CodecParams {
  std::string codec;  // registry name, e.g. "nested_scalar_v1"
  int base_bits = 2;
  int residual_bits = 2;
  RotationParams rotation;
  double lambda = 0.5;
  // Codebooks in the rotated, scaled domain. For nested_scalar_v1: 4 base levels and 16
  // residual offsets (residual_codebook[b * 4 + r] is added to base_codebook[b]). For
  // trellis_v1: the base and residual gains of each 16-column block (cols / 16 each).
  std::vector<float> base_codebook;
  std::vector<float> residual_codebook;
};

struct EncodedMatrix {
  int64_t rows = 0;
  int64_t cols = 0;
  CodecParams params;
  // Packed codes, row-major weight order, PackCodes layout. residual_codes is empty when
  // the residual was not kept (or was dropped by the format layer).
  std::vector<uint8_t> base_codes;
  std::vector<uint8_t> residual_codes;
  // W' (rotated) ~= diag(row_scales) * Q * diag(col_scales).
  std::vector<float> row_scales;
  std::vector<float> col_scales;

  bool has_residual() const { return !residual_codes.empty(); }
};

// ---- Byte layout of the planes -------------------------------------------------------
// A plane of `bits`-bit codes (bits in {1, 2, 4, 8}) packs 8/bits codes per byte in
// row-major weight order, code k at bit offset bits * (k % (8/bits)) of byte k / (8/bits)
// (little-endian within the byte); a trailing partial byte is zero-padded.

// Bytes of a plane of rows x cols codes at `bits` bits.
int64_t PlaneBytes(int64_t rows, int64_t cols, int bits);
// Bytes of the base / residual plane of `m` (from its shape and params, not its vectors).
int64_t BasePlaneBytes(const EncodedMatrix& m);
int64_t ResidualPlaneBytes(const EncodedMatrix& m);

// Packs codes (each < 2^bits) into a plane; CHECK-free: values are masked to `bits`.
std::vector<uint8_t> PackCodes(std::span<const uint8_t> codes, int bits);
// Code `index` of a packed plane.
inline uint8_t UnpackCode(std::span<const uint8_t> plane, int64_t index, int bits) {
  const int per_byte = 8 / bits;
  const int shift = bits * static_cast<int>(index % per_byte);
  return static_cast<uint8_t>((plane[index / per_byte] >> shift) & ((1u << bits) - 1u));
}

// Attaches a residual plane read from a record; InvalidArgument if its size is wrong.
absl::Status AttachResidual(EncodedMatrix& m, std::vector<uint8_t> residual_plane);
// Drops the residual plane (what the resident file holds).
void DropResidual(EncodedMatrix& m);

// ---- The codec interface -------------------------------------------------------------
class Codec {
 public:
  virtual ~Codec() = default;

  virtual std::string name() const = 0;

  // Encodes row-major w (rows x cols). `hessian` (optional, cols x cols) weights the error
  // by the layer's input statistics; nullptr means the identity (plain rounding).
  virtual absl::StatusOr<EncodedMatrix> Encode(std::span<const float> w, int64_t rows,
                                               int64_t cols, const Hessian* hessian,
                                               const EncodeOptions& options) const = 0;

  // Decodes into out (rows x cols, row-major). k4Bit needs the residual plane
  // (FailedPrecondition without it); k2Bit reads the base plane only.
  virtual absl::Status Decode(const EncodedMatrix& m, Precision precision,
                              std::span<float> out) const = 0;
};

// ---- Registry ------------------------------------------------------------------------
using CodecFactory = std::function<std::unique_ptr<Codec>()>;

// Registers a codec by name; AlreadyExists if taken. "nested_scalar_v1" and "trellis_v1"
// are built in.
absl::Status RegisterCodec(const std::string& name, CodecFactory factory);
// A new instance of the named codec; NotFound naming the known codecs otherwise.
absl::StatusOr<std::unique_ptr<Codec>> MakeCodec(absl::string_view name);
std::vector<std::string> RegisteredCodecNames();
// The registry name for what a user typed: the short names "scalar" (nested_scalar_v1) and
// "trellis" (trellis_v1), or a registered name as it is; NotFound (as MakeCodec) otherwise.
// Manifests always record the registry name.
absl::StatusOr<std::string> ResolveCodecName(absl::string_view name);

}  // namespace nq::quant
