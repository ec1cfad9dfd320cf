// SIGTERM / SIGINT handling for services: the signals are blocked in every thread and taken
// synchronously by one watcher thread (sigwait), so no work happens in a signal handler.
#pragma once

#include <atomic>
#include <chrono>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"

namespace nq {

class ShutdownSignal {
 public:
  // Blocks SIGTERM and SIGINT for the calling thread and every thread it creates later, so
  // call it first thing in main(), before any library starts threads.
  static absl::Status BlockTerminationSignals();

  // Starts the watcher. Requires BlockTerminationSignals() to have run.
  ShutdownSignal();
  ~ShutdownSignal();
  ShutdownSignal(const ShutdownSignal&) = delete;
  ShutdownSignal& operator=(const ShutdownSignal&) = delete;

  // Blocks until SIGTERM/SIGINT arrives or Trigger() is called.
  void Wait() { notification_.WaitForNotification(); }
  bool triggered() const { return notification_.HasBeenNotified(); }
  // The signal that arrived (0 when triggered programmatically).
  int signal_number() const { return signal_number_; }
  // Starts shutdown without a signal (a fatal error in a background thread, tests).
  void Trigger();

 private:
  void Watch();

  absl::Notification notification_;
  std::atomic<bool> programmatic_{false};
  int signal_number_ = 0;
  std::thread watcher_;
};

}  // namespace nq
