// The message of the InputError a test expects `f` to throw; "" and a test failure when it
// throws none (another exception fails the test as it escapes).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "base/error.h"

namespace kiln::testing {

template <class F>
std::string input_error(F f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an InputError";
  return "";
}

}  // namespace kiln::testing
