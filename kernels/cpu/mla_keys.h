// What the CPU MLA kernels (fp32 serving, float64 reference) share: which keys a query sees, and
// the work estimate that decides whether a call is worth the thread pool.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/cpu/ops.h"

namespace nq::kernels::cpu {

// The keys query t may attend to, in the order they are accumulated: every s <= pos, or the
// selected entries that are visible (others, -1 included, are skipped).
inline void VisibleKeys(const MlaAttentionParams& p, std::int64_t t, std::vector<std::int64_t>& keys) {
  const std::int64_t pos = p.start_pos + t;
  keys.clear();
  if (p.selected == nullptr) {
    for (std::int64_t s = 0; s <= pos; ++s) keys.push_back(s);
    return;
  }
  const std::int32_t* row = p.selected + t * p.top_k;
  for (std::int64_t k = 0; k < p.top_k; ++k) {
    if (row[k] >= 0 && row[k] <= pos) keys.push_back(row[k]);
  }
}

// Multiply-adds of a call (an upper bound: every query counted with its most keys).
inline std::int64_t MlaAttentionFmas(const MlaAttentionParams& p) {
  const std::int64_t keys_per_query = p.selected != nullptr ? p.top_k : p.start_pos + p.tokens;
  return p.tokens * p.heads * (p.dn * p.c + keys_per_query * (2 * p.c + p.dr) + p.dv * p.c);
}

}  // namespace nq::kernels::cpu
