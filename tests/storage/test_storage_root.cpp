// SPDX-License-Identifier: Apache-2.0
// The storage root's layout (storage/layout.hpp): version directory names that sort as the
// versions, and the LATEST pointer: written atomically, read back exactly, absent before the
// first publication, and refused when it is anything else (torn, foreign, a symlink, too big).
#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "dte/error.hpp"
#include "dte/storage/layout.hpp"

using namespace dte;
namespace fs = std::filesystem;

namespace {
struct Root {
  fs::path path = fs::temp_directory_path() / ("dte-layout-" + std::to_string(::getpid()));
  Root() {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~Root() { fs::remove_all(path); }
  void latest(const std::string& text) const {
    std::ofstream(path / "LATEST", std::ios::binary) << text;
  }
};
}  // namespace

TEST_CASE("version directories sort as their versions") {
  CHECK(storage::version_dir_name(12) == "v00000000000000000012");
  CHECK(storage::version_dir_name(9) < storage::version_dir_name(10));
  CHECK(storage::version_dir_name(UINT64_MAX - 1).size() == 21);
}

TEST_CASE("LATEST: absent, written, replaced, read back") {
  const Root r;
  CHECK_FALSE(storage::read_latest(r.path).has_value());
  storage::write_latest(r.path, 7);
  CHECK(storage::read_latest(r.path) == Version{7});
  storage::write_latest(r.path, 8);
  CHECK(storage::read_latest(r.path) == Version{8});
  for (const auto& e : fs::directory_iterator(r.path))  // no temporary left behind
    CHECK(e.path().filename() == "LATEST");
}

TEST_CASE("LATEST that is not exactly what dte writes is refused") {
  const Root r;
  for (const std::string& bad :
       {std::string(""), std::string("v0000000000000000001\n"),
        std::string("v000000000000000000012"), std::string("v00000000000000000012 \n"),
        std::string("x00000000000000000012\n"), std::string("v0000000000000000001a\n"),
        std::string(100, 'v'), std::string("v99999999999999999999\n")}) {
    INFO(bad);
    r.latest(bad);
    CHECK_THROWS_AS((void)storage::read_latest(r.path), format_error);
  }
  r.latest("v09223372036854775807\n");  // a valid number above the version limit
  CHECK_THROWS_AS((void)storage::read_latest(r.path), bounds_error);
  fs::remove(r.path / "LATEST");
  std::ofstream(r.path / "elsewhere") << storage::latest_text(3);
  fs::create_symlink(r.path / "elsewhere", r.path / "LATEST");
  CHECK_THROWS_AS((void)storage::read_latest(r.path), io_error);
}
