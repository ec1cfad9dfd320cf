#include "tests/integration/serving_fixture.h"

namespace nq::testing {

std::string* ServingTest::model_dir_ = nullptr;

}  // namespace nq::testing
