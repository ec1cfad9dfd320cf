// Backend::NqMoe: validation of the NestQuant MoE op's tensors (kernels/nq_moe.h) into the raw
// NqMoeParams both backends run from, and the default hook for a backend without the op.
#include <bit>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/moe_op_checks.h"
#include "services/common/status_macros.h"

namespace nq::kernels {
namespace {

constexpr absl::string_view kOp = "NqMoe";

absl::Status ExpectShape(absl::string_view arg, const Tensor& t, DType dtype, const Shape& shape) {
  return CheckMoeTensor(kOp, arg, t, dtype, shape);
}

absl::Status CheckRotation(absl::string_view arg, const NqRotation& r, std::int64_t n) {
  RETURN_IF_ERROR(ExpectShape(absl::StrCat(arg, ".signs"), r.signs, DType::kF32, Shape{n}));
  if (r.block < 2 || !std::has_single_bit(static_cast<std::uint64_t>(r.block)) || n % r.block != 0) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", arg, ".block ", r.block,
                                                   " must be a power of two >= 2 dividing ", n));
  }
  return absl::OkStatus();
}

absl::string_view CodecName(NqCodec codec) {
  switch (codec) {
    case NqCodec::kNestedScalar:
      return "nested_scalar_v1";
    case NqCodec::kTrellis:
      return "trellis_v1";
  }
  return "an unknown codec";
}

// The codec's own tables of one projection: nested_scalar_v1's level table or trellis_v1's
// per-column-block gains, and the other left empty so nothing given is silently ignored.
absl::Status CheckCodecTables(NqCodec codec, const char* name, const NqProjection& p, std::int64_t E,
                              std::int64_t rows, std::int64_t cols) {
  const bool trellis = codec == NqCodec::kTrellis;
  const Tensor& used = trellis ? p.gains : p.levels;
  const Tensor& unused = trellis ? p.levels : p.gains;
  const char* used_name = trellis ? "gains" : "levels";
  if (unused.valid()) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", name, ".", trellis ? "levels" : "gains", " is ",
                                                   unused.DebugString(), " but a ", CodecName(codec),
                                                   " layer takes only ", used_name));
  }
  if (!used.valid()) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", name, ".", used_name, " is an empty tensor"));
  }
  if (!trellis) return ExpectShape(absl::StrCat(name, ".levels"), used, DType::kF32, Shape{E, kNqLevelTable});
  if (rows % kNqTrellisBlock != 0 || cols % kNqTrellisBlock != 0) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", name, " is ", rows, " x ", cols,
                                                   "; trellis_v1 codes whole 16 x 16 tiles"));
  }
  return ExpectShape(absl::StrCat(name, ".gains"), used, DType::kF32,
                     Shape{E, cols / kNqTrellisBlock, kNqGainsPerBlock});
}

NqProjectionView View(const NqProjection& p) {
  return {.base = p.base.data_as<std::uint8_t>(),
          .row_scales = p.row_scales.data_as<float>(),
          .col_scales = p.col_scales.data_as<float>(),
          .levels = p.levels.valid() ? p.levels.data_as<float>() : nullptr,
          .gains = p.gains.valid() ? p.gains.data_as<float>() : nullptr,
          .residual_offset = p.residual_offset,
          .lowrank_u = p.lowrank_u.valid() ? p.lowrank_u.data_as<float>() : nullptr,
          .lowrank_v = p.lowrank_v.valid() ? p.lowrank_v.data_as<float>() : nullptr,
          .lowrank_offset = p.lowrank_u.valid() ? p.lowrank_offset : -1};
}

// A projection's low-rank factors (kernels/nq_moe.h): both tensors or neither, of the layer's rank,
// only in a layer that has one, and the slot's fp16 factors inside the slot, 2-byte aligned.
absl::Status CheckLowRank(const char* name, const NqProjection& p, std::int64_t E, std::int64_t rows,
                          std::int64_t cols, std::int64_t R, const NqSlots& slots) {
  if (!p.lowrank_u.valid() && !p.lowrank_v.valid()) return absl::OkStatus();
  if (R == 0) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", name, " has low-rank factors but lowrank_rank is 0"));
  }
  RETURN_IF_ERROR(ExpectShape(absl::StrCat(name, ".lowrank_u"), p.lowrank_u, DType::kF32, Shape{E, rows, R}));
  RETURN_IF_ERROR(ExpectShape(absl::StrCat(name, ".lowrank_v"), p.lowrank_v, DType::kF32, Shape{E, R, cols}));
  if (slots.arena != nullptr &&
      (p.lowrank_offset < 0 || p.lowrank_offset % 2 != 0 ||
       p.lowrank_offset + NqLowRankBytes(rows, cols, R) > slots.slot_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", name, " low-rank factors at offset ", p.lowrank_offset,
                                                   " (", NqLowRankBytes(rows, cols, R), " bytes) do not fit a ",
                                                   slots.slot_bytes, "-byte slot 2-byte aligned"));
  }
  return absl::OkStatus();
}

NqRotationView View(const NqRotation& r) { return {.signs = r.signs.data_as<float>(), .block = r.block}; }

}  // namespace

absl::Status Backend::NqMoe(const Tensor& x, const Tensor& expert_ids, const Tensor& expert_weights,
                            const NqMoeWeights& w, const NqSlots& slots, Tensor& out) {
  RETURN_IF_ERROR(RefuseOnSide(kOp));
  RETURN_IF_ERROR(CheckOwned(kOp, "x", x));
  RETURN_IF_ERROR(CheckOwned(kOp, "expert_ids", expert_ids));
  RETURN_IF_ERROR(CheckOwned(kOp, "expert_weights", expert_weights));
  RETURN_IF_ERROR(CheckOwned(kOp, "out", out));
  const std::int64_t D = w.hidden, I = w.intermediate, E = w.num_experts;
  if (w.codec != NqCodec::kNestedScalar && w.codec != NqCodec::kTrellis) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": codec ", static_cast<std::int32_t>(w.codec), " is neither nested_scalar_v1 nor trellis_v1"));
  }
  if (w.lowrank_rank < 0 || w.lowrank_rank > kNqMaxLowRank) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": lowrank_rank ", w.lowrank_rank, " is outside [0, ",
                                                   kNqMaxLowRank, "]"));
  }
  if (w.lowrank_rank > 0 && !AppliesNqLowRank()) {
    return absl::FailedPreconditionError(absl::StrCat(kOp, ": the ", std::string(name()),
                                                      " backend does not apply low-rank corrections (issue #16)"));
  }
  if (D <= 0 || I <= 0 || E <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": hidden ", D, ", intermediate ", I, " and num_experts ", E, " must be positive"));
  }
  ASSIGN_OR_RETURN(const MoeTokens tokens, CheckMoeActivations(kOp, x, expert_ids, expert_weights, out, D));
  const std::int64_t T = tokens.tokens, K = tokens.top_k;

  struct Named {
    const char* name;
    const NqProjection* p;
    std::int64_t rows, cols;
  };
  for (const Named& n : {Named{"gate", &w.gate, I, D}, Named{"up", &w.up, I, D}, Named{"down", &w.down, D, I}}) {
    for (const Tensor* t : {&n.p->base, &n.p->row_scales, &n.p->col_scales}) {
      RETURN_IF_ERROR(CheckOwned(kOp, n.name, *t));
    }
    // Both codecs' planes hold 2 bits a weight: the same bytes, in row-major or tile order.
    RETURN_IF_ERROR(ExpectShape(absl::StrCat(n.name, ".base"), n.p->base, DType::kU8, Shape{E, NqPlaneBytes(n.rows, n.cols)}));
    RETURN_IF_ERROR(ExpectShape(absl::StrCat(n.name, ".row_scales"), n.p->row_scales, DType::kF32, Shape{E, n.rows}));
    RETURN_IF_ERROR(ExpectShape(absl::StrCat(n.name, ".col_scales"), n.p->col_scales, DType::kF32, Shape{E, n.cols}));
    RETURN_IF_ERROR(CheckCodecTables(w.codec, n.name, *n.p, E, n.rows, n.cols));
    RETURN_IF_ERROR(CheckLowRank(n.name, *n.p, E, n.rows, n.cols, w.lowrank_rank, slots));
    for (const Tensor* t : {&n.p->lowrank_u, &n.p->lowrank_v}) {
      if (t->valid()) RETURN_IF_ERROR(CheckOwned(kOp, n.name, *t));
    }
    RETURN_IF_ERROR(CheckOwned(kOp, n.name, w.codec == NqCodec::kTrellis ? n.p->gains : n.p->levels));
    // Residual planes are read 4 bytes at a time by the CUDA kernels.
    if (slots.arena != nullptr &&
        (n.p->residual_offset < 0 || n.p->residual_offset % 4 != 0 ||
         n.p->residual_offset + NqPlaneBytes(n.rows, n.cols) > slots.slot_bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", n.name, " residual plane at offset ",
                                                     n.p->residual_offset, " (", NqPlaneBytes(n.rows, n.cols),
                                                     " bytes) does not fit a ", slots.slot_bytes,
                                                     "-byte slot 4-byte aligned"));
    }
  }
  RETURN_IF_ERROR(CheckRotation("input", w.input, D));
  RETURN_IF_ERROR(CheckRotation("gate_rows", w.gate_rows, I));
  RETURN_IF_ERROR(CheckRotation("down_cols", w.down_cols, I));
  RETURN_IF_ERROR(CheckRotation("down_rows", w.down_rows, D));
  for (const NqRotation* r : {&w.input, &w.gate_rows, &w.down_cols, &w.down_rows}) {
    RETURN_IF_ERROR(CheckOwned(kOp, "rotation signs", r->signs));
  }
  if (slots.slot_of_expert == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": slots.slot_of_expert is required (all -1 for 2 bits)"));
  }
  RETURN_IF_ERROR(CheckOwned(kOp, "slot_of_expert", *slots.slot_of_expert));
  const Shape& table = slots.slot_of_expert->shape();
  const std::int64_t table_rows = table.rank() == 2 ? table.dim(0) : 1;
  RETURN_IF_ERROR(ExpectShape("slot_of_expert", *slots.slot_of_expert, DType::kI32,
                              table.rank() == 2 ? Shape{table_rows, E} : Shape{E}));
  if (slots.slot_table_row < 0 || slots.slot_table_row >= table_rows) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": slot_table_row ", slots.slot_table_row, " of a table of ",
                                                   table_rows, " rows"));
  }
  if (slots.arena != nullptr && (slots.num_slots < 0 || slots.slot_bytes <= 0 || slots.slot_bytes % 4 != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": arena of ", slots.num_slots, " slots of ", slots.slot_bytes,
                                                   " bytes (slot_bytes must be a positive multiple of 4)"));
  }
  const std::uint8_t* const* slot_records = nullptr;
  if (slots.slot_records != nullptr) {
    if (slots.arena == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": slot_records without an arena (set arena to any slot's record)"));
    }
    RETURN_IF_ERROR(CheckOwned(kOp, "slot_records", *slots.slot_records));
    RETURN_IF_ERROR(ExpectShape("slot_records", *slots.slot_records, DType::kU8,
                                Shape{slots.num_slots * static_cast<std::int64_t>(sizeof(void*))}));
    slot_records = static_cast<const std::uint8_t* const*>(slots.slot_records->data());
  }
  if (T == 0) return absl::OkStatus();
  return DoNqMoe({.codec = w.codec,
                  .tokens = T,
                  .top_k = K,
                  .hidden = D,
                  .intermediate = I,
                  .num_experts = E,
                  .lowrank_rank = w.lowrank_rank,
                  .x = x.data_as<float>(),
                  .expert_ids = expert_ids.data_as<std::int32_t>(),
                  .expert_weights = expert_weights.data_as<float>(),
                  .out = out.data_as<float>(),
                  .gate = View(w.gate),
                  .up = View(w.up),
                  .down = View(w.down),
                  .input = View(w.input),
                  .gate_rows = View(w.gate_rows),
                  .down_cols = View(w.down_cols),
                  .down_rows = View(w.down_rows),
                  .slot_of_expert = slots.slot_of_expert->data_as<std::int32_t>() + slots.slot_table_row * E,
                  .arena = reinterpret_cast<const std::uint8_t*>(slots.arena),
                  .slot_records = slots.arena == nullptr ? nullptr : slot_records,
                  .slot_bytes = slots.arena == nullptr ? 0 : slots.slot_bytes,
                  .num_slots = slots.arena == nullptr ? 0 : slots.num_slots});
}

absl::Status Backend::DoNqMoe(const NqMoeParams&) {
  return absl::UnimplementedError(absl::StrCat("NqMoe is not implemented by the ", std::string(name()), " backend"));
}

}  // namespace nq::kernels
