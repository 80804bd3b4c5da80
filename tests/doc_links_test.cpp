// The docs a new engineer reads link into the tree (other pages, their sections, source files);
// a move or a renamed heading must not leave a dead link. tests/doc_links.py checks every
// Markdown file git knows: each local link's file exists and each #anchor names a heading.
#include <gtest/gtest.h>

#include <string>

#include "tests/test_process.h"

namespace {

const std::string kSrc = KILN_SOURCE_DIR;

TEST(DocLinks, EveryLocalLinkAndAnchorResolves) {
  const auto r = kiln::testing::run_command("python3 " + kSrc + "/tests/doc_links.py " + kSrc);
  EXPECT_EQ(r.status, 0) << r.output;
}

}  // namespace
