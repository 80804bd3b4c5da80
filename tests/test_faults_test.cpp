// Tests for base/test_faults: KILN_FAULT's text (the supervised-restart tests' fault; they run
// it for real in tests/dist_restart_test.cpp).
#include "base/test_faults.h"

#include <gtest/gtest.h>

#include "base/error.h"
#include "tests/input_error.h"

namespace kiln {
namespace {

TEST(FaultHook, ParsesRankStepAndGeneration) {
  Fault f = parse_fault("rank=1,step=5");
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.step, 5);
  EXPECT_EQ(f.generation, 0);  // only the first generation: the resumed run gets past it
  f = parse_fault("step=7,rank=0,restart=2");
  EXPECT_EQ(f.rank, 0);
  EXPECT_EQ(f.step, 7);
  EXPECT_EQ(f.generation, 2);
  EXPECT_EQ(parse_fault("rank=3,step=1,restart=any").generation, -1);
}

TEST(FaultHook, MalformedTextNamesTheVariable) {
  for (const char* bad : {"", "rank=1", "step=2", "rank=x,step=2", "rank=1,step=-2",
                          "rank=1,step=2,when=now", "rank=1,step=2,restart=some"}) {
    const std::string msg = testing::input_error([&] { parse_fault(bad); });
    EXPECT_NE(msg.find("KILN_FAULT='" + std::string(bad) + "'"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace kiln
