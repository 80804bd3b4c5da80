// TFRecord framing, the container of TensorBoard's event files: each record is its length
// (uint64, little-endian), the masked CRC32C of those 8 bytes, the data, and the masked CRC32C
// of the data. CRC32C (Castagnoli) is computed here with a slicing-by-8 table: Debian packages
// no C or C++ CRC32C library (only Python's), and the record checksums cover a few hundred bytes
// a step, so a table is fast enough and keeps the build free of another dependency.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kiln {

// CRC-32C of `n` bytes, continuing from `crc` (0 to start): crc32c("123456789") = 0xE3069283.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

// TFRecord's masking, so a CRC of data that holds CRCs is not degenerate:
// ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t n);

// `data` framed as one TFRecord.
std::string tfrecord(const std::string& data);

}  // namespace kiln
