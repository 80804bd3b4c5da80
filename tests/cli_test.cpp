// Tests for config/cli.cpp: config path, override pass-through, every launcher flag form, and
// the InputErrors for unknown flags, bad values, a second positional and a missing config.
#include "config/cli.h"

#include <gtest/gtest.h>

#include "base/error.h"
#include "tests/input_error.h"

namespace kiln {
namespace {

CommandLine parse(std::vector<std::string> args) {
  args.insert(args.begin(), "train");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return parse_command_line(static_cast<int>(argv.size()), argv.data());
}

std::string parse_error(const std::vector<std::string>& args) {
  return kiln::testing::input_error([&] { parse(args); });
}

TEST(CliParse, ConfigPathAndDefaults) {
  CommandLine cl = parse({"configs/gpt2.yaml"});
  EXPECT_EQ(cl.config_path, "configs/gpt2.yaml");
  EXPECT_TRUE(cl.overrides.empty());
  EXPECT_FALSE(cl.help);
  EXPECT_EQ(cl.launch.nproc_per_node, 1);
  EXPECT_EQ(cl.launch.nnodes, 1);
  EXPECT_EQ(cl.launch.node_rank, 0);
  EXPECT_EQ(cl.launch.master_addr, "127.0.0.1");
  EXPECT_EQ(cl.launch.master_port, 0);
}

TEST(CliParse, OverridesKeepOrderAnywhereOnTheLine) {
  CommandLine cl =
      parse({"--optim.lr=3e-4", "c.yaml", "--train.batch_size=16", "--optim.lr=1", "--data.val="});
  EXPECT_EQ(cl.config_path, "c.yaml");
  EXPECT_EQ(cl.overrides, (std::vector<std::string>{"optim.lr=3e-4", "train.batch_size=16",
                                                    "optim.lr=1", "data.val="}));
}

TEST(CliParse, LauncherFlagsWithEquals) {
  CommandLine cl = parse({"c.yaml", "--nproc-per-node=8", "--nnodes=2", "--node-rank=1",
                          "--master-addr=10.0.0.1", "--master-port=1234"});
  EXPECT_EQ(cl.launch.nproc_per_node, 8);
  EXPECT_EQ(cl.launch.nnodes, 2);
  EXPECT_EQ(cl.launch.node_rank, 1);
  EXPECT_EQ(cl.launch.master_addr, "10.0.0.1");
  EXPECT_EQ(cl.launch.master_port, 1234);
}

TEST(CliParse, LauncherFlagsWithSeparateValue) {
  CommandLine cl = parse({"--nproc-per-node", "4", "--nnodes", "3", "--node-rank", "2",
                          "--master-addr", "node0", "--master-port", "65535", "c.yaml"});
  EXPECT_EQ(cl.config_path, "c.yaml");
  EXPECT_EQ(cl.launch.nproc_per_node, 4);
  EXPECT_EQ(cl.launch.nnodes, 3);
  EXPECT_EQ(cl.launch.node_rank, 2);
  EXPECT_EQ(cl.launch.master_addr, "node0");
  EXPECT_EQ(cl.launch.master_port, 65535);
}

TEST(CliParse, MaxRestartsIsALauncherFlag) {
  EXPECT_EQ(parse({"c.yaml"}).launch.max_restarts, -1);  // not given: the config's key holds
  EXPECT_EQ(parse({"c.yaml", "--max-restarts", "3"}).launch.max_restarts, 3);
  CommandLine cl = parse({"c.yaml", "--max-restarts=0", "--dist.max_restarts=5"});
  EXPECT_EQ(cl.launch.max_restarts, 0);
  EXPECT_EQ(cl.overrides, std::vector<std::string>{"dist.max_restarts=5"});
  EXPECT_NE(usage_text().find("--max-restarts N"), std::string::npos);
  for (const char* bad : {"--max-restarts=-1", "--max-restarts=x", "--max-restarts=1.5"})
    EXPECT_NE(parse_error({"a.yaml", bad}).find("--max-restarts: expected an integer in [0, "),
              std::string::npos)
        << bad;
  EXPECT_NE(parse_error({"a.yaml", "--max-restarts"}).find("--max-restarts: missing value"),
            std::string::npos);
}

TEST(CliParse, HelpNeedsNoConfig) {
  EXPECT_TRUE(parse({"--help"}).help);
  EXPECT_TRUE(parse({"-h"}).help);
  EXPECT_TRUE(parse({"c.yaml", "-h"}).help);
  std::string usage = usage_text();
  for (const char* flag :
       {"--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port"})
    EXPECT_NE(usage.find(flag), std::string::npos) << flag;
  EXPECT_NE(usage.find("docs/config.md"), std::string::npos);
}

TEST(CliParse, PrintConfigIsAFlagBesideTheConfig) {
  EXPECT_FALSE(parse({"c.yaml"}).print_config);
  CommandLine cl = parse({"c.yaml", "--optim.lr=1e-3", "--print-config"});
  EXPECT_TRUE(cl.print_config);
  EXPECT_EQ(cl.overrides, std::vector<std::string>{"optim.lr=1e-3"});
  EXPECT_NE(usage_text().find("--print-config"), std::string::npos);
}

TEST(CliErrors, NameTheArgumentAtFault) {
  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  for (const Case& c : std::vector<Case>{
           {{}, "missing config file"},
           {{"--optim.lr=1"}, "missing config file"},
           {{"a.yaml", "b.yaml"}, "unexpected argument 'b.yaml'"},
           {{"a.yaml", "--nproc_per_node=2"}, "unknown flag '--nproc_per_node=2'"},
           {{"a.yaml", "--verbose"}, "unknown flag '--verbose'"},
           {{"a.yaml", "-v"}, "unknown flag '-v'"},
           {{"a.yaml", "--optim.lr"}, "config override '--optim.lr'"},
           {{"a.yaml", "--nproc-per-node=0"}, "--nproc-per-node: expected an integer in [1,"},
           {{"a.yaml", "--nproc-per-node=two"}, "got 'two'"},
           {{"a.yaml", "--nnodes=-1"}, "--nnodes: expected an integer in [1,"},
           {{"a.yaml", "--node-rank=-1"}, "--node-rank: expected an integer in [0,"},
           {{"a.yaml", "--nnodes=2", "--node-rank=2"}, "--node-rank: must be < --nnodes (2)"},
           {{"a.yaml", "--master-port=0"}, "--master-port: expected an integer in [1, 65535]"},
           {{"a.yaml", "--master-port=65536"}, "got '65536'"},
           {{"a.yaml", "--master-port=80x"}, "got '80x'"},
           {{"a.yaml", "--master-addr="}, "--master-addr: expected a host name"},
           {{"a.yaml", "--master-port"}, "--master-port: missing value"},
           {{"a.yaml", "--nnodes", "--node-rank=0"}, "--nnodes: missing value"},
       }) {
    std::string msg = parse_error(c.args);
    EXPECT_NE(msg.find(c.expected), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace kiln
