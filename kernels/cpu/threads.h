// The CPU backend's OpenMP thread count: the CPUs a process may really use, shared among the
// processes of one run on its node, unless OMP_NUM_THREADS says (threads.cpp says why).
#pragma once

namespace kiln {

// The CPUs this process may use: its affinity mask, capped by a cgroup CPU quota.
int usable_cpus();
// Sets OpenMP's thread count for `processes` processes of one run sharing this node:
// OMP_NUM_THREADS where it is set, else usable_cpus() / processes, at least 1 and at most
// `at_most` (a caller whose work is too small to share). Returns it.
int set_cpu_threads(int processes = 1, int at_most = 1 << 30);

}  // namespace kiln
