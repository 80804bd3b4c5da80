// A Hugging Face model directory as a whole: its name in a spec (hf:DIR), the JSON files its
// parts read, and export_hf, which writes the weights (hf_weights.cpp) and config.json
// (hf_config.cpp). config.json's reading is hf_config.cpp's, the weight map's and the weights'
// hf_weights.cpp's, the tokenizer's hf_tokenizer.cpp's. See hf_model.h.
#include "hf/hf_model.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "hf/hf_files.h"

namespace kiln {

namespace fs = std::filesystem;
using nlohmann::json;

json read_json(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) throw InputError(path + ": cannot read: not a file");
  std::ifstream in(path);
  if (!in) throw InputError(path + ": cannot read");
  try {
    return json::parse(in);
  } catch (const json::parse_error& e) {
    throw InputError(path + ": malformed JSON: " + e.what());
  } catch (const std::exception& e) {  // a read error
    throw InputError(path + ": cannot read: " + e.what());
  }
}

std::optional<std::string> hf_dir_of(const std::string& spec) {
  if (spec.rfind("hf:", 0) != 0) return std::nullopt;
  std::string dir = spec.substr(3);
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

std::vector<std::string> export_hf(const std::string& dir, const ModelConfig& cfg,
                                   const ParamLayout& layout, const float* params,
                                   const HfExportOptions& opts) {
  const HfAdapter& family = hf_adapter_for(cfg);
  if (opts.dtype != "bf16" && opts.dtype != "f32")
    throw InputError("export dtype must be bf16 or f32, got '" + opts.dtype + "'");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw InputError(dir + ": cannot create directory: " + ec.message());
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("model", 0) == 0 &&
        (e.path().extension() == ".safetensors" || name == "model.safetensors.index.json"))
      fs::remove(e.path());
  }
  std::vector<std::string> written = write_hf_weights(dir, cfg, family, layout, params, opts);
  write_hf_config(dir, cfg, family, opts);
  written.push_back("config.json");
  return written;
}

}  // namespace kiln
