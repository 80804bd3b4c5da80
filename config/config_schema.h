// What the parts of the config share: the schema table (config/schema.cpp), one row per key
// (section, key, the Config field it reads and writes, the values it accepts, its meaning), the
// rules of keys that do nothing (config/key_uses.cpp), and a field's value as text, both ways,
// with the checks of one value (config/config_values.cpp). config.h is the interface; this
// header is for config/'s own files.
#pragma once

#include <cmath>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "config/config.h"
#include "model/model_rules.h"

namespace YAML {
class Node;
}

namespace kiln {

// An enum key (model.norm, moe.score, ...) as the index of its spelling in `names` (enum_names:
// model/arch.h's, model/model_rules.h's): the field is read and written through get and set, so
// a field that is not an enum but takes a fixed set of spellings (model.rope_scaling's
// RopeScaling::type, "" for none) is one too.
struct EnumRef {
  void* field;
  int (*get)(const void* field);
  void (*set)(void* field, int index);
  const std::vector<std::string>* names;
};

using FieldPtr = std::variant<int*, int64_t*, double*, float*, bool*, std::string*,
                              std::vector<DataSource>*, EnumRef>;

// What a schema row's accessor returns for a field of any kind: the pointer, or for an enum its
// EnumRef over enum_names(Enum).
template <class T>
FieldPtr field_ptr(T* field) {
  if constexpr (std::is_enum_v<T>) {
    return EnumRef{field, [](const void* f) { return static_cast<int>(*static_cast<const T*>(f)); },
                   [](void* f, int i) { *static_cast<T*>(f) = static_cast<T>(i); },
                   &enum_names(T{})};
  } else {
    return field;
  }
}

// The values one field accepts on its own; rules relating two keys are in validate_relations().
struct Check {
  double lo = -HUGE_VAL, hi = HUGE_VAL;  // numbers: bounds
  bool lo_open = false, hi_open = false;
  std::vector<std::string> choices;  // strings: allowed values (empty: any)
  bool non_empty = false;            // strings: "" not allowed
};

struct Field {
  const char* section;
  const char* key;
  FieldPtr (*member)(Config&);
  Check check;
  const char* doc;
  std::string path() const { return std::string(section) + "." + key; }
};

// Every key, in the order of config.yaml and docs/config.md (config/schema.cpp).
const std::vector<Field>& schema();
// The row of section.key, or nullptr.
const Field* find_field(const std::string& section, const std::string& key);
// The row of "section.key" (one that exists).
const Field& field(const std::string& path);

// Keys another key can leave unread (docs/config.md, "Keys that do nothing"). One given in the
// file or an override where `unused` holds is refused ("is set, but <state><note>"), unless a
// later override switched its feature off (warned about once, reset to its default) or the rule
// is `warn_only` (warned about once, kept).
struct KeyUse {
  std::vector<std::string> keys;  // "section.key"
  const char* enabler;            // the key that turns them on; its override is named in a warning
  bool (*unused)(const Config&);  // nothing reads `keys` in this combination
  std::string (*state)(const Config&);  // why, as "train.save_checkpoints is false"
  const char* note;                     // what follows the state: " (no checkpoint is written)"
  bool warn_only = false;  // refusing would break a documented workflow (a sweep's shared flags)
};
const std::vector<KeyUse>& key_uses();
// Why nothing reads `f` in `c` ("train.save_checkpoints is false (no checkpoint is written)"),
// or "" where something does, or where a warn_only rule's key holds a value of its own (kept as
// given, and warned about again when read back).
std::string unused_because(const Config& c, const Field& f);

// ---- A field's value as text (config/config_values.cpp) ----
// Shortest text that reads back to the same double, %g-style (0.0006, 1e-08).
std::string format_double(double v);
// data.sources from its YAML list; returns "" or what is wrong with it.
std::string parse_sources(const YAML::Node& node, std::vector<DataSource>& out);
// Sets the field from scalar text; returns "" or what was expected ("an integer", "one of
// layernorm, rmsnorm").
std::string assign(const FieldPtr& ptr, const std::string& text);
// The value of `from` into `to`, two fields of the same key (in two Configs).
void copy_value(const FieldPtr& to, const FieldPtr& from);
bool same_value(const FieldPtr& a, const FieldPtr& b);
// "an integer", "a number", ...: what a value of the field's kind looks like.
std::string expected_kind(const FieldPtr& ptr);
// The value as YAML scalar text: plain where that reads back as the same string, else quoted.
std::string value_to_yaml(const FieldPtr& ptr);
// The values a check accepts, in words ("in [0, 1)", "one of gelu, swiglu").
std::string describe(const Check& c);
bool satisfies(const Check& c, const FieldPtr& ptr);

}  // namespace kiln
