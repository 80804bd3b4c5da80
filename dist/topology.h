// Where the ranks' GPUs sit and whether NVLink joins them: the fact ddp's default bucket size
// rests on (dist.bucket_mb=0; docs/distributed.md). On one NVLink host, one all-reduce after
// backward measured faster than buckets overlapped with it; anywhere slower, overlap pays.
// NVML is opened at run time (dlopen), as NCCL opens it, so kiln links and runs on machines
// with no NVIDIA driver; where it cannot be asked, the answer is "not joined", with the reason.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace kiln {

// One rank's GPU: the machine it is in and its PCI bus id ("0000:18:00.0").
struct GpuSite {
  std::string host;  // host_identity() of the rank's machine
  std::string pci_bus_id;
};

// This machine: the running kernel's boot id (a random UUID per boot), which every container
// on one machine shares and no two machines do, whatever their hostnames; the hostname where
// there is no boot id to read.
std::string host_identity();

// "host|bus id" and back (the form ranks exchange through the rendezvous store). Throws
// std::invalid_argument on text that is not one.
std::string encode_site(const GpuSite& site);
GpuSite decode_site(const std::string& text);

// Whether NVLink joins GPUs a and b (PCI bus ids); false with *why otherwise.
using NvlinkTest =
    std::function<bool(const std::string& a, const std::string& b, std::string* why)>;

// True when every site is on one host and `nvlink` holds for every pair of distinct GPUs (one
// rank: trivially). *why says what was found either way: "4 GPUs on one host, every pair
// joined by NVLink", "ranks on 2 hosts", "no NVLink between 0000:18:00.0 and 0000:2a:00.0: ...".
bool all_joined_by_nvlink(const std::vector<GpuSite>& sites, const NvlinkTest& nvlink,
                          std::string* why);

// NVML's answer (NVLink peer-to-peer status by PCI bus id). When NVML cannot be opened every
// test is false, naming why (no driver, library missing, a GPU it does not know).
class NvmlLinks {
 public:
  NvmlLinks();
  ~NvmlLinks();
  NvmlLinks(const NvmlLinks&) = delete;
  NvmlLinks& operator=(const NvmlLinks&) = delete;

  bool open() const { return api_ != nullptr; }
  // Whether NVML knows the GPU at `pci_bus_id`; *why names the failure.
  bool knows(const std::string& pci_bus_id, std::string* why) const;
  bool linked(const std::string& a, const std::string& b, std::string* why) const;

 private:
  struct Api;
  void* device(const std::string& pci_bus_id, std::string* why) const;  // an nvmlDevice_t
  Api* api_ = nullptr;  // NVML and the entry points asked of it; null where it is not open
  std::string open_error_;
};

}  // namespace kiln
