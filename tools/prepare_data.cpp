// prepare_data: text files -> llm.c token shards. The inputs are joined (in the order given,
// separated by "\n") and tokenized as ONE stream; the FIRST val-fraction of its tokens become
// val shards and the rest train shards, so validation is a fixed, contiguous slice of the data.
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "data/shard.h"
#include "data/tokenizer.h"
#include "kernels/error.h"

namespace {

using kiln::InputError;

constexpr const char* kUsage =
    "usage: prepare_data --out DIR [--tokenizer byte] [--val-fraction F] [--shard-tokens N] "
    "FILE...\n"
    "  Joins FILEs (in order, separated by a newline), tokenizes them, and writes\n"
    "  DIR/val_000000.bin ... (the first F of the tokens) and DIR/train_000000.bin ...\n"
    "  in llm.c shard format.\n"
    "  --out DIR           output directory (created if missing)\n"
    "  --tokenizer NAME    byte (default; vocab 256)\n"
    "  --val-fraction F    fraction of tokens for validation, in [0, 1) (default 0.1)\n"
    "  --shard-tokens N    tokens per shard file (default 100000000)\n";

struct Options {
  std::string out;
  std::string tokenizer = "byte";
  double val_fraction = 0.1;
  int64_t shard_tokens = 100'000'000;
  std::vector<std::string> inputs;
  bool help = false;
};

double parse_fraction(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || errno != 0 || !std::isfinite(v) || v < 0.0 || v >= 1.0) {
    throw InputError(fmt::format("{}: '{}' is not a number in [0, 1)", flag, text));
  }
  return v;
}

int64_t parse_shard_tokens(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0 || v <= 0 || v > INT32_MAX) {
    throw InputError(
        fmt::format("{}: '{}' is not an integer in [1, {}]", flag, text, int64_t{INT32_MAX}));
  }
  return v;
}

Options parse_args(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      opt.help = true;
      return opt;
    }
    if (arg.rfind("--", 0) != 0 || arg == "--") {
      opt.inputs.push_back(arg);
      continue;
    }
    std::string value;
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      throw InputError(fmt::format("{} needs a value", arg));
    }
    if (arg == "--out") {
      opt.out = value;
    } else if (arg == "--tokenizer") {
      opt.tokenizer = value;
    } else if (arg == "--val-fraction") {
      opt.val_fraction = parse_fraction(arg, value);
    } else if (arg == "--shard-tokens") {
      opt.shard_tokens = parse_shard_tokens(arg, value);
    } else {
      throw InputError(fmt::format("unknown flag '{}' (see --help)", arg));
    }
  }
  if (opt.out.empty()) throw InputError("--out DIR is required (see --help)");
  if (opt.inputs.empty()) throw InputError("no input files given (see --help)");
  if (opt.tokenizer != "byte") {
    throw InputError(fmt::format("unknown tokenizer '{}' (built in: byte)", opt.tokenizer));
  }
  return opt;
}

std::string read_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    throw InputError(fmt::format("{}: is a directory, not a text file", path));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(fmt::format("{}: cannot read: {}", path, std::strerror(errno)));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw InputError(fmt::format("{}: read failed", path));
  return text.str();
}

// Writes tokens[begin, end) as PREFIX_000000.bin, PREFIX_000001.bin, ...: as few shards as fit
// shard_tokens each, split evenly, so no tail shard is too short for the loader's windows.
int write_split(const Options& opt, const std::string& prefix, const std::vector<uint16_t>& tokens,
                size_t begin, size_t end) {
  const size_t count = end - begin;
  const size_t per = static_cast<size_t>(opt.shard_tokens);
  const size_t files = (count + per - 1) / per;
  for (size_t k = 0; k < files; ++k) {
    const size_t lo = begin + k * count / files;
    const size_t hi = begin + (k + 1) * count / files;
    const std::string path =
        (std::filesystem::path(opt.out) / fmt::format("{}_{:06d}.bin", prefix, k)).string();
    kiln::write_shard(path, std::vector<uint16_t>(tokens.begin() + static_cast<ptrdiff_t>(lo),
                                                  tokens.begin() + static_cast<ptrdiff_t>(hi)));
    spdlog::info("wrote {} ({} tokens)", path, hi - lo);
  }
  return static_cast<int>(files);
}

void run(const Options& opt) {
  std::string text;
  for (size_t i = 0; i < opt.inputs.size(); ++i) {
    if (i > 0) text += '\n';
    text += read_file(opt.inputs[i]);
  }
  if (text.empty()) throw InputError("the input files contain no text");
  const std::vector<uint16_t> tokens = kiln::byte_encode(text);

  std::error_code ec;
  std::filesystem::create_directories(opt.out, ec);
  if (ec) throw InputError(fmt::format("{}: cannot create directory: {}", opt.out, ec.message()));

  const auto n_val = static_cast<size_t>(opt.val_fraction * static_cast<double>(tokens.size()));
  const int val_files = write_split(opt, "val", tokens, 0, n_val);
  const int train_files = write_split(opt, "train", tokens, n_val, tokens.size());
  spdlog::info(
      "{} tokens ({} tokenizer) from {} files: {} val tokens in {} shards, {} train "
      "tokens in {} shards, in {}",
      tokens.size(), opt.tokenizer, opt.inputs.size(), n_val, val_files, tokens.size() - n_val,
      train_files, opt.out);
}

}  // namespace

int main(int argc, char** argv) {
  return kiln::run_tool("prepare_data", [&] {
    const Options opt = parse_args(argc, argv);
    if (opt.help) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    run(opt);
    return 0;
  });
}
