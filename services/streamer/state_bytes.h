// Fixed-layout binary state (predictor and jF feature state, saved across streamer restarts):
// values appended in host byte order, read back in the same order with bounds checks.
#pragma once

#include <cstddef>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace nq::streamer {

template <typename T>
void PutValue(const T& v, std::string* out) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}
template <typename T>
void PutVector(const std::vector<T>& v, std::string* out) {
  out->append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// Reads fixed-size values in order; false once the bytes run out.
class StateBytesReader {
 public:
  explicit StateBytesReader(std::string_view bytes) : bytes_(bytes) {}
  template <typename T>
  bool Get(T* v) {
    if (bytes_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  // Fills `v` (already sized) from the next v->size() values.
  template <typename T>
  bool GetVector(std::vector<T>* v) {
    const size_t n = v->size() * sizeof(T);
    if (bytes_.size() - pos_ < n) return false;
    std::memcpy(v->data(), bytes_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  std::string_view Rest() const { return bytes_.substr(pos_); }
  bool done() const { return pos_ == bytes_.size(); }

 private:
  std::string_view bytes_;
  size_t pos_ = 0;
};

}  // namespace nq::streamer
