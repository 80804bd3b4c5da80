// NodeGroup: how the node launchers of one job agree, through the store node 0 hosts, on who is
// which node, which generation of workers runs, whether it failed and why, and when every node is
// done. launch_workers() (dist/launcher.cpp) drives it; on one node it is the same protocol with
// nobody else to wait for.
//
// The design choice that matters: every decision is a key in the store, written once, so every
// launcher reads the same answer. A generation's first failure wins (`failed`, guarded by an
// add), every launcher builds the restart history from those keys, and a launcher that joins
// generation g+1 has torn its workers of g down first, so "every node joined g+1" is also "every
// node acknowledged the restart". A launcher other than node 0 keeps a second connection open
// whose closing makes the store mark it gone (set_on_close) and whose heartbeat node 0 watches;
// node 0 turns a gone launcher into its generation's failure. Keys (P = generation_prefix(g)):
//
//   launcher/node/N               claim counter: each launcher for node N takes a number C
//   launcher/takeover/N/A         add == 1 elects the one launcher that replaces claim A (0: none)
//   launcher/claim/N              the claim now holding node N
//   launcher/heartbeat/N/C        counter, +1 a second; "closed" when its connection closes,
//                                 "stale" when node 0 saw no beat for heartbeat_timeout
//   launcher/gen_of/N/C           the latest generation claim C joined
//   launcher/nproc_per_node/N, launcher/max_restarts/N   checked against node 0's
//   launcher/bye                  nodes that saw the job end (node 0 serves until all have)
//   P launcher/joined, P launcher/joined/N, P launcher/all_joined     the generation's meeting
//   P failures, P failed          the generation's first failure: its cause
//   P stopped                     the signal of a stop (SIGINT, SIGTERM, SIGUSR1 to a launcher
//                                 or a worker), set before failed: nobody restarts
//   P launcher/done, P launcher/done/N, P launcher/all_done           whose workers succeeded
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dist/launcher.h"
#include "dist/store.h"

namespace kiln {

class NodeGroup {
 public:
  // `store`: this launcher's connection; `run_token` opens the heartbeat's own. `interrupted`:
  // true once the launcher got SIGINT/SIGTERM (long waits give up then).
  NodeGroup(const LaunchConfig& cfg, StoreClient& store, std::string run_token,
            std::function<bool()> interrupted);
  ~NodeGroup();
  NodeGroup(const NodeGroup&) = delete;
  NodeGroup& operator=(const NodeGroup&) = delete;

  // Claims --node-rank, as a replacement where the launcher that held it is gone (InputError
  // where it is alive), and starts the heartbeat (or, on node 0, the watch over the others).
  // Returns the generation to join first: 0, or for a replacement the one the job is at.
  int join();

  // Meets every node's launcher for generation g. False where g failed before every node came
  // (a launcher went meanwhile): the caller treats it as g's failure. InputError on a timeout,
  // an interruption, or a node whose --nproc-per-node or --max-restarts differ from node 0's.
  bool meet(int g);

  // Records `cause` as g's failure unless another was recorded first.
  void publish_failure(int g, const std::string& cause);
  // Records that generation g was stopped by `signal` (then its failure): no node restarts it.
  void publish_stop(int g, int signal, const std::string& cause);
  // g's recorded failure, if any (throws where the store is lost).
  std::optional<std::string> failure(int g);
  // The signal that stopped generation g, 0 if none did.
  int stop_signal(int g);
  // The restarts before generation g: restart k+1 is generation k's failure.
  std::vector<RestartRecord> restarts_before(int g);

  // This node's workers of generation g all succeeded. Returns true when every node's did
  // (the job is done), false when g failed elsewhere. Node 0, and every node when restarts are
  // on, waits for the verdict (bounded by the rendezvous timeout).
  bool finish(int g);

  // Why this launcher lost the store or was counted as gone (heartbeat thread); empty if not.
  std::string lost() const;

 private:
  std::string wait_until_gone(int claim);
  void heartbeat_loop(std::unique_ptr<StoreClient> client, std::string key);
  void watch_loop(std::unique_ptr<StoreClient> client);
  // Polls `done` every 100 ms until it holds (true) or `limit` passes (false); InputError
  // naming `what` where the launcher is interrupted or has lost the store.
  bool wait_until(const std::function<bool()>& done, std::chrono::milliseconds limit,
                  const std::string& what);

  const LaunchConfig& cfg_;
  StoreClient& store_;
  std::string token_;
  std::function<bool()> interrupted_;
  int claim_ = 0;
  int first_meeting_ = -1;
  std::atomic<bool> stop_thread_{false};
  std::thread thread_;
  mutable std::mutex mu_;
  std::string lost_;
};

}  // namespace kiln
