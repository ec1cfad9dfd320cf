// Helpers that build histogram bucket layouts. Misuse (a layout that could not be strictly
// increasing and finite) is a programming error and aborts, like the rest of this library.
#pragma once

#include <vector>

namespace nq::metrics {

// `count` bounds start, start*factor, start*factor^2, ...; requires start > 0, factor > 1,
// count >= 1, and a finite last bound. Example: ExponentialBuckets(0.001, 2, 15) spans
// 1 ms .. ~16 s, a good default for request latencies in seconds.
std::vector<double> ExponentialBuckets(double start, double factor, int count);

// `count` bounds start, start+width, start+2*width, ...; requires width > 0 and count >= 1.
// Each bound is computed as start + i*width rather than by repeated addition, so rounding
// error does not accumulate along the layout.
std::vector<double> LinearBuckets(double start, double width, int count);

}  // namespace nq::metrics
