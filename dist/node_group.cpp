// NodeGroup (see node_group.h for the protocol and its keys). Every wait polls the store every
// 100 ms and is bounded by the rendezvous timeout; the heartbeat and node 0's watch run on a
// thread of their own, each over its own connection, so a blocked op of the launcher's main
// connection never delays a beat.
#include "dist/node_group.h"

#include <spdlog/spdlog.h>

#include "base/error.h"

namespace kiln {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr auto kBeat = 1s;

std::string key_of(const char* what, int node) {
  return std::string("launcher/") + what + "/" + std::to_string(node);
}
std::string key_of(const char* what, int node, int claim) {
  return key_of(what, node) + "/" + std::to_string(claim);
}

// Sleeps `d` in short slices, returning early (false) once `stop` is set.
bool sleep_unless(const std::atomic<bool>& stop, std::chrono::milliseconds d) {
  const auto until = Clock::now() + d;
  while (Clock::now() < until) {
    if (stop) return false;
    std::this_thread::sleep_for(std::min<Clock::duration>(50ms, until - Clock::now()));
  }
  return !stop;
}

// Why a launcher counts as gone, from its heartbeat key's value.
std::string gone_because(const std::string& beat, std::chrono::seconds timeout) {
  return beat == "closed" ? "its connection to the store closed"
                          : "no heartbeat for " + std::to_string(timeout.count()) + " s";
}

}  // namespace

NodeGroup::NodeGroup(const LaunchConfig& cfg, StoreClient& store, std::string run_token,
                     std::function<bool()> interrupted)
    : cfg_(cfg),
      store_(store),
      token_(std::move(run_token)),
      interrupted_(std::move(interrupted)) {}

NodeGroup::~NodeGroup() {
  stop_thread_ = true;
  if (thread_.joinable()) thread_.join();
}

bool NodeGroup::wait_until(const std::function<bool()>& done, std::chrono::milliseconds limit,
                           const std::string& what) {
  const auto deadline = Clock::now() + limit;
  for (;;) {
    if (done()) return true;
    if (interrupted_()) throw InputError("launcher interrupted while waiting for " + what);
    if (const std::string why = lost(); !why.empty()) throw InputError(why);
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(100ms);
  }
}

// Returns once the launcher holding `claim` of this node is gone (and why); InputError where it
// is alive.
std::string NodeGroup::wait_until_gone(int claim) {
  const int n = cfg_.node_rank;
  const std::string key = key_of("heartbeat", n, claim);
  const std::string first = store_.get(key, 5s);  // set before the claim was published
  std::string now = first;
  const bool gone = wait_until(
      [&] {
        now = store_.get(key, 5s);
        if (now == "closed" || now == "stale") return true;
        if (now != first)
          throw InputError("two launchers claim --node-rank " + std::to_string(n) +
                           ": the one that holds it is alive (its heartbeat advances)");
        return false;
      },
      cfg_.heartbeat_timeout + 10s, "node " + std::to_string(n) + "'s earlier launcher");
  if (!gone)
    throw InputError("two launchers claim --node-rank " + std::to_string(n) +
                     ": the one that holds it neither beats nor was counted as gone");
  const std::string why = gone_because(now, cfg_.heartbeat_timeout);
  spdlog::warn("launcher node {}: taking over from the node's earlier launcher, which is gone ({})",
               n, why);
  return why;
}

int NodeGroup::join() {
  const int n = cfg_.node_rank;
  claim_ = static_cast<int>(store_.add(key_of("node", n), 1));
  if (claim_ > 1 && n == 0) throw InputError("two launchers claim --node-rank 0");
  int held = 0;  // the claim holding node n now: 0 where none does
  std::string gone;
  if (claim_ > 1) {
    // A launcher publishes its claim right after taking its number; give a racing one a moment.
    const std::string claim_key = key_of("claim", n);
    if (wait_until([&] { return store_.check({claim_key}); }, 5s, "the node's claim"))
      held = std::stoi(store_.get(claim_key, 5s));
    if (held > 0) gone = wait_until_gone(held);
  }
  if (store_.add(key_of("takeover", n, held), 1) != 1)
    throw InputError("two launchers claim --node-rank " + std::to_string(n) +
                     (held > 0 ? " (another has already replaced the one that is gone)" : ""));
  const std::string beat = key_of("heartbeat", n, claim_);
  if (cfg_.nnodes > 1 && n != 0) {
    auto client = std::make_unique<StoreClient>(store_.host(), store_.port(), token_, 30s, 30s);
    client->set(beat, "0");
    client->set_on_close(beat, "closed");
    thread_ = std::thread(&NodeGroup::heartbeat_loop, this, std::move(client), beat);
  } else if (cfg_.nnodes > 1) {
    auto client = std::make_unique<StoreClient>(store_.host(), store_.port(), token_, 30s, 30s);
    thread_ = std::thread(&NodeGroup::watch_loop, this, std::move(client));
  }
  store_.set(key_of("claim", n), std::to_string(claim_));
  store_.set(key_of("nproc_per_node", n), std::to_string(cfg_.nproc_per_node));
  store_.set(key_of("max_restarts", n), std::to_string(cfg_.max_restarts));
  if (held == 0) return 0;

  // A replacement joins the newest generation some launcher joined, unless the launcher it
  // replaces was in it: then that generation fails (node 0 sees it gone), and the next is ours.
  int g = 0;
  while (store_.check({generation_prefix(g + 1) + "launcher/joined"})) ++g;
  const std::string gen_of = key_of("gen_of", n, held);
  if (!store_.check({gen_of}) || std::stoi(store_.get(gen_of, 5s)) != g) return g;
  const std::string P = generation_prefix(g);
  // Node 0 records it when it sees the launcher gone; a replacement quicker than its watch
  // records it itself.
  if (!store_.check({P + key_of("done", n)}))
    publish_failure(g, "node " + std::to_string(n) + "'s launcher is gone (" + gone + ")");
  const bool ended = wait_until(
      [&] { return store_.check({P + "failed"}) || store_.check({P + "launcher/all_done"}); },
      cfg_.rendezvous_timeout, "the generation the replaced launcher was in to end");
  if (!ended || !store_.check({P + "failed"}))
    throw InputError("node " + std::to_string(n) + ": the job's generation " + std::to_string(g) +
                     (ended ? " has finished: nothing to rejoin" : " did not end: cannot rejoin"));
  if (stop_signal(g) != 0)
    throw InputError("node " + std::to_string(n) + ": the job was stopped (" +
                     store_.get(P + "failed", 5s) + "): nothing to rejoin");
  return g + 1;
}

bool NodeGroup::meet(int g) {
  const int n = cfg_.node_rank;
  const std::string P = generation_prefix(g);
  store_.set(key_of("gen_of", n, claim_), std::to_string(g));
  store_.set(P + key_of("joined", n), std::to_string(claim_));
  if (store_.add(P + "launcher/joined", 1) == cfg_.nnodes)
    store_.set(P + "launcher/all_joined", "1");
  bool failed = false;
  const bool met = wait_until(
      [&] {
        if (store_.check({P + "launcher/all_joined"})) return true;
        failed = store_.check({P + "failed"});
        return failed;
      },
      cfg_.rendezvous_timeout, "the nodes");
  if (failed) return false;
  if (!met) {
    const std::string joined = store_.get(P + "launcher/joined", 5s);
    const std::string of = " of " + std::to_string(cfg_.nnodes) + " node launchers ";
    const std::string within = " within " + std::to_string(cfg_.rendezvous_timeout.count()) + " s";
    if (g == 0)
      throw InputError("only " + joined + of + "reached the store at " + store_.address() + within);
    throw InputError("only " + joined + of + "came back for restart " + std::to_string(g) + within +
                     " (a node whose launcher is gone needs a new one: the same command with its "
                     "--node-rank)");
  }
  if (first_meeting_ < 0) {
    first_meeting_ = g;
    const std::string node0 = store_.get(key_of("nproc_per_node", 0), 5s);
    if (node0 != std::to_string(cfg_.nproc_per_node))
      throw InputError("--nproc-per-node " + std::to_string(cfg_.nproc_per_node) + " on node " +
                       std::to_string(n) + " differs from node 0's " + node0);
    const std::string restarts0 = store_.get(key_of("max_restarts", 0), 5s);
    if (restarts0 != std::to_string(cfg_.max_restarts))
      throw InputError("--max-restarts " + std::to_string(cfg_.max_restarts) + " on node " +
                       std::to_string(n) + " differs from node 0's " + restarts0);
  }
  return true;
}

void NodeGroup::publish_failure(int g, const std::string& cause) {
  const std::string P = generation_prefix(g);
  if (store_.add(P + "failures", 1) == 1) store_.set(P + "failed", cause);
}

void NodeGroup::publish_stop(int g, int signal, const std::string& cause) {
  store_.set(generation_prefix(g) + "stopped", std::to_string(signal));
  publish_failure(g, cause);
}

std::optional<std::string> NodeGroup::failure(int g) {
  const std::string key = generation_prefix(g) + "failed";
  if (!store_.check({key})) return std::nullopt;
  return store_.get(key, 5s);
}

int NodeGroup::stop_signal(int g) {
  const std::string key = generation_prefix(g) + "stopped";
  return store_.check({key}) ? std::stoi(store_.get(key, 5s)) : 0;
}

std::vector<RestartRecord> NodeGroup::restarts_before(int g) {
  std::vector<RestartRecord> out;
  for (int k = 0; k < g; ++k)
    out.push_back({k + 1, store_.get(generation_prefix(k) + "failed", 5s)});
  return out;
}

bool NodeGroup::finish(int g) {
  const int n = cfg_.node_rank;
  const std::string P = generation_prefix(g);
  store_.set(P + key_of("done", n), "1");
  if (store_.add(P + "launcher/done", 1) == cfg_.nnodes) store_.set(P + "launcher/all_done", "1");
  const bool restarts = cfg_.max_restarts > 0;
  if (cfg_.nnodes == 1 || (n != 0 && !restarts)) return true;
  bool failed = false;
  bool ended = false;
  try {
    ended = wait_until(
        [&] {
          if (store_.check({P + "launcher/all_done"})) return true;
          failed = store_.check({P + "failed"});
          return failed;
        },
        cfg_.rendezvous_timeout, "the other nodes");
  } catch (const InputError& e) {
    spdlog::warn("launcher node {}: after the workers finished: {}", n, e.what());
    return true;
  }
  if (!ended) spdlog::warn("launcher node {}: not every node reported done", n);
  if (failed) return false;
  if (!restarts) return true;
  // Node 0 hosts the store: it serves until every node has seen the end (bounded).
  if (n != 0) {
    store_.add("launcher/bye", 1);
  } else if (!wait_until(
                 [&] {
                   return store_.check({"launcher/bye"}) &&
                          std::stoll(store_.get("launcher/bye", 5s)) >= cfg_.nnodes - 1;
                 },
                 10s, "the other nodes to leave")) {
    spdlog::warn("launcher node 0: not every node saw the job end; closing the store");
  }
  return true;
}

std::string NodeGroup::lost() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lost_;
}

void NodeGroup::heartbeat_loop(std::unique_ptr<StoreClient> client, std::string key) {
  while (sleep_unless(stop_thread_, kBeat)) {
    try {
      client->add(key, 1);
    } catch (const std::exception& e) {
      std::string why = std::string("lost the rendezvous store: ") + e.what();
      try {
        if (client->get(key, 1s) == "stale")
          why = "node 0 counted this launcher as gone (no heartbeat for " +
                std::to_string(cfg_.heartbeat_timeout.count()) + " s)";
      } catch (const std::exception&) {
      }
      std::lock_guard<std::mutex> lock(mu_);
      lost_ = why +
              " (node 0's launcher hosts the store: where it is gone the job cannot "
              "restart)";
      return;
    }
  }
}

// Node 0: every other node's launcher counts as gone when its heartbeat connection closes or
// its heartbeat stops for heartbeat_timeout; that fails the generation it was in, unless its
// workers had finished.
void NodeGroup::watch_loop(std::unique_ptr<StoreClient> c) {
  struct Peer {
    int claim = 0;
    std::string beat;
    Clock::time_point changed;
    bool gone = false;
  };
  std::vector<Peer> peers(static_cast<size_t>(cfg_.nnodes));
  while (sleep_unless(stop_thread_, 250ms)) {
    try {
      for (int n = 1; n < cfg_.nnodes; ++n) {
        Peer& p = peers[static_cast<size_t>(n)];
        const std::string claim_key = key_of("claim", n);
        if (!c->check({claim_key})) continue;
        const int claim = std::stoi(c->get(claim_key, 5s));
        if (claim != p.claim) p = Peer{claim, "", Clock::now(), false};
        if (p.gone) continue;
        const std::string beat_key = key_of("heartbeat", n, claim);
        const std::string beat = c->get(beat_key, 5s);
        std::string why;
        if (beat == "closed" || beat == "stale") {
          why = gone_because(beat, cfg_.heartbeat_timeout);
        } else if (beat != p.beat) {
          p.beat = beat;
          p.changed = Clock::now();
          continue;
        } else if (Clock::now() - p.changed > cfg_.heartbeat_timeout) {
          c->set(beat_key, "stale");
          why = gone_because("stale", cfg_.heartbeat_timeout);
        } else {
          continue;
        }
        p.gone = true;
        const std::string gen_of = key_of("gen_of", n, claim);
        if (!c->check({gen_of})) continue;  // it never joined a generation: nothing ran
        const std::string P = generation_prefix(std::stoi(c->get(gen_of, 5s)));
        if (c->check({P + key_of("done", n)}) || c->check({P + "launcher/all_done"})) continue;
        const std::string cause = "node " + std::to_string(n) + "'s launcher is gone (" + why + ")";
        spdlog::error("launcher node 0: {}", cause);
        if (c->add(P + "failures", 1) == 1) c->set(P + "failed", cause);
      }
    } catch (const std::exception& e) {
      spdlog::warn("launcher node 0: watching the other nodes: {}", e.what());
    }
  }
}

}  // namespace kiln
