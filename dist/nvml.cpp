#include "dist/nvml.h"

#include <dlfcn.h>

namespace kiln {

NvmlLibrary::NvmlLibrary() {
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = dlerror();
    why_ = std::string("NVML not loaded (") + (e ? e : "libnvidia-ml.so.1") + ")";
    return;
  }
  auto init = reinterpret_cast<int (*)()>(dlsym(lib, "nvmlInit_v2"));
  error_string_ = reinterpret_cast<const char* (*)(int)>(dlsym(lib, "nvmlErrorString"));
  if (!init || !dlsym(lib, "nvmlShutdown")) {
    why_ = "NVML lacks nvmlInit_v2 or nvmlShutdown";
    dlclose(lib);
    return;
  }
  const int r = init();
  if (r != kSuccess) {
    why_ = "nvmlInit: " + (error_string_ ? std::string(error_string_(r)) : std::to_string(r));
    dlclose(lib);
    return;
  }
  lib_ = lib;
}

NvmlLibrary::~NvmlLibrary() {
  if (!lib_) return;
  reinterpret_cast<int (*)()>(dlsym(lib_, "nvmlShutdown"))();
  dlclose(lib_);
}

void* NvmlLibrary::symbol(const char* name) const {
  return lib_ ? dlsym(lib_, name) : nullptr;
}

std::string NvmlLibrary::error(int code) const {
  return error_string_ ? error_string_(code) : "NVML error " + std::to_string(code);
}

}  // namespace kiln
