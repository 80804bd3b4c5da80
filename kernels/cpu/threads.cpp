// How many OpenMP threads the CPU backend's ops run on. libgomp starts one thread per CPU of the
// affinity mask, whatever a container's CPU quota allows and however many processes of one run
// share the node (a launcher's ranks, each starting as many). More threads than CPUs is costly
// here beyond the lost share: every op is a parallel region ending in a barrier, a barrier waits
// for whichever thread was descheduled, and the threads already there spin, taking CPU from the
// one still working. So the default is the CPUs this process may really use, shared among the
// node's processes; OMP_NUM_THREADS still decides when it is set. Other processes' load is
// what no count read at start can know: on a 2-core machine loaded by other builds, sampling
// configs/tiny.yaml's model ran 4-5x slower on 2 threads than on 1, so `sample` keeps a model
// that small on one thread (tools/sample.cpp).
#include "kernels/cpu/threads.h"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>

namespace kiln {

namespace {

// The CPU quota of this process's cgroup in CPUs (rounded up), 0 where there is none: cgroup
// v2's cpu.max ("max 100000" or "200000 100000"), else v1's cfs quota and period.
int cgroup_cpu_quota() {
  std::ifstream v2("/sys/fs/cgroup/cpu.max");
  std::string quota;
  double period = 0;
  if (v2 >> quota >> period) {
    if (quota == "max" || period <= 0) return 0;
    return static_cast<int>(std::ceil(std::stod(quota) / period));
  }
  std::ifstream q("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), p("/sys/fs/cgroup/cpu/cpu.cfs_period_us");
  double us = 0;
  if (q >> us && p >> period && us > 0 && period > 0)
    return static_cast<int>(std::ceil(us / period));
  return 0;
}

}  // namespace

int usable_cpus() {
  int cpus = 0;
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof(mask), &mask) == 0) cpus = CPU_COUNT(&mask);
  if (cpus <= 0) cpus = omp_get_num_procs();
  const int quota = cgroup_cpu_quota();
  if (quota > 0) cpus = std::min(cpus, quota);
  return std::max(cpus, 1);
}

int set_cpu_threads(int processes, int at_most) {
  const char* env = std::getenv("OMP_NUM_THREADS");
  if (env && *env) return omp_get_max_threads();
  const int threads = std::max(1, std::min(at_most, usable_cpus() / std::max(processes, 1)));
  omp_set_num_threads(threads);
  return threads;
}

}  // namespace kiln
