// exp over a whole array, four doubles at a time where the CPU has AVX2: the host sampler takes
// an exponential of every logit of the vocabulary per token (154880 at GLM-5's), which the scalar
// std::exp makes about half of a greedy draw with log-probabilities.
#pragma once

#include <span>

namespace nq::worker {

// values[i] = exp(values[i]) in place; -inf gives 0. With AVX2, glibc's vector math library
// (libmvec, `_ZGVdN4v_exp`: within 4 ulp, glibc's documented bound, where std::exp is within 1),
// else std::exp. So on one machine the results are the same on every call; across machines with
// and without AVX2 they may differ in the last bits.
void ExpInPlace(std::span<double> values);

// Whether ExpInPlace uses the vector library on this CPU.
bool ExpInPlaceIsVectorized();

}  // namespace nq::worker
