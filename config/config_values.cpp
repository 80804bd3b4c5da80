// A config field's value as text, both ways (config/config_schema.h): parsed from YAML and
// overrides, written back as YAML, checked against its row's Check and described for the
// reference; and the whole config written out through the schema: the resolved config.yaml,
// equality, the key reference of docs/config.md.
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstring>
#include <set>
#include <type_traits>

#include "config/config_schema.h"

namespace kiln {

namespace {

bool parse_int64(const std::string& text, int64_t& out) {
  size_t skip = text.size() > 1 && text[0] == '+' && text[1] != '-';
  const char* end = text.data() + text.size();
  auto result = std::from_chars(text.data() + skip, end, out);
  return result.ec == std::errc() && result.ptr == end;
}

bool parse_double(const std::string& text, double& out) {
  size_t skip = text.size() > 1 && text[0] == '+' && text[1] != '-';
  const char* end = text.data() + text.size();
  auto result = std::from_chars(text.data() + skip, end, out);
  return result.ec == std::errc() && result.ptr == end && std::isfinite(out);
}

std::string type_name(const FieldPtr& ptr) {
  static const char* names[] = {"int",  "int64",  "float", "float",
                                "bool", "string", "list",  "string"};
  return names[ptr.index()];
}

// The shortest text that reads back to the same float ("1e-06", not 9.99999997e-07).
std::string format_float(float v) {
  char buf[32];
  return std::string(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
}

std::string spellings(const EnumRef& e) {
  std::string s = "one of ";
  for (size_t i = 0; i < e.names->size(); ++i) s += (i ? ", " : "") + (*e.names)[i];
  return s;
}

}  // namespace

std::string format_double(double v) {
  char buf[64];
  // Shortest text that reads back to the same double, %g-style (0.0006, 1e-08).
  auto result = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::general);
  return std::string(buf, result.ptr);
}

// data.sources from its YAML list; returns "" or what is wrong with it.
std::string parse_sources(const YAML::Node& node, std::vector<DataSource>& out) {
  out.clear();
  if (node.IsNull()) return "";
  const std::string shape = "expected a list of {train, val, weight, name} maps";
  if (!node.IsSequence()) return shape;
  for (size_t i = 0; i < node.size(); ++i) {
    const YAML::Node& entry = node[i];
    const std::string at = "entry " + std::to_string(i) + ": ";
    if (!entry.IsMap()) return shape + " (" + at + "not a map)";
    DataSource src;
    std::set<std::string> seen;
    for (const auto& kv : entry) {
      const std::string key = kv.first.IsScalar() ? kv.first.Scalar() : "?";
      if (!seen.insert(key).second) return at + "key '" + key + "' appears twice";
      if (!kv.second.IsScalar() && !kv.second.IsNull()) return at + key + " must be a scalar";
      const std::string value = kv.second.IsNull() ? "" : kv.second.Scalar();
      if (key == "name") {
        src.name = value;
      } else if (key == "train") {
        src.train = value;
      } else if (key == "val") {
        src.val = value;
      } else if (key == "weight") {
        if (!parse_double(value, src.weight))
          return at + "weight must be a number, got '" + value + "'";
      } else {
        return at + "unknown key '" + key + "' (a source has train, val, weight and name)";
      }
    }
    out.push_back(src);
  }
  return "";
}

// Sets the field from scalar text; returns "" or what was expected ("an integer").
std::string assign(const FieldPtr& ptr, const std::string& text) {
  if (auto p = std::get_if<int*>(&ptr)) {
    int64_t v;
    if (!parse_int64(text, v)) return "an integer";
    if (v < INT_MIN || v > INT_MAX) return "a 32-bit integer";
    **p = static_cast<int>(v);
  } else if (auto p = std::get_if<int64_t*>(&ptr)) {
    if (!parse_int64(text, **p)) return "a 64-bit integer";
  } else if (auto p = std::get_if<double*>(&ptr)) {
    if (!parse_double(text, **p)) return "a number";
  } else if (auto p = std::get_if<float*>(&ptr)) {
    double v;
    if (!parse_double(text, v)) return "a number";
    const float f = static_cast<float>(v);
    if (!std::isfinite(f) || (f == 0 && v != 0)) return "a number within a float's range";
    **p = f;
  } else if (auto p = std::get_if<bool*>(&ptr)) {
    if (text != "true" && text != "false") return "true or false";
    **p = text == "true";
  } else if (auto p = std::get_if<std::string*>(&ptr)) {
    **p = text;
  } else if (auto p = std::get_if<EnumRef>(&ptr)) {
    const auto it = std::find(p->names->begin(), p->names->end(), text);
    if (it == p->names->end()) return spellings(*p);
    p->set(p->field, static_cast<int>(it - p->names->begin()));
  } else {
    YAML::Node node;
    try {
      node = YAML::Load(text);
    } catch (const YAML::Exception& e) {
      return "expected a YAML list of sources (" + e.msg + ")";
    }
    return parse_sources(node, *std::get<std::vector<DataSource>*>(ptr));
  }
  return "";
}

std::string expected_kind(const FieldPtr& ptr) {
  if (auto p = std::get_if<EnumRef>(&ptr)) return spellings(*p);
  static const char* kinds[] = {"an integer",    "an integer", "a number",         "a number",
                                "true or false", "a string",   "a list of sources"};
  return kinds[ptr.index()];
}

void copy_value(const FieldPtr& to, const FieldPtr& from) {
  if (auto t = std::get_if<EnumRef>(&to)) {
    const EnumRef& f = std::get<EnumRef>(from);
    t->set(t->field, f.get(f.field));
    return;
  }
  std::visit(
      [&](auto t) {
        if constexpr (std::is_pointer_v<decltype(t)>) *t = *std::get<decltype(t)>(from);
      },
      to);
}

bool same_value(const FieldPtr& a, const FieldPtr& b) {
  if (auto x = std::get_if<EnumRef>(&a)) {
    const EnumRef& y = std::get<EnumRef>(b);
    return x->get(x->field) == y.get(y.field);
  }
  return std::visit(
      [&](auto x) {
        if constexpr (std::is_pointer_v<decltype(x)>) return *x == *std::get<decltype(x)>(b);
        return false;
      },
      a);
}

// The value as YAML scalar text: plain where that reads back as the same string, else quoted.
std::string value_to_yaml(const FieldPtr& ptr) {
  if (auto p = std::get_if<int*>(&ptr)) return std::to_string(**p);
  if (auto p = std::get_if<int64_t*>(&ptr)) return std::to_string(**p);
  if (auto p = std::get_if<double*>(&ptr)) return format_double(**p);
  if (auto p = std::get_if<float*>(&ptr)) return format_float(**p);
  if (auto p = std::get_if<bool*>(&ptr)) return **p ? "true" : "false";
  if (auto p = std::get_if<EnumRef>(&ptr)) return (*p->names)[p->get(p->field)];
  if (auto p = std::get_if<std::vector<DataSource>*>(&ptr)) {
    // One flow-style line, so the resolved config keeps one line per key.
    YAML::Emitter out;
    out << YAML::Flow << YAML::BeginSeq;
    for (const DataSource& d : **p) {
      out << YAML::Flow << YAML::BeginMap;
      out << YAML::Key << "name" << YAML::Value << YAML::DoubleQuoted << d.name;
      out << YAML::Key << "train" << YAML::Value << YAML::DoubleQuoted << d.train;
      out << YAML::Key << "val" << YAML::Value << YAML::DoubleQuoted << d.val;
      out << YAML::Key << "weight" << YAML::Value << format_double(d.weight);
      out << YAML::EndMap;
    }
    out << YAML::EndSeq;
    return out.c_str();
  }
  const std::string& s = *std::get<std::string*>(ptr);
  bool plain = !s.empty() && std::isalnum(static_cast<unsigned char>(s[0])) && s != "null" &&
               s != "Null" && s != "NULL";
  for (char ch : s)
    plain = plain && (std::isalnum(static_cast<unsigned char>(ch)) || std::strchr("_./-", ch));
  if (plain) return s;
  YAML::Emitter out;
  out << YAML::DoubleQuoted << s;
  return out.c_str();
}

std::string describe(const Check& c) {
  if (!c.choices.empty()) {
    std::string s = "one of ";
    for (size_t i = 0; i < c.choices.size(); ++i) s += (i ? ", " : "") + c.choices[i];
    return s;
  }
  if (c.non_empty) return "non-empty";
  bool has_lo = c.lo != -HUGE_VAL, has_hi = c.hi != HUGE_VAL;
  if (has_lo && has_hi)
    return std::string("in ") + (c.lo_open ? "(" : "[") + format_double(c.lo) + ", " +
           format_double(c.hi) + (c.hi_open ? ")" : "]");
  if (has_lo) return (c.lo_open ? "> " : ">= ") + format_double(c.lo);
  if (has_hi) return (c.hi_open ? "< " : "<= ") + format_double(c.hi);
  return "any";
}

bool satisfies(const Check& c, const FieldPtr& ptr) {
  if (auto p = std::get_if<std::string*>(&ptr)) {
    if (c.non_empty && (*p)->empty()) return false;
    return c.choices.empty() ||
           std::find(c.choices.begin(), c.choices.end(), **p) != c.choices.end();
  }
  double v;
  if (auto p = std::get_if<int*>(&ptr))
    v = **p;
  else if (auto p = std::get_if<int64_t*>(&ptr))
    v = static_cast<double>(**p);
  else if (auto p = std::get_if<double*>(&ptr))
    v = **p;
  else if (auto p = std::get_if<float*>(&ptr))
    v = **p;
  else
    return true;  // bool, an enum (its spellings were checked as read); data.sources is
                  // checked in validate_data()
  return (c.lo_open ? v > c.lo : v >= c.lo) && (c.hi_open ? v < c.hi : v <= c.hi);
}

std::string config_to_yaml(const Config& config) {
  Config copy = config;  // the accessors hand out mutable pointers
  std::string out =
      "# kiln config: every key, resolved; one nothing reads is a comment (docs/config.md)\n";
  const char* section = "";
  for (const Field& f : schema()) {
    if (std::strcmp(section, f.section) != 0) out += std::string(section = f.section) + ":\n";
    // Given, such a key would be refused; left out, it reads back as its default, which a
    // parsed config holds for it (check_key_use() resets one it ignores).
    const std::string unused = unused_because(copy, f);
    out += std::string(unused.empty() ? "  " : "  # ") + f.key + ": " +
           value_to_yaml(f.member(copy)) + (unused.empty() ? "" : "  # unused: " + unused) + "\n";
  }
  return out;
}

bool operator==(const Config& a, const Config& b) {
  Config ca = a, cb = b;
  for (const Field& f : schema())
    if (!same_value(f.member(ca), f.member(cb))) return false;
  return true;
}

std::string config_reference_markdown() {
  Config defaults;
  std::string out;
  const char* section = "";
  for (const Field& f : schema()) {
    if (std::strcmp(section, f.section) != 0) {
      out += std::string(*section ? "\n" : "") + "### " + f.section + "\n\n";
      section = f.section;
      out += "| key | type | default | allowed | meaning |\n|---|---|---|---|---|\n";
    }
    FieldPtr p = f.member(defaults);
    out += std::string("| `") + f.key + "` | " + type_name(p) + " | `" + value_to_yaml(p) + "` | " +
           describe(f.check) + " | " + f.doc + " |\n";
  }
  return out;
}

}  // namespace kiln
