// The embedded default model and its NestQuant release for a test suite, made by
// scripts/embedded_model.sh: the script prepares them once per machine under a lock, so every test
// process (ctest runs each test alone) may ask and the later ones find them ready.
#pragma once

#include <cstdlib>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"

namespace nq::testing {

// From SetUpTestSuite, inside ASSERT_NO_FATAL_FAILURE: a failed preparation ends the suite's setup.
// The arguments are the test target's NQ_TOOL_BIN, NQ_SOURCE_DIR and NQ_EMBEDDED_MODEL_DIR.
inline void PrepareEmbeddedModel(const std::string& tool_bin, const std::string& source_dir,
                                 const std::string& model_dir) {
  const std::string command =
      absl::StrCat("NQ_BIN=", tool_bin, " bash ", source_dir, "/scripts/embedded_model.sh ", model_dir, " > /dev/null");
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
}

// PrepareEmbeddedModel, then *backend = a CPU backend for the suite's models to load on, released
// (the suite keeps it for the process, beside the models that hold it). Same use as above.
inline void PrepareEmbeddedModelOnCpu(const std::string& tool_bin, const std::string& source_dir,
                                      const std::string& model_dir, kernels::Backend** backend) {
  ASSERT_NO_FATAL_FAILURE(PrepareEmbeddedModel(tool_bin, source_dir, model_dir));
  absl::StatusOr<std::unique_ptr<kernels::Backend>> created = kernels::CreateBackend("cpu");
  ASSERT_TRUE(created.ok()) << created.status();
  *backend = created->release();
}

}  // namespace nq::testing
