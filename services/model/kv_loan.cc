#include "services/model/kv_loan.h"

namespace nq::model {

const char* KvCachePartName(KvCachePart part) {
  switch (part) {
    case KvCachePart::kLatent:
      return "latent";
    case KvCachePart::kRopeKey:
      return "rope key";
    case KvCachePart::kIndexKeys:
      return "indexer keys";
  }
  return "?";
}

KvLoan::KvLoan(KvLoan&& other) noexcept
    : state_(std::move(other.state_)), from_token_(other.from_token_), records_(std::move(other.records_)) {
  other.state_.reset();
  other.records_.clear();
}

KvLoan& KvLoan::operator=(KvLoan&& other) noexcept {
  if (this != &other) {
    Return();
    state_ = std::move(other.state_);
    from_token_ = other.from_token_;
    records_ = std::move(other.records_);
    other.state_.reset();
    other.records_.clear();
  }
  return *this;
}

void KvLoan::Return() {
  if (state_ == nullptr) return;
  state_->lent_from.reset();
  state_->records = 0;
  state_.reset();
  records_.clear();
}

}  // namespace nq::model
