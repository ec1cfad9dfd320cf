// Reading the HF reference fixtures of tests/fixtures/models/.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace nq::model::testing {

// tests/fixtures/models/<name>
std::string FixtureDir(const std::string& name);
std::vector<int32_t> ReadTokens(const std::string& dir);
// Little-endian float32 file.
std::vector<float> ReadFloats(const std::string& path);

struct Comparison {
  double max_abs_diff = 0;
  double max_abs_ref = 0;
  bool Within(double relative) const { return max_abs_diff <= relative * max_abs_ref; }
};
// Compares `actual` against rows [row_begin, row_begin + rows) of `reference` ([*, cols]).
Comparison Compare(const std::vector<float>& actual, const std::vector<float>& reference, int64_t row_begin,
                   int64_t cols);

}  // namespace nq::model::testing
