// A step's inputs on the device: the tokens and targets of all grad_accum micro-batches
// ([accum, B, T] i32 each) and the step's lr and number (in the optimizer's sched tensor),
// copied from pinned host memory (Backend::copy_from_host_async) before the step's work is
// enqueued and outside any graph, so a captured step reads them at fixed addresses. The host
// fills one upload slot while the stream may still copy from the other. With document masking
// the micro-batches' key starts and RoPE positions ([accum, B, T] i32 each) travel the same
// way, at fixed shapes and addresses; the host also counts each micro-batch's documents
// (cuDNN's attention runs each as a batch entry of its own).
// Under context parallelism (model/context_parallel.h) the loader still reads whole windows; a
// rank keeps its rows of each, and uploads every row's position in the window (RoPE's input,
// restarting per document with document_positions) and its key start in window positions.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "data/loader.h"
#include "kernels/arena.h"
#include "model/context_parallel.h"
#include "model/layers/layer.h"
#include "model/model.h"
#include "telemetry/nvtx.h"

namespace kiln {

// The training data the config names (data.train, or data.sources' mixture) for batch rank `rank`
// of `ranks` (the ranks that share a sequence or a layer's matrices read the same batch), in
// windows of the model's seq_len. `log`: say whether document masking is on.
std::unique_ptr<DataLoader> open_train_data(const Config& cfg, const ModelConfig& model, int rank,
                                            int ranks, bool log);

// The loader of the data section's `key` (data.train, data.val) for this rank: a glob or shard
// it cannot read is an InputError naming the key. document_separator: DataLoader's (-1: none).
std::unique_ptr<DataLoader> open_data(const char* key, const std::string& glob, int B, int T,
                                      int rank, int world_size, int vocab_size, bool shuffle,
                                      uint64_t seed, bool prefetch, int document_separator);
// The same for data.sources: a weighted mixture of the sources' train globs.
std::unique_ptr<DataLoader> open_mixture(const std::vector<LoaderSource>& sources, int B, int T,
                                         int rank, int world_size, int vocab_size, bool shuffle,
                                         uint64_t seed, bool prefetch, int document_separator);

// Which document-mask inputs a run uploads (data.document_mask, data.document_positions).
struct DocumentInputs {
  bool key_start = false;  // attention within each document
  bool positions = false;  // RoPE positions restarting at each document
};

// RoPE positions from a batch's document starts: positions[i] = i % T - doc_start[i].
void document_positions(const std::vector<int32_t>& doc_start, int T, int32_t* positions);

class StepInputs {
 public:
  // T: the loader's window; cp (ranks and rank only): the rows of it this rank keeps, T/ranks.
  StepInputs(Backend& backend, int grad_accum, int B, int T, DocumentInputs docs = {},
             ContextParallel cp = {});
  StepInputs(const StepInputs&) = delete;
  StepInputs& operator=(const StepInputs&) = delete;
  ~StepInputs();

  // The device buffers, into the state arena; allocate_staging() once it is allocated.
  void plan(Arena& arena);
  void allocate_staging();
  // Copies step `step`'s batches from `loader` and its lr and 1-based number into
  // sched[kSchedLr, kSchedStep]. `wait`: the host waits until the stream has made the copies
  // (data.prefetch=false, the loader without overlap). Returns the seconds spent waiting for
  // the loader's batches (the /metrics endpoint's kiln_data_wait_seconds).
  double stage(int step, double lr, DataLoader& loader, Tensor sched, const Nvtx& nvtx, bool wait);

  // Copies one batch into micro-batch 0 and waits (evaluation).
  void copy_batch(const DataLoader::Batch& batch);

  // Tokens a micro-batch holds on this rank: B x its rows of the window.
  int64_t rows() const { return int64_t{B_} * T_; }
  // Micro-batch `micro`'s [B, T] view of the tokens and targets (evaluation writes micro 0).
  Tensor tokens(int micro) const { return micro_batch(tokens_, micro); }
  Tensor targets(int micro) const { return micro_batch(targets_, micro); }
  // Its document mask: undefined tensors where document masking (or its positions) is off.
  // (Under context parallelism positions are always defined.) The count of documents is the
  // last staged batch's, for the step being enqueued.
  DocumentMask documents(int micro) const {
    return {key_start_.defined() ? micro_batch(key_start_, micro) : Tensor{},
            positions_.defined() ? micro_batch(positions_, micro) : Tensor{},
            documents_[static_cast<size_t>(micro)]};
  }

 private:
  Tensor micro_batch(Tensor all, int micro) const {
    return all.slice(micro * static_cast<int64_t>(B_) * T_, {B_, T_});
  }
  // Per upload slot, one Backend::allocate_host block: tokens, targets, then lr and step, then
  // (document masking) the key starts and positions.
  struct Staging {
    void* memory = nullptr;
    int32_t* tokens = nullptr;
    int32_t* targets = nullptr;
    float* sched = nullptr;
    int32_t* key_start = nullptr;
    int32_t* positions = nullptr;
  };
  // Micro-batch `micro`'s rows of `batch` into the slot's host buffers, and its documents
  // counted.
  void copy_rows(const Staging& st, int micro, const DataLoader::Batch& batch);
  // How many documents the rows of key starts `rows` ([B, T_]) hold: runs of equal key starts
  // in a row, and under context parallelism in each of its two chunks (attention's entries).
  int64_t count_documents(const int32_t* rows) const;
  // The loader's batch has B windows of model.seq_len (and their document starts where masked).
  void check(const DataLoader::Batch& batch) const;
  // Where this rank's row t of each window sits in it (t without context parallelism).
  int64_t position(int64_t t) const;
  // This rank's rows of the B windows `windows` ([B, window]) into out ([B, T_]).
  void take_rows(const int32_t* windows, int32_t* out) const;
  // Each of this rank's rows' RoPE position: its position in the window, or from its
  // document's start where positions restart per document.
  void row_positions(const DataLoader::Batch& batch, int32_t* out) const;

  Backend& backend_;
  int accum_, B_, T_;  // T_: the rows of a window this rank holds
  int window_;
  DocumentInputs docs_;     // what is uploaded
  bool restart_positions_;  // positions restart per document (else: rows' window positions)
  ContextParallel cp_;
  Tensor tokens_, targets_;
  Tensor key_start_, positions_;  // document masking only
  std::vector<int64_t> documents_;  // per micro-batch
  Staging staging_[Backend::kUploadSlots];
};

}  // namespace kiln
