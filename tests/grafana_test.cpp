// tools/grafana/kiln.json (the dashboard) and tools/grafana/kiln-alerts.yml (alert rules) against
// the /metrics endpoint: both parse, the dashboard has what Grafana needs to import it (uid,
// title, schemaVersion, a Prometheus datasource variable, panels with a type, a place and
// queries), every kiln_ series either names is one telemetry/prometheus.h exports, and where
// Prometheus' promtool is installed, the rules pass `promtool check rules` and every dashboard
// query parses as PromQL (checked as a recording rule). Grafana itself is not packaged in Debian,
// so the dashboard is not loaded into one here.
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "telemetry/prometheus.h"
#include "tests/test_process.h"

namespace {

namespace fs = std::filesystem;
const std::string kSrc = KILN_SOURCE_DIR;

// The kiln_ series a PromQL expression names.
std::vector<std::string> series_in(const std::string& expr) {
  static const std::regex name("kiln_[a-z0-9_]+");
  std::vector<std::string> out;
  for (auto it = std::sregex_iterator(expr.begin(), expr.end(), name); it != std::sregex_iterator();
       ++it)
    out.push_back(it->str());
  return out;
}

// Those the endpoint does not export.
std::vector<std::string> unknown_series(const std::string& expr) {
  const std::vector<std::string> names = kiln::exported_series();
  const std::set<std::string> known(names.begin(), names.end());
  std::vector<std::string> out;
  for (const std::string& s : series_in(expr))
    if (!known.count(s)) out.push_back(s);
  return out;
}

bool have_promtool() {
  return std::system("command -v promtool >/dev/null 2>&1") == 0;
}

TEST(Grafana, TheDashboardQueriesOnlyExportedSeries) {
  std::ifstream in(kSrc + "/tools/grafana/kiln.json");
  ASSERT_TRUE(in);
  const nlohmann::json d = nlohmann::json::parse(in);  // throws on malformed JSON
  EXPECT_FALSE(d.value("uid", "").empty());
  EXPECT_FALSE(d.value("title", "").empty());
  EXPECT_GE(d.value("schemaVersion", 0), 30);
  bool datasource_variable = false;
  for (const auto& v : d["templating"]["list"])
    if (v.value("type", "") == "datasource" && v.value("query", "") == "prometheus")
      datasource_variable = true;
  EXPECT_TRUE(datasource_variable);
  ASSERT_TRUE(d["panels"].is_array());
  ASSERT_GE(d["panels"].size(), 10u);
  std::set<int> ids;
  std::set<std::string> used;
  std::string recording = "groups:\n  - name: dashboard\n    rules:\n";
  int n = 0;
  for (const auto& p : d["panels"]) {
    const std::string title = p.value("title", "");
    EXPECT_FALSE(title.empty());
    EXPECT_TRUE(ids.insert(p.value("id", 0)).second) << title << ": a duplicate id";
    EXPECT_FALSE(p.value("type", "").empty()) << title;
    for (const char* k : {"x", "y", "w", "h"}) EXPECT_TRUE(p["gridPos"].contains(k)) << title;
    ASSERT_FALSE(p["targets"].empty()) << title;
    for (const auto& t : p["targets"]) {
      const std::string expr = t.value("expr", "");
      EXPECT_FALSE(expr.empty()) << title;
      EXPECT_EQ(unknown_series(expr), std::vector<std::string>{}) << title << ": " << expr;
      for (const std::string& name : series_in(expr)) used.insert(name);
      recording +=
          "      - record: dashboard_" + std::to_string(n++) + "\n        expr: '" + expr + "'\n";
    }
  }
  // The dashboard shows every series the endpoint exports.
  for (const std::string& s : kiln::exported_series()) EXPECT_TRUE(used.count(s)) << s;
  if (!have_promtool()) GTEST_SKIP() << "no promtool: the queries' PromQL is not parsed";
  const fs::path dir = kiln::testing::make_temp_dir("kiln_grafana_");
  std::ofstream(dir / "dashboard.yml") << recording;
  const auto r =
      kiln::testing::run_command("promtool check rules " + (dir / "dashboard.yml").string());
  EXPECT_EQ(r.status, 0) << r.output << recording;
}

TEST(Grafana, TheAlertRulesCheckAndNameOnlyExportedSeries) {
  const std::string path = kSrc + "/tools/grafana/kiln-alerts.yml";
  const YAML::Node rules = YAML::LoadFile(path);
  std::set<std::string> alerts;
  for (const auto& group : rules["groups"])
    for (const auto& rule : group["rules"]) {
      alerts.insert(rule["alert"].as<std::string>());
      const std::string expr = rule["expr"].as<std::string>();
      EXPECT_EQ(unknown_series(expr), std::vector<std::string>{}) << expr;
    }
  for (const char* a : {"KilnRunStalled", "KilnLossNotFinite", "KilnGpuPowerThrottled"})
    EXPECT_TRUE(alerts.count(a)) << a;
  if (!have_promtool()) GTEST_SKIP() << "no promtool: `promtool check rules` not run";
  const auto r = kiln::testing::run_command("promtool check rules " + path);
  EXPECT_EQ(r.status, 0) << r.output;
}

}  // namespace
