// docs/kernels.md against the op table (kernels/ops.def): every op has its row in "The op set",
// and the files a row names exist, so the page cannot fall behind the ops.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include "kernels/ops.h"

namespace kiln {
namespace {

const std::string kSrc = KILN_SOURCE_DIR;

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The table row of `op`: the line that starts "| `op` |", or "".
std::string row_of(const std::string& doc, const std::string& op) {
  const std::string start = "| `" + op + "` |";
  std::istringstream lines(doc);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind(start, 0) == 0) return line;
  return "";
}

TEST(KernelsDoc, ListsEveryOpOfTheTableWithFilesThatExist) {
  const std::string doc = read_file(kSrc + "/docs/kernels.md");
  ASSERT_FALSE(doc.empty()) << "cannot read docs/kernels.md";
  const std::regex file(R"(`([a-z0-9_]+\.(?:cpp|cu))`)");
  for (const char* op : kOpNames) {
    const std::string row = row_of(doc, op);
    EXPECT_FALSE(row.empty()) << "docs/kernels.md has no row for the op `" << op
                              << "` of kernels/ops.def";
    int files = 0;
    for (std::sregex_iterator m(row.begin(), row.end(), file), end; m != end; ++m, ++files) {
      const std::string name = (*m)[1];
      EXPECT_TRUE(std::filesystem::exists(kSrc + "/kernels/cpu/" + name) ||
                  std::filesystem::exists(kSrc + "/kernels/cuda/" + name))
          << "the row of `" << op << "` names " << name << ", in neither kernels/cpu/ nor cuda/";
    }
    if (!row.empty()) {
      EXPECT_GE(files, 2) << "the row of `" << op << "` lacks its cpu or cuda file";
    }
  }
}

}  // namespace
}  // namespace kiln
