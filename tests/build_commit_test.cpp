// Tests for cmake/build_commit.cmake, the name a binary gives its tree (summary.json's "commit",
// bench's rows): a git checkout is named by git, even with a .commit left in it (carried
// binaries' dev/carry_binaries.sh writes one, which would name every later build after the commit
// it was written at); a tree exported without .git by its .commit, also inside another checkout.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "tests/test_process.h"

namespace {

namespace fs = std::filesystem;

// What build_commit.cmake names the tree at `src`.
std::string name_of(const fs::path& src) {
  const fs::path out = src.parent_path() / (src.filename().string() + ".cpp");
  const auto r = kiln::testing::run_command("cmake -DSRC=" + src.string() + " -DOUT=" +
                                            out.string() + " -P " + KILN_SOURCE_DIR +
                                            "/cmake/build_commit.cmake");
  EXPECT_EQ(r.status, 0) << r.output;
  std::ifstream f(out);
  const std::string text((std::istreambuf_iterator<char>(f)), {});
  const size_t at = text.find("return \"");
  if (at == std::string::npos) return "(no name in " + text + ")";
  return text.substr(at + 8, text.find('"', at + 8) - at - 8);
}

TEST(BuildCommit, AGitCheckoutIsNamedByGitAndAnExportedTreeByItsCommitFile) {
  const fs::path dir = kiln::testing::make_temp_dir("kiln_build_commit_");
  const fs::path repo = dir / "repo";
  fs::create_directories(repo);
  auto r = kiln::testing::run_command(
      "cd " + repo.string() + " && git init -q && echo a > a.txt && git add a.txt && "
      "git -c user.name=kiln -c user.email=kiln@localhost commit -qm a && "
      "git rev-parse --short=7 HEAD");
  if (r.status != 0) GTEST_SKIP() << "git cannot make a repository here: " << r.output;
  const std::string head = r.output.substr(0, 7);

  EXPECT_EQ(name_of(repo), head);
  std::ofstream(repo / ".commit") << "stale\n";  // ignored (.gitignore), or it would be dirty
  std::ofstream(repo / ".gitignore") << ".commit\n.gitignore\nexported/\n";
  EXPECT_EQ(name_of(repo), head);

  fs::create_directories(repo / "exported");  // git archive's tree inside the checkout
  std::ofstream(repo / "exported" / ".commit") << "1234abc\n";
  EXPECT_EQ(name_of(repo / "exported"), "1234abc");

  fs::create_directories(dir / "plain");  // no git anywhere above it
  std::ofstream(dir / "plain" / ".commit") << "5678def\n";
  EXPECT_EQ(name_of(dir / "plain"), "5678def");
  fs::create_directories(dir / "bare");
  EXPECT_EQ(name_of(dir / "bare"), "unknown");
}

}  // namespace
