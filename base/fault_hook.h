// A test-only fault: KILN_FAULT="rank=R,step=S[,restart=G]" makes rank R SIGKILL itself right
// after finishing step S (its metrics line written, its checkpoint saved), in restart generation
// G only (default 0, so the resumed run gets past the step; "any": in every generation). The
// supervised-restart tests use it to fail a run at a known point; unset, it costs one getenv.
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

// Called by the trainer after each finished step (1-based); kills this process where the
// fault (read once from KILN_FAULT, with KILN_RESTART_GENERATION) names it.
void fault_hook_after_step(int rank, int step);

}  // namespace kiln
