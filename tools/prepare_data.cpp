// prepare_data: text files -> llm.c token shards. With the byte tokenizer the inputs are joined
// (in the order given, separated by "\n") and tokenized as ONE stream, or with --doc-separator
// each file is a document preceded by that byte, which no document may hold (so every
// occurrence of it in a shard is a document start, and nothing else need be recorded); with a
// Hugging Face tokenizer.json each file is a document, preceded by the tokenizer's end-of-text
// token, and tools/hf_tokenize.py tokenizes them with the `tokenizers` library (exact ids, its Rust
// BPE on every core). The FIRST val-fraction of the tokens become val shards and the rest train
// shards, so validation is a fixed, contiguous slice. Vocabularies up to 65,536 give uint16 shards,
// larger ones llm.c's uint32 format (data/shard.h).
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "base/error.h"
#include "base/log.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "tools/tool_args.h"

namespace {

using kiln::InputError;
namespace fs = std::filesystem;

constexpr const char* kUsage =
    "usage: prepare_data --out DIR [--tokenizer byte|FILE.json] [--eos TOKEN] [--val-fraction F]\n"
    "                    [--shard-tokens N] [--doc-separator BYTE] FILE...\n"
    "  Joins FILEs (in order, separated by a newline), tokenizes them, and writes\n"
    "  DIR/val_000000.bin ... (the first F of the tokens) and DIR/train_000000.bin ...\n"
    "  in llm.c shard format.\n"
    "  --out DIR           output directory (created if missing)\n"
    "  --tokenizer NAME    byte (default; vocab 256) or a Hugging Face tokenizer.json (each\n"
    "                      FILE a document, preceded by the end-of-text token; vocab from the file)\n"
    "  --eos TOKEN         the end-of-text token (default: tokenizer_config.json's, or a usual name)\n"
    "  --val-fraction F    fraction of tokens for validation, in [0, 1) (default 0.1)\n"
    "  --shard-tokens N    tokens per shard file (default 100000000)\n"
    "  --doc-separator B   byte tokenizer: each FILE a document preceded by byte B (0..255, e.g.\n"
    "                      0), which no FILE may contain, instead of files joined by a newline\n";

struct Options {
  std::string out;
  std::string tokenizer = "byte";
  std::string eos;
  double val_fraction = 0.1;
  int64_t shard_tokens = 100'000'000;
  int doc_separator = -1;  // byte tokenizer: the byte before each document (-1: join by "\n")
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
  const std::optional<kiln::ToolArgs> args = kiln::parse_tool_args(argc, argv, kUsage, SIZE_MAX);
  if (!args) {
    opt.help = true;
    return opt;
  }
  opt.inputs = args->positional;
  for (const auto& [arg, value] : args->flags) {
    if (arg == "--out") {
      opt.out = value;
    } else if (arg == "--tokenizer") {
      opt.tokenizer = value;
    } else if (arg == "--eos") {
      opt.eos = value;
    } else if (arg == "--val-fraction") {
      opt.val_fraction = parse_fraction(arg, value);
    } else if (arg == "--doc-separator") {
      char* end = nullptr;
      const long v = std::strtol(value.c_str(), &end, 10);
      if (value.empty() || *end != '\0' || v < 0 || v > 255)
        throw InputError(
            fmt::format("--doc-separator: '{}' is not a byte value in [0, 255]", value));
      opt.doc_separator = static_cast<int>(v);
    } else if (arg == "--shard-tokens") {
      opt.shard_tokens = parse_shard_tokens(arg, value);
    } else {
      throw InputError(fmt::format("unknown flag '{}' (see --help)", arg));
    }
  }
  if (opt.out.empty()) throw InputError("--out DIR is required (see --help)");
  if (opt.inputs.empty()) throw InputError("no input files given (see --help)");
  const bool json = opt.tokenizer.size() > 5 &&
                    opt.tokenizer.compare(opt.tokenizer.size() - 5, 5, ".json") == 0;
  if (opt.tokenizer != "byte" && !json) {
    throw InputError(fmt::format(
        "unknown tokenizer '{}' (byte, or a Hugging Face tokenizer.json file)", opt.tokenizer));
  }
  if (json && !std::filesystem::is_regular_file(opt.tokenizer))
    throw InputError(fmt::format("--tokenizer {}: no such file", opt.tokenizer));
  if (!opt.eos.empty() && !json) throw InputError("--eos applies to a tokenizer.json only");
  if (opt.doc_separator >= 0 && json)
    throw InputError(
        "--doc-separator applies to the byte tokenizer only (a tokenizer.json's documents are "
        "separated by its end-of-text token, --eos)");
  return opt;
}

std::string read_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    throw InputError(fmt::format("{}: is a directory, not a text file", path));
  }
  // A device (/dev/zero) never ends; a pipe does.
  if (::stat(path.c_str(), &st) == 0 && (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)))
    throw InputError(fmt::format("{}: is a device, not a text file", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(fmt::format("{}: cannot read: {}", path, std::strerror(errno)));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw InputError(fmt::format("{}: read failed", path));
  return text.str();
}

// The shard set a run writes into --out. Every shard is written into a staging directory
// inside --out, then all are renamed into place, then the shards of an earlier set that the new
// one does not replace are removed: a full disk or a crash before the renames leaves the earlier
// set as it was, and no stale shard of it is left for a train_*.bin glob to mix in.
class ShardSet {
 public:
  explicit ShardSet(const std::string& out)
      : out_(out), staging_(out_ / fmt::format(".prepare_data.{}", ::getpid())) {
    std::error_code ec;
    for (const fs::path& p : entries()) {  // staging left by a killed run
      const std::string name = p.filename().string();
      if (name.rfind(".prepare_data.", 0) != 0) continue;
      const long pid = std::strtol(name.c_str() + 14, nullptr, 10);
      if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)
        fs::remove_all(p, ec);
    }
    fs::remove_all(staging_, ec);
    if (!fs::create_directory(staging_, ec) || ec)
      throw InputError(fmt::format("{}: cannot create a staging directory: {}", staging_.string(),
                                   ec ? ec.message() : std::string("exists")));
  }
  ~ShardSet() {
    std::error_code ec;
    fs::remove_all(staging_, ec);
  }
  ShardSet(const ShardSet&) = delete;
  ShardSet& operator=(const ShardSet&) = delete;

  // Where the shard `name` is written until publish().
  std::string stage(const std::string& name) {
    names_.push_back(name);
    return (staging_ / name).string();
  }

  void publish() {
    for (const std::string& name : names_) {
      std::error_code ec;
      fs::rename(staging_ / name, out_ / name, ec);
      if (ec)
        throw InputError(
            fmt::format("{}: cannot rename into place: {}", (out_ / name).string(), ec.message()));
    }
    int removed = 0;
    for (const fs::path& p : entries()) {
      const std::string name = p.filename().string();
      if (!is_shard_name(name) || std::count(names_.begin(), names_.end(), name)) continue;
      std::error_code ec;
      if (fs::remove(p, ec)) ++removed;
      if (ec)
        throw InputError(fmt::format("{}: a shard of an earlier set, cannot remove it: {}",
                                     p.string(), ec.message()));
    }
    if (removed)
      spdlog::info("removed {} shard(s) of an earlier set from {}", removed, out_.string());
  }

 private:
  // --out's entries, listed before any is removed.
  std::vector<fs::path> entries() const {
    std::vector<fs::path> paths;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(out_, ec)) paths.push_back(e.path());
    return paths;
  }

  // What write_split names its shards: train_NNNNNN.bin, val_NNNNNN.bin.
  static bool is_shard_name(const std::string& name) {
    const auto digit = [](char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; };
    for (const char* prefix : {"train_", "val_"}) {
      const size_t n = std::strlen(prefix);
      if (name.size() == n + 10 && name.compare(0, n, prefix) == 0 &&
          name.compare(n + 6, 4, ".bin") == 0 &&
          std::all_of(name.begin() + static_cast<ptrdiff_t>(n),
                      name.begin() + static_cast<ptrdiff_t>(n + 6), digit))
        return true;
    }
    return false;
  }

  fs::path out_, staging_;
  std::vector<std::string> names_;
};

// Writes tokens[begin, end) as PREFIX_000000.bin, PREFIX_000001.bin, ...: as few shards as fit
// shard_tokens each, split evenly, so no tail shard is too short for the loader's windows.
template <class Token>
int write_split(const Options& opt, ShardSet& set, const std::string& prefix,
                const std::vector<Token>& tokens, size_t begin, size_t end) {
  const size_t count = end - begin;
  const size_t per = static_cast<size_t>(opt.shard_tokens);
  const size_t files = (count + per - 1) / per;
  for (size_t k = 0; k < files; ++k) {
    const size_t lo = begin + k * count / files;
    const size_t hi = begin + (k + 1) * count / files;
    const std::string name = fmt::format("{}_{:06d}.bin", prefix, k);
    const std::vector<Token> part(tokens.begin() + static_cast<ptrdiff_t>(lo),
                                  tokens.begin() + static_cast<ptrdiff_t>(hi));
    if constexpr (sizeof(Token) == 2)
      kiln::write_shard(set.stage(name), part);
    else
      kiln::write_shard32(set.stage(name), part);
    spdlog::info("wrote {} ({} tokens)", (fs::path(opt.out) / name).string(), hi - lo);
  }
  return static_cast<int>(files);
}

// 'text' as one shell word.
std::string shell_quote(const std::string& text) {
  std::string out = "'";
  for (char c : text) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

struct HfTokens {
  std::vector<uint32_t> ids;
  int vocab_size = 0;
  int eos_id = -1;               // the token before each document
  int eos_inside = 0;            // documents whose own text encodes to it
  std::string eos_inside_first;  // the first of them
  std::string summary;  // the helper's JSON line
};

// The integer after "key": in the helper's JSON line, or `otherwise`.
int json_int(const std::string& line, const std::string& key, int otherwise) {
  const size_t at = line.find("\"" + key + "\": ");
  return at == std::string::npos ? otherwise : std::atoi(line.c_str() + at + key.size() + 4);
}

// Runs tools/hf_tokenize.py (KILN_HF_TOKENIZE overrides its path, KILN_PYTHON the interpreter)
// into a temp file in the output folder and reads its uint32 ids back.
HfTokens hf_tokenize(const Options& opt) {
  const char* script_env = std::getenv("KILN_HF_TOKENIZE");
  const char* python_env = std::getenv("KILN_PYTHON");
  const std::string script = script_env ? script_env : KILN_SOURCE_DIR "/tools/hf_tokenize.py";
  const std::string ids_path = (std::filesystem::path(opt.out) / ".hf_tokens.tmp").string();
  std::string cmd = std::string(python_env ? python_env : "python3") + " " + shell_quote(script) +
                    " " + shell_quote(opt.tokenizer) + " " + shell_quote(ids_path);
  if (!opt.eos.empty()) cmd += " --eos " + shell_quote(opt.eos);
  for (const std::string& in : opt.inputs) cmd += " " + shell_quote(in);
  std::FILE* pipe = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!pipe) throw std::runtime_error("cannot run " + cmd);
  std::string output;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) output.append(buf, n);
  const int status = ::pclose(pipe);
  while (!output.empty() && output.back() == '\n') output.pop_back();
  HfTokens out;
  out.summary = output.substr(output.rfind('\n') + 1);
  const size_t vocab_at = out.summary.find("\"vocab_size\": ");
  if (status != 0 || vocab_at == std::string::npos) {
    std::filesystem::remove(ids_path);
    throw InputError(output.empty() ? "tokenizing with " + opt.tokenizer + " failed" : output);
  }
  out.vocab_size = std::atoi(out.summary.c_str() + vocab_at + 14);
  out.eos_id = json_int(out.summary, "eos_id", -1);
  out.eos_inside = json_int(out.summary, "eos_inside", 0);
  const std::string first_key = "\"eos_inside_first\": \"";
  if (const size_t at = out.summary.find(first_key); at != std::string::npos) {
    const size_t begin = at + first_key.size();
    out.eos_inside_first = out.summary.substr(begin, out.summary.find('"', begin) - begin);
  }
  std::ifstream in(ids_path, std::ios::binary);
  in.seekg(0, std::ios::end);
  out.ids.resize(static_cast<size_t>(in.tellg()) / 4);
  in.seekg(0);
  in.read(reinterpret_cast<char*>(out.ids.data()), static_cast<std::streamsize>(out.ids.size() * 4));
  std::filesystem::remove(ids_path);
  if (!in) throw std::runtime_error(ids_path + ": cannot read the tokenizer's output");
  return out;
}

template <class Token>
void write_splits(const Options& opt, const std::vector<Token>& tokens) {
  const auto n_val = static_cast<size_t>(opt.val_fraction * static_cast<double>(tokens.size()));
  ShardSet set(opt.out);
  const int val_files = write_split(opt, set, "val", tokens, 0, n_val);
  const int train_files = write_split(opt, set, "train", tokens, n_val, tokens.size());
  set.publish();
  spdlog::info(
      "{} tokens ({} tokenizer, {}-bit shards) from {} files: {} val tokens in {} shards, {} "
      "train tokens in {} shards, in {}",
      tokens.size(), opt.tokenizer, 8 * sizeof(Token), opt.inputs.size(), n_val, val_files,
      tokens.size() - n_val, train_files, opt.out);
}

void run(const Options& opt) {
  std::error_code ec;
  std::filesystem::create_directories(opt.out, ec);
  if (ec) throw InputError(fmt::format("{}: cannot create directory: {}", opt.out, ec.message()));
  if (opt.tokenizer != "byte") {
    HfTokens hf = hf_tokenize(opt);
    spdlog::info("{}", hf.summary);
    if (hf.ids.empty()) throw InputError("the input files contain no text");
    spdlog::info("vocabulary {} (set model.vocab_size: {})", hf.vocab_size, hf.vocab_size);
    // Every document begins with the end-of-text token: the separator document masking takes.
    spdlog::info(
        "documents begin with token {} (for document masking: data.document_separator: "
        "{})",
        hf.eos_id, hf.eos_id);
    if (hf.eos_inside > 0)
      spdlog::warn(
          "{} document(s) hold the end-of-text token in their own text (the first: {}); with "
          "data.document_mask each occurrence would begin a false document there",
          hf.eos_inside, hf.eos_inside_first);
    if (hf.vocab_size <= 65536) {
      write_splits(opt, std::vector<uint16_t>(hf.ids.begin(), hf.ids.end()));
    } else {
      write_splits(opt, hf.ids);
    }
    return;
  }
  std::string text;
  for (size_t i = 0; i < opt.inputs.size(); ++i) {
    const std::string doc = read_file(opt.inputs[i]);
    if (opt.doc_separator >= 0) {
      const size_t at = doc.find(static_cast<char>(opt.doc_separator));
      if (at != std::string::npos)
        throw InputError(fmt::format(
            "{}: holds byte {} (at offset {}), the --doc-separator: it would start a false "
            "document there (pick a byte no input holds)",
            opt.inputs[i], opt.doc_separator, at));
      text += static_cast<char>(opt.doc_separator);
    } else if (i > 0) {
      text += '\n';
    }
    text += doc;
  }
  if (opt.doc_separator >= 0)
    spdlog::info(
        "{} documents, each preceded by byte {} (for document masking: data.document_separator: "
        "{})",
        opt.inputs.size(), opt.doc_separator, opt.doc_separator);
  if (text.size() == opt.inputs.size() * (opt.doc_separator >= 0))
    throw InputError("the input files contain no text");
  write_splits(opt, kiln::byte_encode(text));
}

}  // namespace

int main(int argc, char** argv) {
  kiln::log_to_stderr();  // stdout is the tool's output alone
  return kiln::run_tool("prepare_data", [&] {
    const Options opt = parse_args(argc, argv);
    if (opt.help) return 0;  // the usage is printed
    run(opt);
    return 0;
  });
}
