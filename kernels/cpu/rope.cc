// CPU reference rotary embedding, in place on x[tokens, heads, dim].
//
// The angle follows HF's rotary modules exactly: freq = float32(inv_freq[i]) * float32(position)
// rounded to float32, cos/sin in float32, each multiplied by attention_scaling in float32 (HF
// computes these in float32 even for a float64 model, so matching them bit for bit is what keeps
// long positions within tolerance). The rotation of each pair is then done in double and rounded
// once. cos/sin are computed once per token and shared by its heads.
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"

namespace nq::kernels::cpu {
namespace {

constexpr std::int64_t kParallelMinElements = std::int64_t{1} << 18;

}  // namespace

void Rope(const RopeParams& p, int threads) {
  // Only the leading 2 * inv_freq.size() elements of each head rotate (the DSA indexer's
  // heads carry a rope slice followed by an unrotated one).
  const std::int64_t half = static_cast<std::int64_t>(p.inv_freq.size());
  const int use_threads = p.tokens * p.heads * p.dim < kParallelMinElements ? 1 : threads;
  ParallelFor(p.tokens, 1, use_threads, [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> cos(half);
    std::vector<float> sin(half);
    for (std::int64_t t = begin; t < end; ++t) {
      const float position = static_cast<float>(p.start_pos + t);
      for (std::int64_t i = 0; i < half; ++i) {
        const float angle = p.inv_freq[i] * position;
        cos[i] = std::cos(angle) * p.attention_scaling;
        sin[i] = std::sin(angle) * p.attention_scaling;
      }
      for (std::int64_t h = 0; h < p.heads; ++h) {
        float* x = p.x + (t * p.heads + h) * p.dim;
        for (std::int64_t i = 0; i < half; ++i) {
          // The pair rotated by frequency i: adjacent (DeepSeek / GPT-J) or half a head apart
          // (NeoX / rotate_half).
          float& re = p.interleaved ? x[2 * i] : x[i];
          float& im = p.interleaved ? x[2 * i + 1] : x[i + half];
          const double a = re;
          const double b = im;
          re = static_cast<float>(a * cos[i] - b * sin[i]);
          im = static_cast<float>(b * cos[i] + a * sin[i]);
        }
      }
    }
  });
}

}  // namespace nq::kernels::cpu
