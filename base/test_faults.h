// Faults that tests inject into real runs through the environment: the one interface the product
// has for them, each read once (unset, a fault costs the check of a static). Nothing else in the
// product is there for tests alone.
//   KILN_FAULT="rank=R,step=S[,restart=G|any]": rank R SIGKILLs itself right after finishing
//     step S (its metrics line written, its checkpoint saved), in restart generation G only
//     (default 0, so the resumed run gets past the step; "any": in every generation). The
//     supervised-restart tests fail a run at a known point with it.
//   KILN_TEST_CHECKPOINT_CRASH=STEP:RANK[:fail]: that rank is killed once its shard files of
//     step STEP are written and before its marker, as a crash mid-write would; with `:fail` its
//     write fails there instead, as a full disk would.
//   KILN_TEST_BREAK_CAPTURE (any value): a CUDA graph's capture of the step also does what no
//     capture can hold (a host sync), so the run must fall back to eager steps.
#pragma once

#include <optional>
#include <string>

namespace kiln {

struct Fault {
  int rank = 0;
  int step = 0;
  int generation = 0;  // -1: any
};

// The fault KILN_FAULT's text describes; InputError naming KILN_FAULT where it is malformed.
Fault parse_fault(const std::string& text);

namespace test_faults {

// After each finished step (1-based): kills this process where KILN_FAULT (with
// KILN_RESTART_GENERATION) names it.
void after_step(int rank, int step);
// Once `rank`'s shard files of checkpoint step `step` are written, before its marker:
// KILN_TEST_CHECKPOINT_CRASH's kill, or its failure (std::runtime_error).
void checkpoint_files_written(int step, int rank);
// Whether a step's capture must also do what no capture can hold (KILN_TEST_BREAK_CAPTURE).
bool break_capture();

}  // namespace test_faults
}  // namespace kiln
