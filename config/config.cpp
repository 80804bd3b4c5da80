// Config loading: YAML file + "section.key=value" overrides -> a typed, validated Config, read
// through the schema (config/schema.cpp: one row per key, pointing at its field). The one design
// choice: every value remembers where it came from (the file's line, or the override), so any
// rule broken later names that origin and the key. The rules between keys are here, but for the
// model's own (model_config_error(), model/model_rules.cpp: one place for the config, make_model
// and the Hugging Face import) and the keys that do nothing (config/key_uses.cpp); a field's
// value as text, and the config written out, are config/config_values.cpp's.
#include "config/config.h"

#include <arpa/inet.h>
#include <spdlog/spdlog.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <set>
#include <sstream>
#include <variant>

#include "base/error.h"
#include "config/config_schema.h"
#include "model/arch.h"

namespace kiln {
namespace {

std::vector<std::string> section_names() {
  std::vector<std::string> names;
  for (const Field& f : schema())
    if (names.empty() || names.back() != f.section) names.push_back(f.section);
  return names;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
      diag = up;
    }
  }
  return row[b.size()];
}

// " (did you mean 'x'?)" for the nearest candidate, or "" when none is close.
std::string did_you_mean(const std::string& name, const std::vector<std::string>& candidates) {
  const std::string* best = nullptr;
  size_t best_distance = std::max<size_t>(2, name.size() / 3) + 1;
  for (const std::string& c : candidates) {
    bool prefix = std::min(name.size(), c.size()) >= 3 &&
                  name.compare(0, c.size(), c, 0, name.size()) == 0;  // "optimizer" ~ "optim"
    size_t d = prefix ? 1 : edit_distance(name, c);
    if (d < best_distance) best = &c, best_distance = d;
  }
  return best ? " (did you mean '" + *best + "'?)" : "";
}

std::string unknown_key_message(const std::string& section, const std::string& key) {
  std::vector<std::string> paths;
  for (const Field& f : schema()) {
    // The right key in the wrong section is the likeliest slip; offer it first.
    if (key == f.key)
      return "unknown key '" + section + "." + key + "' (did you mean '" + f.path() + "'?)";
    paths.push_back(f.path());
  }
  return "unknown key '" + section + "." + key + "'" + did_you_mean(section + "." + key, paths);
}

// Builds a Config and remembers where each field's value came from, so a validation error can
// point at the file line or the override that set the bad value, and when the user gave each
// key: a key is given when the file or an override names it, never by a default or
// model.arch's row.
struct Resolver {
  static constexpr int kNotGiven = -1;
  Config config;
  std::vector<std::string> origin = std::vector<std::string>(schema().size());
  // The layer that last gave each key: 0 the file, k + 1 the k-th override.
  std::vector<int> given_at = std::vector<int>(schema().size(), kNotGiven);
  std::vector<Config> layers;           // the config after the file, and after each override
  std::vector<std::string> layer_from;  // each layer's origin ("override '--x=y'")
  bool stored = false;                  // a run's own resolved config (parse_stored_config)
  std::vector<std::string> warnings;

  // After the file (where = its name) or an override: what the keys given so far turn on.
  void end_layer(const std::string& where) {
    layers.push_back(config);
    layer_from.push_back(where);
  }

  size_t index(const Field& f) const { return &f - schema().data(); }
  FieldPtr get(const Field& f) { return f.member(config); }

  [[noreturn]] void fail(const Field& f, const std::string& what) {
    throw InputError(origin[index(f)] + ": " + f.path() + ": " + what);
  }

  void set(const Field& f, const std::string& text, const std::string& where,
           const std::string& shown) {
    std::string expected = assign(get(f), text);
    if (!expected.empty() && std::holds_alternative<std::vector<DataSource>*>(get(f)))
      throw InputError(where + ": " + f.path() + ": " + expected);
    if (!expected.empty() && std::holds_alternative<EnumRef>(get(f)))
      throw InputError(where + ": " + f.path() + ": must be " + expected + ", got " + shown);
    if (!expected.empty())
      throw InputError(where + ": " + f.path() + ": expected " + expected + ", got " + shown);
    origin[index(f)] = where;
    given_at[index(f)] = static_cast<int>(layers.size());
  }

  void apply_yaml(const YAML::Node& root, const std::string& source) {
    auto where = [&](const YAML::Node& n) {
      return n.Mark().is_null() ? source : source + ":" + std::to_string(n.Mark().line + 1);
    };
    if (root.IsNull()) return;
    if (!root.IsMap())
      throw InputError(where(root) + ": expected a map of sections (model, data, train, ...)");
    std::set<std::string> seen_sections;
    for (const auto& section_entry : root) {
      const YAML::Node& name_node = section_entry.first;
      const YAML::Node& body = section_entry.second;
      std::string section = name_node.IsScalar() ? name_node.Scalar() : "?";
      std::vector<std::string> sections = section_names();
      if (std::find(sections.begin(), sections.end(), section) == sections.end())
        throw InputError(where(name_node) + ": unknown section '" + section + "'" +
                         did_you_mean(section, sections));
      if (!seen_sections.insert(section).second)
        throw InputError(where(name_node) + ": section '" + section + "' appears twice");
      if (body.IsNull()) continue;
      if (!body.IsMap())
        throw InputError(where(body) + ": " + section + ": expected a map of keys");
      std::set<std::string> seen_keys;
      for (const auto& entry : body) {
        std::string key = entry.first.IsScalar() ? entry.first.Scalar() : "?";
        const Field* f = find_field(section, key);
        if (!f) throw InputError(where(entry.first) + ": " + unknown_key_message(section, key));
        if (!seen_keys.insert(key).second)
          throw InputError(where(entry.first) + ": key '" + f->path() + "' appears twice");
        const YAML::Node& value = entry.second;
        if (std::holds_alternative<std::vector<DataSource>*>(get(*f))) {
          const std::string problem =
              parse_sources(value, *std::get<std::vector<DataSource>*>(get(*f)));
          if (!problem.empty()) throw InputError(where(value) + ": " + f->path() + ": " + problem);
          origin[index(*f)] = where(value);
          given_at[index(*f)] = static_cast<int>(layers.size());
          continue;
        }
        if (!value.IsScalar() && !value.IsNull())
          throw InputError(where(value) + ": " + f->path() + ": expected " +
                           expected_kind(get(*f)) + ", got a " +
                           (value.IsMap() ? "map" : "sequence"));
        // An empty value (`val:`) is the empty string, or a type error for other kinds.
        std::string text = value.IsNull() ? "" : value.Scalar();
        set(*f, text, where(value), value.IsNull() ? "nothing" : "'" + text + "'");
      }
    }
  }

  // model.arch's row (apply_arch) sets the layer-choice keys before the file's and the
  // overrides' own keys are applied, so an arch's default never overrides a key that was given.
  // An unknown arch is left for validate_fields() to name.
  void apply_arch_defaults(const YAML::Node& root, const std::vector<std::string>& overrides) {
    std::string arch = config.model.arch;
    if (root.IsMap() && root["model"] && root["model"].IsMap() && root["model"]["arch"] &&
        root["model"]["arch"].IsScalar())
      arch = root["model"]["arch"].Scalar();
    for (const std::string& o : overrides) {
      const std::string body = o.rfind("--", 0) == 0 ? o.substr(2) : o;
      if (body.rfind("model.arch=", 0) == 0) arch = body.substr(11);
    }
    apply_arch(arch, config.model);
  }

  void apply_override(const std::string& override_text) {
    std::string body = override_text.rfind("--", 0) == 0 ? override_text.substr(2) : override_text;
    std::string where = "override '" + override_text + "'";
    size_t eq = body.find('=');
    size_t dot = body.find('.');
    if (eq == std::string::npos || dot == std::string::npos || dot > eq)
      throw InputError(where + ": expected section.key=value, e.g. --optim.lr=3e-4");
    std::string section = body.substr(0, dot), key = body.substr(dot + 1, eq - dot - 1);
    std::string value = body.substr(eq + 1);
    const Field* f = find_field(section, key);
    if (!f) throw InputError(where + ": " + unknown_key_message(section, key));
    set(*f, value, where, "'" + value + "'");  // the value is one scalar, taken verbatim
    end_layer(where);
  }

  void fill_derived() {
    if (const ModelKeyError e = resolve_model_sizes(config.model)) fail(field(e.key), e.what);
    std::vector<DataSource>& sources = config.data.sources;
    for (size_t i = 0; i < sources.size(); ++i)
      if (sources[i].name.empty()) sources[i].name = "source" + std::to_string(i);
  }

  // Document masking's keys: the separator is a token id (without the mask, check_key_use()
  // refuses both keys).
  void validate_documents() {
    const DataSection& d = config.data;
    const Field& separator = *find_field("data", "document_separator");
    const Field& positions = *find_field("data", "document_positions");
    if (!d.document_mask) return;
    if (d.document_separator == -1)
      fail(separator,
           "is required with data.document_mask: true: the token id that begins each document "
           "(prepare_data prints it)");
    if (d.document_separator >= config.model.vocab_size)
      fail(separator, "must be a token id below model.vocab_size (" +
                          std::to_string(config.model.vocab_size) + "), got " +
                          std::to_string(d.document_separator));
    if (d.document_positions && config.model.positions != PositionKind::rope)
      fail(positions,
           "restarts RoPE positions with each document, but model.positions is " +
               enum_name(config.model.positions) +
               " (learned positions are not restarted): set data.document_positions: false, or "
               "model.positions: rope");
  }

  // data.train/val or data.sources, never both; each source readable as a metrics key.
  void validate_data() {
    validate_documents();
    const DataSection& d = config.data;
    const Field& sources = *find_field("data", "sources");
    if (d.sources.empty()) {
      if (d.train.empty())
        fail(*find_field("data", "train"), "must be non-empty (or data.sources set)");
      return;
    }
    for (const auto& [key, glob] : {std::pair<const char*, const std::string&>{"train", d.train},
                                    std::pair<const char*, const std::string&>{"val", d.val}})
      if (!glob.empty())
        fail(*find_field("data", key),
             std::string("is set beside data.sources: give each source its own ") + key +
                 " glob instead");
    std::set<std::string> names;
    for (size_t i = 0; i < d.sources.size(); ++i) {
      const DataSource& s = d.sources[i];
      const std::string at = "entry " + std::to_string(i) + " (" + s.name + "): ";
      if (s.train.empty()) fail(sources, at + "train must be a non-empty glob");
      if (!(s.weight > 0) || !std::isfinite(s.weight))
        fail(sources, at + "weight must be > 0, got " + format_double(s.weight));
      for (char ch : s.name)
        if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '_' && ch != '-')
          fail(sources, at + "name may hold only letters, digits, '_' and '-' (it names "
                             "metrics keys)");
      if (!names.insert(s.name).second) fail(sources, at + "name '" + s.name + "' appears twice");
    }
  }

  void validate_fields() {
    for (const Field& f : schema()) {
      FieldPtr p = get(f);
      if (satisfies(f.check, p)) continue;
      auto* text = std::get_if<std::string*>(&p);
      fail(f, "must be " + describe(f.check) + ", got " +
                  (text ? "'" + **text + "'" : value_to_yaml(p)));
    }
  }

  // A micro-batch's tokens index int32 buffers (losses, targets, positions).
  void validate_tokens() {
    const int64_t tokens = int64_t{config.train.batch_size} * config.model.seq_len;
    if (tokens > std::numeric_limits<int32_t>::max())
      fail(*find_field("train", "batch_size"),
           "x model.seq_len = " + std::to_string(tokens) +
               " tokens a micro-batch, over 2^31 - 1: lower one of them");
  }

  // Context parallelism splits a sequence into 2N chunks and positions its rows by RoPE.
  void validate_context() {
    const int cp = config.dist.context_parallel;
    if (cp == 1) return;
    const Field& f = *find_field("dist", "context_parallel");
    const std::string n = std::to_string(cp);
    if (config.model.positions != PositionKind::rope)
      fail(f,
           "needs rotary positions (a rank's rows are not the first of the sequence), but "
           "model.positions is " +
               enum_name(config.model.positions));
    if (config.model.seq_len % (2 * cp) != 0)
      fail(f, "is " + n + ": each sequence is cut into " + std::to_string(2 * cp) +
                  " chunks, so model.seq_len must be a multiple of " + std::to_string(2 * cp) +
                  ", got " + std::to_string(config.model.seq_len));
  }

  // The moe keys the model's rules leave to the config: the expert ranks, and the balance's
  // words agreeing with its coefficient (aux_loss and none are one model, the coefficient's).
  void validate_moe() {
    const MoeConfig& e = config.model.moe;
    auto moe = [](const char* key) -> const Field& { return *find_field("moe", key); };
    // A dense model's moe keys, and the bias rate without the bias, are check_key_use()'s.
    if (e.n_experts == 0) return;
    if (const int ep = config.dist.expert_parallel; e.n_experts % ep != 0)
      fail(*find_field("dist", "expert_parallel"), "must divide moe.n_experts (" +
                                                       std::to_string(e.n_experts) + "), got " +
                                                       std::to_string(ep));
    if (e.balance == MoeBalance::aux_loss && e.aux_loss_coef == 0)
      fail(moe("aux_loss_coef"),
           "moe.balance=aux_loss needs a positive coefficient (or "
           "moe.balance=none)");
    if (e.balance == MoeBalance::none && e.aux_loss_coef > 0)
      fail(moe("aux_loss_coef"),
           "must be 0 with moe.balance=none, got " + format_double(e.aux_loss_coef));
  }

  // A name would be resolved at every start, and might resolve to an interface of another host.
  void validate_metrics_address() {
    const std::string& a = config.train.metrics_address;
    in6_addr buf;
    if (inet_pton(AF_INET, a.c_str(), &buf) != 1 && inet_pton(AF_INET6, a.c_str(), &buf) != 1)
      fail(*find_field("train", "metrics_address"),
           "must be a numeric IPv4 or IPv6 address (0.0.0.0, 127.0.0.1, ::), got '" + a + "'");
  }

  // A restart resumes from the newest checkpoint in train.out_dir: one that could not would
  // start over, or overwrite the run.
  void validate_restarts() {
    const int n = config.dist.max_restarts;
    const TrainSection& t = config.train;
    if (n == 0) return;
    const Field& f = *find_field("dist", "max_restarts");
    const std::string asked = "is " + std::to_string(n) + " (--max-restarts sets it too), but ";
    const std::string resume =
        "a restart resumes from the newest checkpoint in train.out_dir, "
        "which needs train.resume=auto (this run's is ";
    if (t.resume != "auto") fail(f, asked + resume + t.resume + ")");
    if (!t.save_checkpoints)
      fail(f, asked + "train.save_checkpoints is false: a restart would start again from step 0");
    if (t.checkpoint_every == 0)
      fail(f, asked +
                  "train.checkpoint_every is 0 (a checkpoint only at the end): a restart would "
                  "start again from step 0; set train.checkpoint_every");
  }

  // docs/config.md, "Keys that do nothing": a key given where nothing reads it (key_uses()) is
  // refused, naming it and why. The last word wins, as for any override: a key given before a
  // later override switched its feature off (`--precision.fp8=false` on an FP8 config, a
  // benchmark's --train.save_checkpoints=false) is warned about instead and reset to its
  // default, so the config the run writes says what the run does; a warn_only rule's key is
  // warned about and kept.
  void check_key_use() {
    Config unset;
    apply_arch(config.model.arch, unset.model);
    for (const KeyUse& rule : key_uses()) {
      if (!rule.unused(config)) continue;
      // The layer from which on nothing reads the keys: keys given before it were switched off.
      int off = static_cast<int>(layers.size()) - 1;
      while (off > 0 && rule.unused(layers[off - 1])) --off;
      const std::string why = rule.state(config) + rule.note;
      std::string ignored, at;
      for (const std::string& path : rule.keys) {
        const Field& f = field(path);
        const size_t i = index(f);
        if (given_at[i] == kNotGiven) continue;
        if (!rule.warn_only && given_at[i] >= off) fail(f, "is set, but " + why);
        if (ignored.empty()) at = rule.warn_only ? origin[i] : layer_from[off];
        ignored += (ignored.empty() ? "" : ", ") + path;
        if (!rule.warn_only) copy_value(get(f), f.member(unset));
        given_at[i] = kNotGiven;  // judged: a later rule leaves it alone
      }
      if (!ignored.empty()) warnings.push_back(at + ": " + ignored + ": ignored, as " + why);
    }
  }

  void validate_relations() {
    if (!stored) check_key_use();
    const ModelConfig& m = config.model;
    if (const ModelKeyError e = model_config_error(m)) fail(field(e.key), e.what);
    const int full_blocks = config.train.recompute_full_blocks;
    if (full_blocks > m.n_layer)
      fail(field("train.recompute_full_blocks"), "must be <= model.n_layer (" +
                                                     std::to_string(m.n_layer) + "), got " +
                                                     std::to_string(full_blocks));
    const int kept_blocks = config.train.recompute_kept_blocks;
    if (full_blocks + kept_blocks > m.n_layer)
      fail(field("train.recompute_kept_blocks"),
           "and train.recompute_full_blocks (" + std::to_string(full_blocks) +
               ") must add up to <= model.n_layer (" + std::to_string(m.n_layer) + "), got " +
               std::to_string(kept_blocks));
    validate_moe();
    validate_context();
    validate_tokens();
    validate_restarts();
    validate_data();
    validate_metrics_address();
    if (config.optim.schedule != "constant" && config.optim.min_lr > config.optim.lr)
      fail(field("optim.min_lr"), "must be <= optim.lr (" + format_double(config.optim.lr) +
                                      "), got " + format_double(config.optim.min_lr));
  }
};

}  // namespace

namespace {

// Once per process and message: a tool that reads its config more than once (bench --tiers)
// says what it ignores once.
void warn_once(const std::vector<std::string>& warnings) {
  static std::mutex mutex;
  static std::set<std::string> said;
  const std::lock_guard<std::mutex> lock(mutex);
  for (const std::string& w : warnings)
    if (said.insert(w).second) spdlog::warn("{}", w);
}

Config resolve(const std::string& yaml_text, const std::vector<std::string>& overrides,
               const std::string& source_name, bool stored, std::vector<std::string>* warnings) {
  Resolver r;
  r.stored = stored;
  r.origin.assign(schema().size(), source_name);  // defaults: blame the file that omitted them
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    std::string at = e.mark.is_null() ? ""
                                      : ":" + std::to_string(e.mark.line + 1) + ":" +
                                            std::to_string(e.mark.column + 1);
    throw InputError(source_name + at + ": YAML syntax error: " + e.msg);
  }
  r.apply_arch_defaults(root, overrides);
  r.apply_yaml(root, source_name);
  r.end_layer(source_name);
  for (const std::string& o : overrides) r.apply_override(o);
  r.validate_fields();
  r.fill_derived();
  r.validate_relations();
  if (warnings)
    warnings->insert(warnings->end(), r.warnings.begin(), r.warnings.end());
  else
    warn_once(r.warnings);
  return r.config;
}

}  // namespace

Config parse_config(const std::string& yaml_text, const std::vector<std::string>& overrides,
                    const std::string& source_name, std::vector<std::string>* warnings) {
  return resolve(yaml_text, overrides, source_name, false, warnings);
}

Config parse_stored_config(const std::string& yaml_text, const std::string& source_name) {
  return resolve(yaml_text, {}, source_name, true, nullptr);
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides,
                   std::vector<std::string>* warnings) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw InputError(path + ": cannot read config file: is a directory");
  // A device (/dev/zero) never ends; a pipe (`train <(envsubst < c.yaml)`) does.
  if (std::filesystem::is_character_file(path, ec) || std::filesystem::is_block_file(path, ec))
    throw InputError(path + ": cannot read config file: is a device");
  std::ifstream in(path);
  if (!in) throw InputError(path + ": cannot read config file: " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw InputError(path + ": cannot read config file: " + std::strerror(errno));
  // An empty file would otherwise be "all defaults": GPT-2 124M on whatever device is found.
  bool empty = false;
  try {
    empty = YAML::Load(text.str()).IsNull();
  } catch (const YAML::Exception&) {
    // parse_config names the syntax error.
  }
  if (empty)
    throw InputError(path +
                     ": the config file is empty (nothing but blanks or comments); "
                     "a run needs at least data.train (configs/tiny.yaml is a complete example)");
  return parse_config(text.str(), overrides, path, warnings);
}

}  // namespace kiln
