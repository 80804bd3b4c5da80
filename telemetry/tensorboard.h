// train.tensorboard: rank 0 writes a TensorBoard event file into the run directory,
// <out_dir>/events.out.tfevents.<unix time>.<host>, holding metrics.jsonl's numbers as scalars
// (tags are its keys: "loss", "tok_s", "val_loss", "moe_gini/h.3"; telemetry/metrics.h
// step_scalars) and the resolved config as text ("config"). `tensorboard --logdir runs/` then
// compares runs; `wandb sync` reads the same files.
//
// The design choices: the few protobuf fields an event of scalars and text needs (TensorFlow's
// event.proto and summary.proto: Event, Summary.Value, SummaryMetadata.PluginData, TensorProto,
// SessionLog) are encoded here by hand, with TensorFlow's field numbers, rather than with
// Debian's protobuf: protoc would be a build-time program on every machine that builds kiln,
// GPU hosts built from the offline bundle (scripts/offline_deps.sh) included, for some 60 lines
// of varints. TensorBoard's own reader checks the encoding in CI (tests/tensorboard_test.cpp).
// The TFRecord framing and its CRC32C are telemetry/tfrecord.h. A record is written and flushed per
// step on rank 0 after the step's values are on the host, as metrics.jsonl's line is: nothing is
// added to the device's step. A resumed run starts a new file with a SessionLog START at its first
// step, which makes TensorBoard drop the earlier file's events from that step on (those steps are
// retrained).
#pragma once

#include <optional>
#include <string>

#include "base/durable_write.h"
#include "telemetry/metrics.h"

namespace kiln {

class TensorBoardWriter {
 public:
  // Creates the event file in `out_dir` and writes its header record (and, for a run resumed
  // after `resumed_at` steps, the START that supersedes later steps). InputError naming
  // train.tensorboard and the path where it cannot.
  TensorBoardWriter(const std::string& out_dir, std::optional<int> resumed_at);

  // An event the disk refuses (a full disk) is held and written later (AppendLog), so the file
  // stays whole records; finish() says if any never were.
  // One event at m.step holding every value of step_scalars(m).
  void write_step(const StepMetrics& m);
  // A text summary (TensorBoard's text plugin renders it as Markdown) at `step`.
  void write_text(const std::string& tag, const std::string& markdown, int step);
  const std::string& path() const { return log_.path(); }
  // At the run's end: InputError naming the file if events are still held.
  void finish() { log_.finish(); }

 private:
  void write_record(const std::string& event);

  AppendLog log_;
};

}  // namespace kiln
