// Byte-level tokenizer: a byte is its own token id. See tokenizer.h.
#include "data/tokenizer.h"

#include <fmt/format.h>

#include "base/error.h"

namespace kiln {
namespace {

template <class Id>
std::string decode_ids(const Id* tokens, size_t count) {
  std::string text(count, '\0');
  for (size_t i = 0; i < count; ++i) {
    const int64_t id = tokens[i];
    if (id < 0 || id >= kByteVocabSize) {
      throw InputError(fmt::format("byte_decode: token id {} at index {} is not a byte (vocab {})",
                                   id, i, kByteVocabSize));
    }
    text[i] = static_cast<char>(static_cast<unsigned char>(id));
  }
  return text;
}

}  // namespace

std::vector<uint16_t> byte_encode(std::string_view text) {
  std::vector<uint16_t> tokens(text.size());
  for (size_t i = 0; i < text.size(); ++i) tokens[i] = static_cast<unsigned char>(text[i]);
  return tokens;
}

std::string byte_decode(const uint16_t* tokens, size_t count) {
  return decode_ids(tokens, count);
}

std::string byte_decode(const std::vector<uint16_t>& tokens) {
  return decode_ids(tokens.data(), tokens.size());
}

std::string byte_decode(const std::vector<int32_t>& tokens) {
  return decode_ids(tokens.data(), tokens.size());
}

}  // namespace kiln
