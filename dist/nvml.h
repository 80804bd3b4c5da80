// NVML (the NVIDIA driver's management library) opened at run time with dlopen, as NCCL opens
// it, so kiln builds without nvml.h and runs on machines with no NVIDIA driver: where NVML cannot
// be opened, open() is false and why() says what was missing. Callers look up the entry points
// they use by name (symbol()) and declare their signatures themselves, with nvml.h's values.
// NVML counts its initializations, so several NvmlLibrary objects may live at once.
#pragma once

#include <string>

namespace kiln {

class NvmlLibrary {
 public:
  NvmlLibrary();  // dlopen("libnvidia-ml.so.1") and nvmlInit_v2
  ~NvmlLibrary();  // nvmlShutdown and dlclose
  NvmlLibrary(const NvmlLibrary&) = delete;
  NvmlLibrary& operator=(const NvmlLibrary&) = delete;

  bool open() const { return lib_ != nullptr; }
  const std::string& why() const { return why_; }  // why it is not open
  // The entry point `name`, or nullptr when this NVML lacks it (or is not open).
  void* symbol(const char* name) const;
  // nvmlErrorString of an NVML return code.
  std::string error(int code) const;

  static constexpr int kSuccess = 0;  // NVML_SUCCESS

 private:
  void* lib_ = nullptr;
  const char* (*error_string_)(int) = nullptr;
  std::string why_;
};

}  // namespace kiln
