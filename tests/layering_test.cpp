// The layering rule (docs/design.md, Layers): every product file includes only from its own room
// and the rooms below it, as the table in docs/design.md lists them. The table is read from the
// doc, so the rule and its statement cannot part.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
const std::string kSrc = KILN_SOURCE_DIR;

// room -> the rooms it may include, from the table between the layering markers.
std::map<std::string, std::set<std::string>> layering_table() {
  std::ifstream in(kSrc + "/docs/design.md");
  std::string line;
  bool inside = false;
  std::map<std::string, std::set<std::string>> table;
  const std::regex row(R"(^\|\s*([a-z]+)\s*\|\s*([a-z, ]*)\|\s*$)");
  while (std::getline(in, line)) {
    if (line.rfind("<!-- layering", 0) == 0) inside = true;
    if (line.rfind("<!-- /layering", 0) == 0) break;
    std::smatch m;
    if (!inside || !std::regex_match(line, m, row) || m[1] == "room") continue;
    std::set<std::string>& allowed = table[m[1]];
    std::stringstream list(m[2].str());
    for (std::string room; std::getline(list, room, ',');) {
      room.erase(0, room.find_first_not_of(' '));
      room.erase(room.find_last_not_of(' ') + 1);
      if (!room.empty()) allowed.insert(room);
    }
  }
  return table;
}

TEST(Layering, EveryIncludePointsDown) {
  const auto table = layering_table();
  ASSERT_GE(table.size(), 10u) << "docs/design.md lost its layering table";
  const std::regex include(R"(^\s*#\s*include\s+"([a-z_]+)/)");
  std::vector<std::string> violations;
  size_t files = 0;
  for (const auto& [room, allowed] : table) {
    ASSERT_TRUE(fs::is_directory(kSrc + "/" + room)) << room << " is in the table, not the tree";
    for (const auto& entry : fs::recursive_directory_iterator(kSrc + "/" + room)) {
      const std::string ext = entry.path().extension();
      if (!entry.is_regular_file() || (ext != ".h" && ext != ".cpp" && ext != ".cu" && ext != ".cuh"))
        continue;
      ++files;
      std::ifstream in(entry.path());
      std::string line;
      for (int n = 1; std::getline(in, line); ++n) {
        std::smatch m;
        if (!std::regex_search(line, m, include)) continue;
        const std::string target = m[1];
        // Only kiln's rooms are judged (third-party headers such as "cutlass/..." are not).
        if (!table.count(target) || target == room || allowed.count(target)) continue;
        violations.push_back(fs::relative(entry.path(), kSrc).string() + ":" +
                             std::to_string(n) + ": " + room + " includes " + target);
      }
    }
  }
  EXPECT_GT(files, 100u);
  for (const std::string& v : violations) ADD_FAILURE() << v;
}

// Every directory of product code is a room of the table (a new one must take its place there).
TEST(Layering, EveryRoomIsInTheTable) {
  const auto table = layering_table();
  for (const auto& entry : fs::directory_iterator(kSrc)) {
    if (!entry.is_directory()) continue;
    const std::string name = entry.path().filename();
    bool has_code = false;
    for (const auto& f : fs::directory_iterator(entry.path()))
      if (f.path().extension() == ".cpp" || f.path().extension() == ".h") has_code = true;
    if (!has_code || name == "tests" || name == "dev" || name[0] == '.' ||
        name.rfind("build", 0) == 0)
      continue;
    EXPECT_TRUE(table.count(name)) << name << "/ holds code but is not in docs/design.md's table";
  }
}

}  // namespace
