// The keys another key can leave unread (docs/config.md, "Keys that do nothing"): the table the
// config's reading refuses or warns by (config/config.cpp, check_key_use) and config_to_yaml()
// comments out by, and what a config built around a model from elsewhere does with them.
#include <algorithm>

#include "config/config_schema.h"

namespace kiln {

namespace {

bool no_validation_data(const Config& c) {
  if (c.data.sources.empty()) return c.data.val.empty();
  return std::none_of(c.data.sources.begin(), c.data.sources.end(),
                      [](const DataSource& s) { return !s.val.empty(); });
}

std::string rope_scaling_name(const Config& c) {
  return c.model.rope_scaling.type.empty() ? "none" : c.model.rope_scaling.type;
}

// Every key of `section` but `except`, in schema order.
std::vector<std::string> section_keys(const char* section, const char* except) {
  std::vector<std::string> keys;
  for (const Field& f : schema())
    if (std::string(f.section) == section && std::string(f.key) != except) keys.push_back(f.path());
  return keys;
}

}  // namespace

// docs/config.md, "Keys that do nothing": the table the Resolver refuses or warns by, and
// config_to_yaml() comments out by. A key in two rows is judged by the first that applies.
const std::vector<KeyUse>& key_uses() {
  static const std::vector<KeyUse> rules = {
      {section_keys("moe", "n_experts"), "moe.n_experts",
       [](const Config& c) { return c.model.moe.n_experts == 0; },
       [](const Config&) -> std::string { return "moe.n_experts is 0"; },
       " (a dense model reads no other moe key)"},
      {{"dist.expert_parallel"},
       "moe.n_experts",
       [](const Config& c) { return c.model.moe.n_experts == 0; },
       [](const Config&) -> std::string { return "moe.n_experts is 0"; },
       " (the model has no MoE blocks to spread)"},
      {{"dist.tensor_parallel_chunks"},
       "dist.tensor_parallel",
       [](const Config& c) { return c.dist.tensor_parallel == 1; },
       [](const Config&) -> std::string { return "dist.tensor_parallel is 1"; },
       " (no tensor group exchanges anything)"},
      {{"dist.data_replicate"},
       "dist.strategy",
       [](const Config& c) { return c.dist.strategy == "ddp"; },
       [](const Config&) -> std::string { return "dist.strategy is ddp"; },
       " (ddp replicates everything already: set zero1 or fsdp to shard within each replica)"},
      {{"moe.bias_update_rate"},
       "moe.balance",
       [](const Config& c) { return c.model.moe.balance != MoeBalance::bias; },
       [](const Config& c) { return "moe.balance is " + enum_name(c.model.moe.balance); },
       " (only moe.balance: bias reads it)"},
      {{"model.rope_theta", "model.rope_scaling", "model.rope_factor", "model.rope_low_freq_factor",
        "model.rope_high_freq_factor", "model.rope_original_max_position"},
       "model.positions",
       [](const Config& c) { return c.model.positions != PositionKind::rope; },
       [](const Config& c) { return "model.positions is " + enum_name(c.model.positions); },
       " (only model.positions: rope reads the RoPE keys)"},
      {{"model.rope_factor", "model.rope_low_freq_factor", "model.rope_high_freq_factor",
        "model.rope_original_max_position"},
       "model.rope_scaling",
       [](const Config& c) { return c.model.rope_scaling.type != "llama3"; },
       [](const Config& c) { return "model.rope_scaling is " + rope_scaling_name(c); },
       " (only model.rope_scaling: llama3 reads it)"},
      {{"data.document_separator", "data.document_positions"},
       "data.document_mask",
       [](const Config& c) { return !c.data.document_mask; },
       [](const Config&) -> std::string { return "data.document_mask is false"; },
       " (nothing reads it)"},
      {{"train.eval_every", "train.eval_steps"},
       "data.val",
       no_validation_data,
       [](const Config& c) -> std::string {
         return c.data.sources.empty() ? "data.val is empty" : "no data.sources entry has a val";
       },
       " (there is no validation data to evaluate)"},
      {{"train.eval_steps"},
       "train.eval_every",
       [](const Config& c) { return c.train.eval_every == 0; },
       [](const Config&) -> std::string { return "train.eval_every is 0"; },
       " (no evaluation)"},
      {{"train.checkpoint_every", "train.keep_checkpoints", "train.checkpoint_async"},
       "train.save_checkpoints",
       [](const Config& c) { return !c.train.save_checkpoints; },
       [](const Config&) -> std::string { return "train.save_checkpoints is false"; },
       " (no checkpoint is written)"},
      {{"train.sample_tokens"},
       "train.sample_every",
       [](const Config& c) { return c.train.sample_every == 0; },
       [](const Config&) -> std::string { return "train.sample_every is 0"; },
       " (no sample is printed)"},
      {{"train.recompute_full_blocks"},
       "train.recompute",
       [](const Config& c) { return c.train.recompute == "full"; },
       [](const Config&) -> std::string { return "train.recompute is full"; },
       ": every block recomputes fully already"},
      {{"train.metrics_address"},
       "train.metrics_port",
       [](const Config& c) { return c.train.metrics_port == 0; },
       [](const Config&) -> std::string { return "train.metrics_port is 0"; },
       " (nothing listens)"},
      {{"optim.muon_momentum", "optim.muon_ns_steps", "optim.muon_lr_scale",
        "optim.muon_exchange_mb"},
       "optim.name",
       [](const Config& c) { return c.optim.name != "muon"; },
       [](const Config& c) { return "optim.name is " + c.optim.name; },
       " (only Muon reads it)"},
      {{"optim.muon_exchange_mb"},
       "dist.strategy",
       [](const Config& c) { return c.dist.strategy == "ddp"; },
       [](const Config&) -> std::string { return "dist.strategy is ddp"; },
       " (each rank holds every momentum: only zero1 and fsdp send the matrices to owners)"},
      {{"optim.min_lr"},
       "optim.schedule",
       [](const Config& c) { return c.optim.schedule == "constant"; },
       [](const Config&) -> std::string { return "optim.schedule is constant"; },
       " (the learning rate never decays)"},
      {section_keys("fp8", ""), "precision.fp8", [](const Config& c) { return !c.precision.fp8; },
       [](const Config&) -> std::string { return "precision.fp8 is false"; },
       " (only FP8 runs read the fp8 keys)"},
      {{"fp8.all_gather"},
       "dist.strategy",
       [](const Config& c) { return c.dist.strategy != "fsdp"; },
       [](const Config& c) { return "dist.strategy is " + c.dist.strategy; },
       " (only fsdp gathers weights a step)"},
      {{"dist.copy_engine_gathers"},
       "dist.strategy",
       [](const Config& c) { return c.dist.strategy == "ddp"; },
       [](const Config&) -> std::string { return "dist.strategy is ddp"; },
       " (it gathers nothing; the key applies to zero1 and fsdp)"},
      // dev/dist_scaling.sh and dev/ddp_diag.sh give every strategy of a sweep the same
      // flags (EXTRA, FLAGS_tag): refusing would end the sweep at its first zero1 run.
      {{"dist.bucket_mb", "dist.overlap_ctas"},
       "dist.strategy",
       [](const Config& c) { return c.dist.strategy != "ddp"; },
       [](const Config& c) { return "dist.strategy is " + c.dist.strategy; },
       " (only ddp all-reduces in buckets)",
       true},
  };
  return rules;
}

std::string unused_because(const Config& c, const Field& f) {
  Config value = c, unset;  // non-const: the accessors hand out mutable pointers
  apply_arch(c.model.arch, unset.model);
  const bool is_default = value_to_yaml(f.member(value)) == value_to_yaml(f.member(unset));
  for (const KeyUse& rule : key_uses())
    if (std::find(rule.keys.begin(), rule.keys.end(), f.path()) != rule.keys.end() &&
        rule.unused(c))
      return rule.warn_only && !is_default ? "" : rule.state(c) + rule.note;
  return "";
}

void set_model(Config& config, const ModelConfig& model) {
  config.model = model;
  Config unset;
  apply_arch(model.arch, unset.model);
  for (const Field& f : schema()) {
    const std::string section = f.section;
    if ((section == "model" || section == "moe") && !unused_because(config, f).empty())
      copy_value(f.member(config), f.member(unset));
  }
}

}  // namespace kiln
