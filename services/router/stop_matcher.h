// Stop strings on streamed text: text is released as soon as it can no longer be the start
// of a stop string; when a stop string completes, the text before it is released and the
// rest dropped. Input and output are whole UTF-8 characters.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace nq::router {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);

  // Appends `text`; returns what may be emitted now. After a match, returns the text up to
  // the stop string and ignores further input.
  std::string Feed(std::string_view text);
  // The end of the stream: releases held text (no match is possible any more).
  std::string Flush();
  bool matched() const { return matched_; }
  const std::string& matched_stop() const { return matched_stop_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool matched_ = false;
  std::string matched_stop_;
};

}  // namespace nq::router
