#include "services/common/metrics/exposition.h"

#include <charconv>
#include <cmath>
#include <cstdint>

namespace nq::metrics::internal {
namespace {

// Enough for any shortest-round-trip double ("-2.2250738585072014e-308" is 24 chars) and any
// uint64_t (20 digits).
constexpr size_t kNumberBufferSize = 32;

constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";  // U+FFFD in UTF-8.

// Length of the well-formed UTF-8 sequence starting at s[i] (RFC 3629, table 3-7 of the
// Unicode standard: no overlong forms, no surrogates, nothing above U+10FFFF), or 0.
size_t Utf8SequenceLength(std::string_view s, size_t i) {
  const auto lead = static_cast<unsigned char>(s[i]);
  if (lead < 0x80) return 1;
  size_t length = 0;
  unsigned char second_min = 0x80;
  unsigned char second_max = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) second_min = 0xA0;  // Overlong below U+0800.
    if (lead == 0xED) second_max = 0x9F;  // Surrogates U+D800..U+DFFF.
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) second_min = 0x90;  // Overlong below U+10000.
    if (lead == 0xF4) second_max = 0x8F;  // Above U+10FFFF.
  } else {
    return 0;
  }
  if (i + length > s.size()) return 0;
  const auto second = static_cast<unsigned char>(s[i + 1]);
  if (second < second_min || second > second_max) return 0;
  for (size_t k = 2; k < length; ++k) {
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 0;
  }
  return length;
}

void AppendEscaped(std::string_view in, bool escape_quote, std::string& out) {
  out.reserve(out.size() + in.size());
  for (size_t i = 0; i < in.size();) {
    const size_t length = Utf8SequenceLength(in, i);
    if (length == 0) {
      out += kReplacementCharacter;  // One per invalid byte, then resynchronise.
      i += 1;
    } else if (length > 1) {
      out.append(in.substr(i, length));
      i += length;
    } else {
      const char c = in[i];
      if (c == '\\') {
        out += "\\\\";
      } else if (c == '\n') {
        out += "\\n";
      } else if (c == '"' && escape_quote) {
        out += "\\\"";
      } else {
        out += c;
      }
      i += 1;
    }
  }
}

void AppendCount(uint64_t count, std::string& out) {
  char buffer[kNumberBufferSize];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), count);
  out.append(buffer, result.ptr);
}

// Opens a sample line: `name{labels} ` or `name `; the caller appends the value.
void AppendSampleStart(std::string_view name, std::string_view suffix, std::string_view labels,
                       std::string& out) {
  out.append(name).append(suffix);
  if (!labels.empty()) out.append("{").append(labels).append("}");
  out += ' ';
}

}  // namespace

void AppendValue(double v, std::string& out) {
  if (std::isnan(v)) {
    out += "NaN";
  } else if (std::isinf(v)) {
    out += v > 0 ? "+Inf" : "-Inf";
  } else {
    char buffer[kNumberBufferSize];
    const auto result = std::to_chars(buffer, buffer + sizeof(buffer), v);
    out.append(buffer, result.ptr);
  }
}

std::string FormatValue(double v) {
  std::string out;
  AppendValue(v, out);
  return out;
}

std::string EscapeHelp(std::string_view help) {
  std::string out;
  AppendEscaped(help, /*escape_quote=*/false, out);
  return out;
}

std::string EscapeLabelValue(std::string_view value) {
  std::string out;
  AppendEscaped(value, /*escape_quote=*/true, out);
  return out;
}

std::string FormatLabels(const std::vector<std::string>& names,
                         const std::vector<std::string>& values) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < values.size(); ++i) {
    if (i > 0) out += ',';
    out.append(names[i]).append("=\"");
    AppendEscaped(values[i], /*escape_quote=*/true, out);
    out += '"';
  }
  return out;
}

void AppendHeader(std::string_view name, std::string_view help, MetricType type, std::string& out) {
  out.append("# HELP ").append(name).append(" ");
  AppendEscaped(help, /*escape_quote=*/false, out);
  out.append("\n# TYPE ").append(name).append(" ").append(TypeName(type)).append("\n");
}

void AppendSamples(std::string_view name, std::string_view labels, const Counter& counter,
                   std::string& out) {
  AppendSampleStart(name, "", labels, out);
  AppendValue(counter.Value(), out);
  out += '\n';
}

void AppendSamples(std::string_view name, std::string_view labels, const Gauge& gauge,
                   std::string& out) {
  AppendSampleStart(name, "", labels, out);
  AppendValue(gauge.Value(), out);
  out += '\n';
}

void AppendSamples(std::string_view name, std::string_view labels, const Histogram& histogram,
                   std::string& out) {
  const HistogramSnapshot snapshot = histogram.Snapshot();
  // `le` goes last, after the family's own labels, as client_golang writes it.
  std::string le_prefix(labels);
  if (!le_prefix.empty()) le_prefix += ',';
  le_prefix += "le=\"";
  for (size_t i = 0; i < snapshot.cumulative_counts.size(); ++i) {
    std::string bucket_labels = le_prefix;
    if (i < snapshot.bucket_upper_bounds.size()) {
      AppendValue(snapshot.bucket_upper_bounds[i], bucket_labels);
    } else {
      bucket_labels += "+Inf";
    }
    bucket_labels += '"';
    AppendSampleStart(name, "_bucket", bucket_labels, out);
    AppendCount(snapshot.cumulative_counts[i], out);
    out += '\n';
  }
  AppendSampleStart(name, "_sum", labels, out);
  AppendValue(snapshot.sum, out);
  out += '\n';
  AppendSampleStart(name, "_count", labels, out);
  AppendCount(snapshot.count, out);
  out += '\n';
}

}  // namespace nq::metrics::internal
