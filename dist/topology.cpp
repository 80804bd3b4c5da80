#include "dist/topology.h"

#include <unistd.h>

#include <fstream>
#include <iterator>
#include <memory>
#include <set>
#include <stdexcept>

#include "dist/nvml.h"

namespace kiln {

std::string host_identity() {
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  if (!boot_id.empty()) return "boot " + boot_id;
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) name[0] = '\0';
  return std::string("host ") + name;
}

std::string encode_site(const GpuSite& site) {
  return site.host + "|" + site.pci_bus_id;
}

GpuSite decode_site(const std::string& text) {
  const size_t bar = text.rfind('|');
  if (bar == std::string::npos || bar == 0 || bar + 1 == text.size())
    throw std::invalid_argument("not a GPU site (host|pci bus id): '" + text + "'");
  return {text.substr(0, bar), text.substr(bar + 1)};
}

bool all_joined_by_nvlink(const std::vector<GpuSite>& sites, const NvlinkTest& nvlink,
                          std::string* why) {
  std::set<std::string> hosts;
  for (const GpuSite& s : sites) hosts.insert(s.host);
  if (hosts.size() > 1) {
    *why = "ranks on " + std::to_string(hosts.size()) + " hosts";
    return false;
  }
  std::set<std::string> gpus;
  for (const GpuSite& s : sites) gpus.insert(s.pci_bus_id);
  if (gpus.size() < sites.size()) {
    *why = "ranks share a GPU";
    return false;
  }
  for (auto a = gpus.begin(); a != gpus.end(); ++a)
    for (auto b = std::next(a); b != gpus.end(); ++b) {
      std::string reason;
      if (!nvlink(*a, *b, &reason)) {
        *why = "no NVLink between " + *a + " and " + *b + ": " + reason;
        return false;
      }
    }
  *why = sites.size() == 1
             ? "one GPU"
             : std::to_string(sites.size()) + " GPUs on one host, every pair joined by NVLink";
  return true;
}

// The two NVML entry points used, declared here so that building needs no nvml.h (the CUDA
// toolkit's packages do not all ship it). Values as in nvml.h: NVML_P2P_CAPS_INDEX_NVLINK 2,
// NVML_P2P_STATUS_OK 0.
struct NvmlLinks::Api {
  using Device = struct nvmlDevice_st*;
  NvmlLibrary nvml;
  int (*handle_by_bus_id)(const char*, Device*) = nullptr;
  int (*p2p_status)(Device, Device, int, int*) = nullptr;
};

namespace {
constexpr int kNvmlSuccess = NvmlLibrary::kSuccess;
constexpr int kP2pCapsNvlink = 2;

const char* p2p_status_name(int s) {
  static const char* names[] = {"ok",
                                "chipset not supported",
                                "GPU not supported",
                                "IOH topology not supported",
                                "disabled by regkey",
                                "not supported"};
  return s >= 0 && s < 6 ? names[s] : "unknown";
}
}  // namespace

NvmlLinks::NvmlLinks() {
  auto api = std::make_unique<Api>();
  if (!api->nvml.open()) {
    open_error_ = api->nvml.why();
    return;
  }
  api->handle_by_bus_id = reinterpret_cast<int (*)(const char*, Api::Device*)>(
      api->nvml.symbol("nvmlDeviceGetHandleByPciBusId_v2"));
  api->p2p_status = reinterpret_cast<int (*)(Api::Device, Api::Device, int, int*)>(
      api->nvml.symbol("nvmlDeviceGetP2PStatus"));
  if (!api->handle_by_bus_id || !api->p2p_status) {
    open_error_ = "NVML lacks the functions kiln asks of it";
    return;
  }
  api_ = api.release();
}

NvmlLinks::~NvmlLinks() {
  delete api_;
}

void* NvmlLinks::device(const std::string& pci_bus_id, std::string* why) const {
  if (!api_) {
    *why = open_error_;
    return nullptr;
  }
  Api::Device d = nullptr;
  const int r = api_->handle_by_bus_id(pci_bus_id.c_str(), &d);
  if (r == kNvmlSuccess) return d;
  *why = "NVML does not know GPU " + pci_bus_id + ": " + api_->nvml.error(r);
  return nullptr;
}

bool NvmlLinks::knows(const std::string& pci_bus_id, std::string* why) const {
  return device(pci_bus_id, why) != nullptr;
}

bool NvmlLinks::linked(const std::string& a, const std::string& b, std::string* why) const {
  auto* da = static_cast<Api::Device>(device(a, why));
  auto* db = da ? static_cast<Api::Device>(device(b, why)) : nullptr;
  if (!db) return false;
  int status = -1;
  const int r = api_->p2p_status(da, db, kP2pCapsNvlink, &status);
  if (r != kNvmlSuccess) {
    *why = "nvmlDeviceGetP2PStatus: " + api_->nvml.error(r);
    return false;
  }
  if (status != 0)
    *why = std::string("NVML's NVLink peer-to-peer status: ") + p2p_status_name(status);
  return status == 0;
}

}  // namespace kiln
