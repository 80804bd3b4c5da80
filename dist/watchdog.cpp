// Collective watchdog (see watchdog.h): a heartbeat thread per rank, a progress clock, and a
// verdict from the store when the clock runs past the timeout.
#include "dist/watchdog.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdio>
#include <sstream>
#include <vector>

#include "dist/store.h"

namespace kiln {
namespace {

using Clock = std::chrono::steady_clock;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

struct Beat {
  bool seen = false;
  int64_t beat = -1;
  int steps = -1;
  std::string state;
};

Beat parse_beat(const std::string& v) {
  Beat b;
  std::istringstream in(v);
  if (in >> b.beat >> b.steps >> b.state) b.seen = true;
  return b;
}

}  // namespace

// Forwards every call to the communicator it wraps, noting each collective's name first.
class Watchdog::Watched : public Communicator {
 public:
  Watched(Watchdog& dog, std::unique_ptr<Communicator> inner, bool on_device)
      : dog_(dog), inner_(std::move(inner)), on_device_(on_device) {
    std::lock_guard<std::mutex> lock(dog_.mu_);
    dog_.watched_.insert(this);
    if (on_device_) ++dog_.on_device_;
  }
  ~Watched() override {
    std::lock_guard<std::mutex> lock(dog_.mu_);
    dog_.watched_.erase(this);
    if (on_device_) --dog_.on_device_;
  }
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  void all_reduce_sum(Tensor buf) override {
    note("all_reduce_sum");
    inner_->all_reduce_sum(buf);
  }
  void all_reduce_sum_overlapped(Tensor buf) override {
    note("all_reduce_sum_overlapped");
    inner_->all_reduce_sum_overlapped(buf);
  }
  void all_reduce_max(Tensor buf) override {
    note("all_reduce_max");
    inner_->all_reduce_max(buf);
  }
  void reduce_scatter_sum(Tensor out_shard, Tensor in_full) override {
    note("reduce_scatter_sum");
    inner_->reduce_scatter_sum(out_shard, in_full);
  }
  void all_gather(Tensor out_full, Tensor in_shard) override {
    note("all_gather");
    inner_->all_gather(out_full, in_shard);
  }
  void fill_zero(Tensor buf) override { inner_->fill_zero(buf); }
  void broadcast(Tensor buf, int root) override {
    note("broadcast");
    inner_->broadcast(buf, root);
  }
  void all_to_all(Tensor out, Tensor in) override {
    note("all_to_all");
    inner_->all_to_all(out, in);
  }
  void all_to_all_v(Tensor out, const std::vector<int64_t>& recv_rows, Tensor in,
                    const std::vector<int64_t>& send_rows) override {
    note("all_to_all_v");
    inner_->all_to_all_v(out, recv_rows, in, send_rows);
  }
  void wait() override {
    inner_->wait();
    dog_.progress_ns_ = now_ns();
  }
  uint64_t mark() override { return inner_->mark(); }
  void wait_until(uint64_t mark) override {
    inner_->wait_until(mark);
    dog_.progress_ns_ = now_ns();
  }
  void barrier() override {
    note("barrier");
    dog_.barrier_ns_ = now_ns();
    inner_->barrier();
    dog_.barrier_ns_ = 0;
    dog_.progress_ns_ = now_ns();
  }
  std::string name() const override { return inner_->name(); }
  bool nvlink_joined(std::string* why) const override { return inner_->nvlink_joined(why); }
  void* allocate_shared(size_t bytes) override { return inner_->allocate_shared(bytes); }
  std::string async_error() override { return inner_->async_error(); }
  void abort() override { inner_->abort(); }

 private:
  // A collective issued is progress: the host is not blocked (a step can outlast the timeout;
  // the time between two collectives cannot).
  void note(const char* op) {
    ++issued_;
    dog_.progress_ns_ = now_ns();
    std::lock_guard<std::mutex> lock(dog_.mu_);
    dog_.last_op_ = std::string(op) + " #" + std::to_string(issued_) + " on " + inner_->name();
  }
  Watchdog& dog_;
  std::unique_ptr<Communicator> inner_;
  bool on_device_;
  int64_t issued_ = 0;
};

Watchdog::Watchdog(std::unique_ptr<StoreClient> store, Options options)
    : store_(std::move(store)), opt_(std::move(options)) {
  beat_once();  // visible before the first collective
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::unique_ptr<Communicator> Watchdog::watch(std::unique_ptr<Communicator> inner, bool on_device) {
  return std::make_unique<Watched>(*this, std::move(inner), on_device);
}

void Watchdog::progress(int steps_done, bool host_work) {
  steps_done_ = steps_done;
  host_work_ = host_work;
  progress_ns_ = now_ns();
  armed_ = true;
}

void Watchdog::disarm() {
  armed_ = false;
}

void Watchdog::beat_once() {
  const int64_t beat = ++beat_;
  try {
    store_->set(opt_.key_prefix + "beat/" + std::to_string(opt_.rank),
                std::to_string(beat) + " " + std::to_string(steps_done_.load()) + " " +
                    (host_work_ ? "host" : "step"));
  } catch (const std::exception& e) {
    // The launcher notices a lost store on its own; the beat is only evidence for a verdict.
    if (beat % 30 == 1) spdlog::warn("watchdog rank {}: heartbeat: {}", opt_.rank, e.what());
  }
}

std::string Watchdog::last_collective() {
  std::lock_guard<std::mutex> lock(mu_);
  return last_op_.empty() ? "none yet" : last_op_;
}

std::string Watchdog::describe_peers() {
  auto read_all = [&] {
    std::vector<Beat> beats(static_cast<size_t>(opt_.world_size));
    for (int r = 0; r < opt_.world_size; ++r) {
      const std::string key = opt_.key_prefix + "beat/" + std::to_string(r);
      try {
        if (store_->check({key})) beats[static_cast<size_t>(r)] = parse_beat(store_->get(key));
      } catch (const std::exception&) {
      }
    }
    return beats;
  };
  const std::vector<Beat> first = read_all();
  // Long enough for every live rank to beat at least once more; this rank beats on meanwhile,
  // since its peers may be asking the same question.
  for (int i = 0; i < 2; ++i) {
    std::this_thread::sleep_for(opt_.beat);
    beat_once();
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const std::vector<Beat> second = read_all();
  const auto waited_s = static_cast<double>((opt_.beat * 2).count()) / 1000.0 + 0.2;
  int most = -1;
  for (const Beat& b : second) most = std::max(most, b.steps);
  std::vector<std::string> absent, behind;
  char buf[256];
  for (int r = 0; r < opt_.world_size; ++r) {
    if (r == opt_.rank) continue;
    const Beat &a = first[static_cast<size_t>(r)], &b = second[static_cast<size_t>(r)];
    if (!b.seen) {
      std::snprintf(buf, sizeof(buf), "rank %d (no heartbeat ever: never started or lost)", r);
      absent.emplace_back(buf);
    } else if (a.beat == b.beat) {
      std::snprintf(buf, sizeof(buf),
                    "rank %d (no heartbeat in %.1f s: stopped or dead; last finished step %d)", r,
                    waited_s, b.steps);
      absent.emplace_back(buf);
    } else if (b.steps < most || b.state == "host") {
      std::snprintf(buf, sizeof(buf), "rank %d (alive, %s after step %d)", r,
                    b.state == "host" ? "writing a checkpoint" : "still", b.steps);
      behind.emplace_back(buf);
    }
  }
  std::string out;
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
    return s;
  };
  if (!absent.empty()) out = "did not arrive: " + list(absent);
  if (!behind.empty()) out += (out.empty() ? "" : "; ") + std::string("behind: ") + list(behind);
  if (out.empty())
    out = "every rank is alive and has finished step " + std::to_string(most) +
          " (a device hang, or ranks that issued different collectives)";
  return "rank " + std::to_string(opt_.rank) + " in step " +
         std::to_string(steps_done_.load() + 1) + ": " + out;
}

void Watchdog::fail(const std::string& what) {
  spdlog::error("{}", what);
  // ncclCommAbort releases a device stuck in a collective; bounded, since an abort can itself
  // block on a broken transport.
  auto aborted = std::make_shared<std::atomic<bool>>(false);
  std::thread([this, aborted] {
    std::lock_guard<std::mutex> lock(mu_);
    for (Watched* w : watched_) w->abort();
    *aborted = true;
  }).detach();
  for (int i = 0; i < 30 && !*aborted; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::fflush(nullptr);
  _exit(1);
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, opt_.beat, [&] { return stop_; })) {
    lock.unlock();
    beat_once();
    std::string async;
    {
      std::lock_guard<std::mutex> guard(mu_);
      for (Watched* w : watched_)
        if (async.empty()) async = w->async_error();
    }
    if (!async.empty()) fail("a collective failed: " + async + "; " + describe_peers());
    const int64_t barrier = barrier_ns_.load();
    const auto idle = std::chrono::nanoseconds(now_ns() - progress_ns_.load());
    const auto in_barrier = std::chrono::nanoseconds(barrier != 0 ? now_ns() - barrier : 0);
    const auto limit = opt_.timeout;
    if (armed_ && on_device_ > 0 && ((!host_work_ && idle > limit) || in_barrier > limit))
      fail("no progress for " +
           std::to_string(std::chrono::duration_cast<std::chrono::seconds>(idle).count()) +
           " s (dist.timeout_s; the last collective issued: " + last_collective() + "); " +
           describe_peers());
    lock.lock();
  }
}

}  // namespace kiln
