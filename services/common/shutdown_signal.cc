#include "services/common/shutdown_signal.h"

#include <pthread.h>
#include <signal.h>

#include <cstring>
#include <string>

namespace nq {
namespace {

sigset_t TerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}

}  // namespace

absl::Status ShutdownSignal::BlockTerminationSignals() {
  sigset_t set = TerminationSignals();
  if (int rc = pthread_sigmask(SIG_BLOCK, &set, nullptr); rc != 0) {
    return absl::InternalError(std::string("pthread_sigmask: ") + std::strerror(rc));
  }
  return absl::OkStatus();
}

ShutdownSignal::ShutdownSignal() : watcher_([this] { Watch(); }) {}

ShutdownSignal::~ShutdownSignal() {
  Trigger();
  watcher_.join();
}

void ShutdownSignal::Trigger() {
  if (notification_.HasBeenNotified()) return;
  // Wake the watcher with a signal directed at it; it notifies. Using the same path for
  // programmatic shutdown keeps a single writer of notification_.
  programmatic_.store(true);
  pthread_kill(watcher_.native_handle(), SIGTERM);
}

void ShutdownSignal::Watch() {
  sigset_t set = TerminationSignals();
  int sig = 0;
  while (sigwait(&set, &sig) != 0) {
  }
  signal_number_ = programmatic_.load() ? 0 : sig;
  notification_.Notify();
}

}  // namespace nq
