// Byte-level tokenizer: token id = byte value, vocab 256. It is lossless for any input (UTF-8
// or not), which makes it the tokenizer for tests and tiny runs. Other vocabularies (GPT-2's BPE,
// a public model's own) come from a Hugging Face tokenizer.json: prepare_data --tokenizer hands
// them to the `tokenizers` library (tools/hf_tokenize.py), so kiln carries no BPE of its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

constexpr int kByteVocabSize = 256;

std::vector<uint16_t> byte_encode(std::string_view text);
// InputError when an id is outside [0, 256): such a token did not come from byte_encode.
std::string byte_decode(const uint16_t* tokens, size_t count);
std::string byte_decode(const std::vector<uint16_t>& tokens);
std::string byte_decode(const std::vector<int32_t>& tokens);

}  // namespace kiln
