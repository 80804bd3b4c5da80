// Tests for dist/topology: the decision ddp's default bucket size rests on (one host, NVLink
// between every pair of GPUs), from sites and a stand-in NVLink test; the site's wire form; and
// NVML's absence answered with a reason, never a crash. NVML itself is asked on a GPU host
// (tests/gpu/dist_nccl_communicator_test.cpp).
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "dist/topology.h"

namespace kiln {
namespace {

// NVLink between every pair except those listed.
NvlinkTest nvlink_except(std::set<std::pair<std::string, std::string>> missing, int* asked) {
  return [missing, asked](const std::string& a, const std::string& b, std::string* why) {
    ++*asked;
    if (missing.count({a, b}) || missing.count({b, a})) {
      *why = "not supported";
      return false;
    }
    return true;
  };
}

std::vector<GpuSite> one_host(int gpus) {
  std::vector<GpuSite> sites;
  for (int g = 0; g < gpus; ++g)
    sites.push_back({"node1/boot", "0000:1" + std::to_string(g) + ":00.0"});
  return sites;
}

TEST(DistTopology, OneHostWithNvlinkEverywhereIsJoined) {
  int asked = 0;
  std::string why;
  EXPECT_TRUE(all_joined_by_nvlink(one_host(4), nvlink_except({}, &asked), &why));
  EXPECT_EQ(asked, 6);  // every pair once
  EXPECT_EQ(why, "4 GPUs on one host, every pair joined by NVLink");
}

TEST(DistTopology, OneGpuIsJoinedWithoutAsking) {
  int asked = 0;
  std::string why;
  EXPECT_TRUE(all_joined_by_nvlink(one_host(1), nvlink_except({}, &asked), &why));
  EXPECT_EQ(asked, 0);
  EXPECT_EQ(why, "one GPU");
}

TEST(DistTopology, OneMissingLinkIsNamed) {
  int asked = 0;
  std::string why;
  EXPECT_FALSE(all_joined_by_nvlink(
      one_host(4), nvlink_except({{"0000:11:00.0", "0000:13:00.0"}}, &asked), &why));
  EXPECT_EQ(why, "no NVLink between 0000:11:00.0 and 0000:13:00.0: not supported");
}

TEST(DistTopology, SeveralHostsAreNotJoined) {
  std::vector<GpuSite> sites = one_host(2);
  sites.push_back({"node2/boot", "0000:10:00.0"});  // the same bus id on another machine
  int asked = 0;
  std::string why;
  EXPECT_FALSE(all_joined_by_nvlink(sites, nvlink_except({}, &asked), &why));
  EXPECT_EQ(asked, 0);
  EXPECT_EQ(why, "ranks on 2 hosts");
}

TEST(DistTopology, RanksSharingAGpuAreNotJoined) {
  std::vector<GpuSite> sites = one_host(2);
  sites.push_back(sites[0]);
  int asked = 0;
  std::string why;
  EXPECT_FALSE(all_joined_by_nvlink(sites, nvlink_except({}, &asked), &why));
  EXPECT_EQ(why, "ranks share a GPU");
}

TEST(DistTopology, SitesRoundTripAndGarbageIsRefused) {
  const GpuSite site{host_identity(), "00000000:18:00.0"};
  const GpuSite back = decode_site(encode_site(site));
  EXPECT_EQ(back.host, site.host);
  EXPECT_EQ(back.pci_bus_id, site.pci_bus_id);
  for (const char* bad : {"", "no-bar", "|0000:18:00.0", "host|"})
    EXPECT_THROW(decode_site(bad), std::invalid_argument) << bad;
}

// The kernel's boot id: the same for every process (and container) of this machine.
TEST(DistTopology, HostIdentityIsTheBootId) {
  const std::string id = host_identity();
  EXPECT_EQ(id, host_identity());
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  if (boot_id.empty()) GTEST_SKIP() << "no boot id here: " << id;
  EXPECT_EQ(id, "boot " + boot_id);
}

// Without a driver (CI) NVML does not open, and every question gets a reason instead.
TEST(DistTopology, WithoutNvmlEveryLinkIsFalseWithAReason) {
  NvmlLinks nvml;
  if (nvml.open()) GTEST_SKIP() << "NVML is present here (tests/gpu asks it)";
  std::string why;
  EXPECT_FALSE(nvml.knows("0000:18:00.0", &why));
  EXPECT_NE(why.find("NVML"), std::string::npos) << why;
  why.clear();
  EXPECT_FALSE(nvml.linked("0000:18:00.0", "0000:2a:00.0", &why));
  EXPECT_NE(why.find("NVML"), std::string::npos) << why;
}

}  // namespace
}  // namespace kiln
