// What every fuzz target uses to report a broken guarantee: a trap, which libFuzzer records as
// a crash with the input that caused it.
#pragma once

namespace nq::fuzz {

inline void Require(bool condition) {
  if (!condition) __builtin_trap();
}

}  // namespace nq::fuzz
