#include "services/streamer/routing_trace.h"

#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::streamer {
namespace {

// magic + version + num_layers + experts_per_layer + top_k + num_tokens.
constexpr size_t kHeaderBytes = 4 + 4 + 4 + 4 + 4 + 8;

void PutU16(uint16_t v, std::string* out) {
  out->push_back(static_cast<char>(v & 0xff));
  out->push_back(static_cast<char>(v >> 8));
}
void PutU32(uint32_t v, std::string* out) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU64(uint64_t v, std::string* out) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// Sequential little-endian reader; every read names what it was reading when it runs out.
class Reader {
 public:
  explicit Reader(std::string_view bytes) : bytes_(bytes) {}
  absl::Status Need(size_t n, std::string_view what) const {
    if (bytes_.size() - pos_ < n) {
      return absl::DataLossError(absl::StrCat("routing trace truncated reading ", std::string(what),
                                              " at byte ", pos_, " (need ", n, ", have ",
                                              bytes_.size() - pos_, ")"));
    }
    return absl::OkStatus();
  }
  uint64_t Uint(size_t n) {
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) {
      v |= static_cast<uint64_t>(static_cast<unsigned char>(bytes_[pos_ + i])) << (8 * i);
    }
    pos_ += n;
    return v;
  }
  size_t remaining() const { return bytes_.size() - pos_; }
  size_t pos() const { return pos_; }

 private:
  std::string_view bytes_;
  size_t pos_ = 0;
};

}  // namespace

absl::Status ValidateTrace(const RoutingTrace& trace) {
  if (trace.experts_per_layer == 0 || trace.experts_per_layer > kMaxTraceExperts) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts_per_layer must be in [1, ", kMaxTraceExperts, "], got ",
                     trace.experts_per_layer));
  }
  if (trace.num_layers() == 0 || trace.top_k == 0) {
    return absl::InvalidArgumentError("routing trace needs at least one layer and top_k >= 1");
  }
  if (trace.top_k > trace.experts_per_layer) {
    return absl::InvalidArgumentError(absl::StrCat("top_k ", trace.top_k,
                                                   " exceeds experts_per_layer ",
                                                   trace.experts_per_layer));
  }
  const size_t per_token = static_cast<size_t>(trace.num_layers()) * trace.top_k;
  if (trace.experts.size() % per_token != 0 || trace.weights.size() != trace.experts.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("routing trace sizes disagree: ", trace.experts.size(), " experts, ",
                     trace.weights.size(), " weights, ", per_token, " per token"));
  }
  for (size_t i = 0; i < trace.experts.size(); ++i) {
    if (trace.experts[i] >= trace.experts_per_layer) {
      return absl::InvalidArgumentError(absl::StrCat("expert id ", trace.experts[i],
                                                     " out of range at entry ", i, " (",
                                                     trace.experts_per_layer, " experts)"));
    }
    if (!std::isfinite(trace.weights[i])) {
      return absl::InvalidArgumentError(absl::StrCat("non-finite routing weight at entry ", i));
    }
  }
  const size_t tokens = trace.num_tokens();
  if (!trace.input_sq_norms.empty()) {
    if (trace.input_sq_norms.size() != tokens * trace.num_layers()) {
      return absl::InvalidArgumentError(absl::StrCat("routing trace has ", trace.input_sq_norms.size(),
                                                     " input norms for ", tokens * trace.num_layers(),
                                                     " (token, layer) entries"));
    }
    for (size_t i = 0; i < trace.input_sq_norms.size(); ++i) {
      if (!(trace.input_sq_norms[i] >= 0) || !std::isfinite(trace.input_sq_norms[i])) {
        return absl::InvalidArgumentError(absl::StrCat("bad input norm ", trace.input_sq_norms[i],
                                                       " at (token, layer) entry ", i));
      }
    }
  }
  for (size_t i = 0; i < trace.sequence_starts.size(); ++i) {
    const uint64_t start = trace.sequence_starts[i];
    if ((i == 0 && start != 0) || (i > 0 && start <= trace.sequence_starts[i - 1]) ||
        (i > 0 && start >= tokens)) {
      return absl::InvalidArgumentError(absl::StrCat("sequence start ", i, " (token ", start,
                                                     ") is not ascending from 0 within ", tokens,
                                                     " tokens"));
    }
  }
  return absl::OkStatus();
}

std::vector<std::pair<size_t, size_t>> RoutingTrace::Sequences() const {
  std::vector<std::pair<size_t, size_t>> out;
  const size_t tokens = num_tokens();
  if (sequence_starts.empty()) {
    if (tokens > 0) out.emplace_back(0, tokens);
    return out;
  }
  for (size_t i = 0; i < sequence_starts.size(); ++i) {
    const size_t end = i + 1 < sequence_starts.size() ? sequence_starts[i + 1] : tokens;
    out.emplace_back(sequence_starts[i], end);
  }
  return out;
}

absl::StatusOr<std::string> EncodeTrace(const RoutingTrace& trace) {
  RETURN_IF_ERROR(ValidateTrace(trace));
  std::string out;
  out.reserve(kHeaderBytes + 4 * trace.num_layers() + trace.experts.size() * 6);
  out.append(kTraceMagic, 4);
  PutU32(kTraceVersion, &out);
  PutU32(trace.num_layers(), &out);
  PutU32(trace.experts_per_layer, &out);
  PutU32(trace.top_k, &out);
  PutU64(trace.num_tokens(), &out);
  const bool norms = !trace.input_sq_norms.empty();
  PutU32(norms ? kTraceHasNorms : 0, &out);
  PutU64(trace.sequence_starts.size(), &out);
  for (uint64_t start : trace.sequence_starts) PutU64(start, &out);
  for (uint32_t id : trace.layer_ids) PutU32(id, &out);
  const size_t entries = trace.experts.size() / trace.top_k;
  for (size_t e = 0; e < entries; ++e) {
    for (uint32_t j = 0; j < trace.top_k; ++j) {
      PutU16(static_cast<uint16_t>(trace.experts[e * trace.top_k + j]), &out);
    }
    for (uint32_t j = 0; j < trace.top_k; ++j) {
      PutU32(std::bit_cast<uint32_t>(trace.weights[e * trace.top_k + j]), &out);
    }
    if (norms) PutU32(std::bit_cast<uint32_t>(trace.input_sq_norms[e]), &out);
  }
  return out;
}

absl::StatusOr<RoutingTrace> DecodeTrace(std::string_view bytes) {
  Reader in(bytes);
  RETURN_IF_ERROR(in.Need(4, "magic"));
  if (bytes.substr(0, 4) != std::string_view(kTraceMagic, 4)) {
    return absl::InvalidArgumentError("not a routing trace: bad magic (expected \"NQRT\")");
  }
  in.Uint(4);
  RETURN_IF_ERROR(in.Need(4, "version"));
  const uint32_t version = static_cast<uint32_t>(in.Uint(4));
  if (version != kTraceVersion && version != kTraceVersionNoSequences) {
    return absl::UnimplementedError(absl::StrCat("unsupported trace version ", version,
                                                 " (this build reads version ", kTraceVersion,
                                                 ")"));
  }
  RETURN_IF_ERROR(in.Need(kHeaderBytes - 8, "header"));
  RoutingTrace trace;
  const uint32_t num_layers = static_cast<uint32_t>(in.Uint(4));
  trace.experts_per_layer = static_cast<uint32_t>(in.Uint(4));
  trace.top_k = static_cast<uint32_t>(in.Uint(4));
  const uint64_t num_tokens = in.Uint(8);
  if (num_layers == 0 || trace.top_k == 0 || trace.experts_per_layer == 0 ||
      trace.experts_per_layer > kMaxTraceExperts) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad trace header: ", num_layers, " layers, ", trace.experts_per_layer,
                     " experts, top_k ", trace.top_k));
  }
  bool norms = false;
  if (version >= kTraceVersion) {
    RETURN_IF_ERROR(in.Need(12, "flags and sequence count"));
    const uint32_t flags = static_cast<uint32_t>(in.Uint(4));
    if ((flags & ~kTraceHasNorms) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("unknown trace flags 0x", absl::Hex(flags)));
    }
    norms = (flags & kTraceHasNorms) != 0;
    const uint64_t sequences = in.Uint(8);
    // Checked against the bytes left before allocating (a corrupt count is not terabytes).
    if (sequences > in.remaining() / 8) {
      return absl::DataLossError(absl::StrCat("routing trace truncated reading ", sequences,
                                              " sequence starts (", in.remaining(), " bytes left)"));
    }
    trace.sequence_starts.resize(sequences);
    for (uint64_t& start : trace.sequence_starts) start = in.Uint(8);
  }
  RETURN_IF_ERROR(in.Need(4ull * num_layers, "layer ids"));
  trace.layer_ids.resize(num_layers);
  for (uint32_t& id : trace.layer_ids) id = static_cast<uint32_t>(in.Uint(4));
  // Check the size before allocating so a corrupt count cannot ask for terabytes.
  const uint64_t entry_bytes = 6ull * trace.top_k + (norms ? 4 : 0);
  const uint64_t entries = num_tokens * num_layers;
  if (num_tokens != 0 && (entries / num_tokens != num_layers ||
                          in.remaining() / entry_bytes < entries)) {
    return absl::DataLossError(absl::StrCat("routing trace truncated reading records: header says ",
                                            num_tokens, " tokens, ", in.remaining(),
                                            " bytes of records left"));
  }
  if (in.remaining() != entries * entry_bytes) {
    return absl::DataLossError(absl::StrCat("routing trace has ",
                                            in.remaining() - entries * entry_bytes,
                                            " trailing bytes after ", num_tokens, " tokens"));
  }
  trace.experts.resize(entries * trace.top_k);
  trace.weights.resize(entries * trace.top_k);
  if (norms) trace.input_sq_norms.resize(entries);
  for (uint64_t e = 0; e < entries; ++e) {
    for (uint32_t j = 0; j < trace.top_k; ++j) {
      trace.experts[e * trace.top_k + j] = static_cast<uint32_t>(in.Uint(2));
    }
    for (uint32_t j = 0; j < trace.top_k; ++j) {
      trace.weights[e * trace.top_k + j] = std::bit_cast<float>(static_cast<uint32_t>(in.Uint(4)));
    }
    if (norms) trace.input_sq_norms[e] = std::bit_cast<float>(static_cast<uint32_t>(in.Uint(4)));
  }
  RETURN_IF_ERROR(ValidateTrace(trace));
  return trace;
}

absl::Status WriteTrace(const RoutingTrace& trace, const std::string& path) {
  ASSIGN_OR_RETURN(std::string bytes, EncodeTrace(trace));
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::UnavailableError(absl::StrCat("cannot open ", tmp, " for writing"));
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) return absl::DataLossError(absl::StrCat("writing ", tmp, " failed"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("renaming ", tmp, " to ", path, ": ",
                                               std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<RoutingTrace> ReadTrace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open routing trace ", path));
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("reading ", path, " failed"));
  absl::StatusOr<RoutingTrace> trace = DecodeTrace(buffer.str());
  if (!trace.ok()) return Annotate(trace.status(), path);
  return trace;
}

absl::Status AppendRoutingReport(const nq::v1::RoutingReport& report, RoutingTrace* trace,
                                 std::optional<uint64_t>* last_sequence_id) {
  const size_t tokens = report.num_tokens();
  const size_t entries = static_cast<size_t>(report.layer_entries_size());
  if (tokens == 0) return entries == 0 ? absl::OkStatus()
                                       : absl::InvalidArgumentError("entries but num_tokens 0");
  if (entries % tokens != 0) {
    return absl::InvalidArgumentError(absl::StrCat("routing report has ", entries,
                                                   " layer entries for ", tokens, " tokens"));
  }
  const size_t layers = entries / tokens;
  std::vector<uint32_t> layer_ids = trace->layer_ids;
  uint32_t top_k = trace->top_k;
  if (layer_ids.empty()) {
    for (size_t l = 0; l < layers; ++l) layer_ids.push_back(report.layer_entries(l).layer());
    top_k = static_cast<uint32_t>(report.layer_entries(0).experts_size());
  }
  if (layers != layer_ids.size()) {
    return absl::InvalidArgumentError(absl::StrCat("routing report has ", layers,
                                                   " layers per token, trace has ",
                                                   layer_ids.size()));
  }
  if (trace->experts_per_layer == 0 || top_k == 0) {
    return absl::InvalidArgumentError("trace needs experts_per_layer and a non-empty report");
  }
  for (size_t i = 0; i < entries; ++i) {
    const nq::v1::LayerRouting& entry = report.layer_entries(static_cast<int>(i));
    if (entry.layer() != layer_ids[i % layers]) {
      return absl::InvalidArgumentError(absl::StrCat("entry ", i, " is layer ", entry.layer(),
                                                     ", expected ", layer_ids[i % layers]));
    }
    if (entry.experts_size() != static_cast<int>(top_k) ||
        entry.weights_size() != static_cast<int>(top_k)) {
      return absl::InvalidArgumentError(absl::StrCat("entry ", i, " has ", entry.experts_size(),
                                                     " experts and ", entry.weights_size(),
                                                     " weights, expected ", top_k));
    }
    for (uint32_t expert : entry.experts()) {
      if (expert >= trace->experts_per_layer) {
        return absl::InvalidArgumentError(absl::StrCat("entry ", i, ": expert ", expert,
                                                       " out of range (",
                                                       trace->experts_per_layer, " experts)"));
      }
    }
  }
  const bool first = trace->experts.empty();
  if (last_sequence_id != nullptr) {
    if (!first && (!last_sequence_id->has_value() || **last_sequence_id != report.sequence_id())) {
      if (trace->sequence_starts.empty()) trace->sequence_starts.push_back(0);
      trace->sequence_starts.push_back(trace->num_tokens());
    }
    *last_sequence_id = report.sequence_id();
  }
  bool norms = first || !trace->input_sq_norms.empty();
  for (size_t i = 0; i < entries && norms; ++i) {
    norms = report.layer_entries(static_cast<int>(i)).input_sq_norm() > 0;
  }
  trace->layer_ids = std::move(layer_ids);
  trace->top_k = top_k;
  if (!norms) {
    trace->input_sq_norms.clear();
  } else {
    for (size_t i = 0; i < entries; ++i) {
      trace->input_sq_norms.push_back(report.layer_entries(static_cast<int>(i)).input_sq_norm());
    }
  }
  for (size_t i = 0; i < entries; ++i) {
    const nq::v1::LayerRouting& entry = report.layer_entries(static_cast<int>(i));
    trace->experts.insert(trace->experts.end(), entry.experts().begin(), entry.experts().end());
    trace->weights.insert(trace->weights.end(), entry.weights().begin(), entry.weights().end());
  }
  return absl::OkStatus();
}

}  // namespace nq::streamer
