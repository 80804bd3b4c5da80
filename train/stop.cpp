#include "train/stop.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "dist/store.h"

namespace kiln {

namespace {

// A signal handler can reach nothing but globals: the first signal, and the pipe that wakes the
// watchdog. Only one StopSignals exists at a time.
volatile sig_atomic_t g_first_signal = 0;
volatile sig_atomic_t g_wake_fd = -1;
std::atomic<bool> g_installed{false};

constexpr int kStopSignals[] = {SIGTERM, SIGINT, SIGUSR1};
// Bytes on the pipe besides signal numbers (all below 64): wake the watchdog to see
// disarm/quit.
constexpr unsigned char kWake = 0xff;

void on_stop_signal(int sig) {
  const int saved_errno = errno;
  if (g_first_signal == 0) g_first_signal = sig;
  const unsigned char byte = static_cast<unsigned char>(sig);
  const ssize_t ignored = ::write(g_wake_fd, &byte, 1);  // full pipe: the flag is enough
  (void)ignored;
  errno = saved_errno;
}

sigset_t stop_set() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : kStopSignals) sigaddset(&set, sig);
  return set;
}

struct sigaction g_old_actions[3];
sigset_t g_old_mask;
std::atomic<bool> g_disarmed{false}, g_quit{false};

const char* kRequestedKey = "train/stop/requested";  // "<signal> <rank>"
const char* kAtKey = "train/stop/at";                // "<step> <signal> <rank>"

}  // namespace

std::string stop_signal_name(int sig) {
  switch (sig) {
    case SIGTERM:
      return "SIGTERM";
    case SIGINT:
      return "SIGINT";
    case SIGUSR1:
      return "SIGUSR1";
    default:
      return "signal " + std::to_string(sig);
  }
}

void log_stop_agreed(const StopPoint& stop, int world_size, int max_steps) {
  const std::string what =
      stop_signal_name(stop.signal) +
      (world_size > 1 ? " (rank " + std::to_string(stop.rank) + ")" : std::string());
  if (stop.step >= max_steps)
    spdlog::info("{}: the run ends at step {} (train.max_steps) before it could stop; finishing it",
                 what, max_steps);
  else if (world_size > 1)
    spdlog::info("{}: every rank saves at step {} and stops", what, stop.step);
}

void log_stopped(const StopPoint& stop, const TrainSection& t) {
  const std::string sig = stop_signal_name(stop.signal);
  if (!t.save_checkpoints)
    spdlog::warn("stopped by {} at step {} of {}: no checkpoint (train.save_checkpoints=false)",
                 sig, stop.step, t.max_steps);
  else
    spdlog::warn("stopped by {} at step {} of {}: checkpoint saved in {}/checkpoints; {}", sig,
                 stop.step, t.max_steps, t.out_dir,
                 t.resume == "auto"
                     ? "run the same command to resume from it"
                     : "resume with --train.resume=auto (train.resume is " + t.resume + ")");
}

int stop_signal_received() {
  return g_first_signal;
}

StopSignals::StopSignals(std::chrono::seconds grace, bool exit_on_second)
    : grace_(grace), exit_on_second_(exit_on_second) {
  if (g_installed.exchange(true)) throw std::logic_error("StopSignals: one at a time");
  if (::pipe2(pipe_, O_CLOEXEC | O_NONBLOCK) != 0)
    throw std::runtime_error(std::string("StopSignals: pipe2: ") + std::strerror(errno));
  g_first_signal = 0;
  g_disarmed = false;
  g_quit = false;
  g_wake_fd = pipe_[1];
  // Blocked here, so in every thread started from now on; the watchdog unblocks them for itself.
  const sigset_t set = stop_set();
  pthread_sigmask(SIG_BLOCK, &set, &g_old_mask);
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sa.sa_mask = set;
  sa.sa_flags = SA_RESTART;
  for (size_t i = 0; i < std::size(kStopSignals); ++i)
    sigaction(kStopSignals[i], &sa, &g_old_actions[i]);
  watchdog_ = std::thread([this] { watch(); });
}

StopSignals::~StopSignals() {
  g_quit = true;
  const unsigned char byte = kWake;
  const ssize_t ignored = ::write(pipe_[1], &byte, 1);
  (void)ignored;
  watchdog_.join();
  for (size_t i = 0; i < std::size(kStopSignals); ++i)
    sigaction(kStopSignals[i], &g_old_actions[i], nullptr);
  pthread_sigmask(SIG_SETMASK, &g_old_mask, nullptr);
  g_wake_fd = -1;
  ::close(pipe_[0]);
  ::close(pipe_[1]);
  g_installed = false;
}

void StopSignals::disarm() {
  g_disarmed = true;
  const unsigned char byte = kWake;
  const ssize_t ignored = ::write(pipe_[1], &byte, 1);
  (void)ignored;
}

void StopSignals::watch() {
  const sigset_t set = stop_set();
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  using Clock = std::chrono::steady_clock;
  int first = 0;
  Clock::time_point deadline{};
  while (!g_quit) {
    int timeout_ms = -1;
    if (first != 0 && !g_disarmed) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      timeout_ms = static_cast<int>(std::max<int64_t>(0, left.count()));
    }
    pollfd p{pipe_[0], POLLIN, 0};
    const int rc = ::poll(&p, 1, timeout_ms);
    if (rc < 0) continue;  // EINTR: a handler ran on this thread; its byte is on the pipe
    if (rc == 0) {
      if (g_disarmed || g_quit) continue;
      spdlog::error(
          "{} came {} s ago (train.term_grace_s) and the run has not stopped (a step "
          "or the save is stuck, e.g. in a collective): exiting now without a new "
          "checkpoint; the newest complete one is intact",
          stop_signal_name(first), grace_.count());
      ::_exit(128 + first);
    }
    unsigned char bytes[64];
    const ssize_t n = ::read(pipe_[0], bytes, sizeof bytes);
    for (ssize_t i = 0; i < n; ++i) {
      const int sig = bytes[i];
      if (sig == kWake) continue;
      if (first == 0) {
        first = sig;
        deadline = Clock::now() + grace_;
        if (!g_disarmed)
          spdlog::info(
              "{}: saving a checkpoint at the next step boundary, then exiting "
              "(within train.term_grace_s={} s{})",
              stop_signal_name(sig), grace_.count(),
              exit_on_second_ ? "; a second SIGINT or SIGTERM exits at once" : "");
      } else if (exit_on_second_ && sig != SIGUSR1) {
        spdlog::warn(
            "a second stop signal ({}): exiting now without a new checkpoint; the "
            "newest complete one is intact",
            stop_signal_name(sig));
        ::_exit(128 + sig);
      }
    }
  }
}

StopAgreement::StopAgreement(StoreClient* store, int rank, int world_size,
                             std::function<int()> own_signal)
    : store_(store), rank_(rank), world_size_(world_size), own_signal_(std::move(own_signal)) {
  if (world_size > 1 && store == nullptr)
    throw std::logic_error("StopAgreement: " + std::to_string(world_size) +
                           " ranks need the rendezvous store");
}

namespace {

// A store value of `n` integers, or an error naming the key.
std::vector<int> parse_ints(const std::string& key, const std::string& value, size_t n) {
  std::istringstream in(value);
  std::vector<int> out(n);
  for (int& v : out)
    if (!(in >> v))
      throw std::runtime_error("store key '" + key + "': malformed value '" + value + "'");
  return out;
}

}  // namespace

std::optional<StopPoint> StopAgreement::poll(int steps_enqueued) {
  if (agreed_) return agreed_;
  const int own = own_signal_();
  if (world_size_ == 1) {
    if (own != 0) agreed_ = StopPoint{steps_enqueued, own, rank_};
    return agreed_;
  }
  if (rank_ == 0) {
    StopPoint p{steps_enqueued + kStopMargin, own, 0};
    if (own == 0) {
      if (!store_->check({kRequestedKey})) return std::nullopt;
      const std::vector<int> v = parse_ints(kRequestedKey, store_->get(kRequestedKey), 2);
      p.signal = v[0];
      p.rank = v[1];
    }
    store_->set(kAtKey, std::to_string(p.step) + " " + std::to_string(p.signal) + " " +
                            std::to_string(p.rank));
    agreed_ = p;
    return agreed_;
  }
  if (own != 0 && !requested_) {
    store_->set(kRequestedKey, std::to_string(own) + " " + std::to_string(rank_));
    requested_ = true;
  }
  if (!store_->check({kAtKey})) return std::nullopt;
  const std::vector<int> v = parse_ints(kAtKey, store_->get(kAtKey), 3);
  if (v[0] < steps_enqueued)
    throw std::logic_error("rank " + std::to_string(rank_) + " has enqueued " +
                           std::to_string(steps_enqueued) + " steps, past the agreed stop at " +
                           std::to_string(v[0]) + " (train/stop.h: kStopMargin too small)");
  agreed_ = StopPoint{v[0], v[1], v[2]};
  return agreed_;
}

}  // namespace kiln
