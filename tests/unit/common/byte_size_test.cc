// mrd/byte_size.h: the one reading of byte counts that mrd's flags, the
// tenants file, mrctl and the benchmarks share.
#include "mrd/byte_size.h"

#include <cstdint>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/marshalling.h"
#include "gtest/gtest.h"
#include "mrd/status.h"

namespace mrd {
namespace {

TEST(ByteSizeTest, NumbersAndUnits) {
  const struct {
    const char* text;
    uint64_t bytes;
  } kCases[] = {
      {"0", 0},
      {"4096", 4096},
      {" 4096 ", 4096},
      {"0x1000", 4096},
      {"0X10", 16},
      {"4K", 4096},
      {"4k", 4096},
      {"4KiB", 4096},
      {"4KB", 4000},
      {"16M", uint64_t{16} << 20},
      {"16m", uint64_t{16} << 20},
      {"16MiB", uint64_t{16} << 20},
      {"2MB", 2000000},
      {"1G", uint64_t{1} << 30},
      {"8g", uint64_t{8} << 30},
      {"3GiB", uint64_t{3} << 30},
      {"1GB", 1000000000},
      {"1T", uint64_t{1} << 40},
      {"2TiB", uint64_t{2} << 40},
      {"1TB", 1000000000000},
      {"1P", uint64_t{1} << 50},
      {"1PiB", uint64_t{1} << 50},
      {"1PB", 1000000000000000},
      {"16383P", uint64_t{16383} << 50},
      {"18446744073709551615", UINT64_MAX},
  };
  for (const auto& c : kCases) {
    absl::StatusOr<uint64_t> bytes = ParseByteSize(c.text);
    ASSERT_TRUE(bytes.ok()) << c.text << ": " << bytes.status();
    EXPECT_EQ(*bytes, c.bytes) << c.text;
  }
}

TEST(ByteSizeTest, WhatIsNotASizeIsRefusedByName) {
  for (const char* text :
       {"", " ", "K", "-1", "1.5G", "8Q", "8 G", "8kib", "8kb", "8Gi", "0x",
        "0xZZ", "G8", "18446744073709551616", "16384P", "16777216T",
        "0x10000000000000000"}) {
    absl::StatusOr<uint64_t> bytes = ParseByteSize(text);
    ASSERT_FALSE(bytes.ok()) << "'" << text << "' gave " << *bytes;
    EXPECT_EQ(bytes.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(GetErrorDetail(bytes.status()).reason(), "BAD_SIZE") << text;
    EXPECT_NE(bytes.status().message().find(std::string("'") + text + "'"),
              absl::string_view::npos)
        << bytes.status();
  }
}

TEST(ByteSizeTest, FormatIsTheShortestExactSpellingAndReadsBack) {
  EXPECT_EQ(FormatByteSize(0), "0");
  EXPECT_EQ(FormatByteSize(1000), "1000");
  EXPECT_EQ(FormatByteSize(4096), "4K");
  EXPECT_EQ(FormatByteSize(1536 * 1024), "1536K");
  EXPECT_EQ(FormatByteSize(uint64_t{16} << 30), "16G");
  EXPECT_EQ(FormatByteSize(uint64_t{1} << 40), "1T");
  EXPECT_EQ(FormatByteSize(uint64_t{3} << 60), "3072P");
  for (uint64_t bytes :
       {uint64_t{0}, uint64_t{1}, uint64_t{4095}, uint64_t{1} << 20,
        (uint64_t{5} << 30) + 4096, UINT64_MAX, uint64_t{3} << 60}) {
    absl::StatusOr<uint64_t> back = ParseByteSize(FormatByteSize(bytes));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, bytes);
  }
}

TEST(ByteSizeTest, AFlagOfBytesTakesUnitsAndSaysWhyNot) {
  ByteSize size;
  std::string error;
  EXPECT_TRUE(absl::ParseFlag("1G", &size, &error)) << error;
  EXPECT_EQ(size.bytes, uint64_t{1} << 30);
  EXPECT_EQ(absl::UnparseFlag(size), "1G");
  EXPECT_FALSE(absl::ParseFlag("1Q", &size, &error));
  EXPECT_NE(error.find("'1Q' is not a size"), std::string::npos) << error;
  EXPECT_EQ(size.bytes, uint64_t{1} << 30);  // unchanged
}

}  // namespace
}  // namespace mrd
