// Writes DIR/seeds/: one file per sample frame (header + body), the fuzzer's
// seeds; and makes DIR/corpus/, where the fuzzer keeps what it finds.
#include <filesystem>
#include <fstream>

#include "tests/messages/samples.hpp"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  auto dir = std::filesystem::path(argv[1]);
  std::filesystem::create_directories(dir / "seeds");
  std::filesystem::create_directories(dir / "corpus");
  int i = 0;
  for (auto& f : troupe::test::sample_frames()) {
    auto h = troupe::messages::encode_header(f.header());
    std::ofstream out(dir / "seeds" / ("seed-" + std::to_string(i++)), std::ios::binary);
    out.write(reinterpret_cast<const char*>(h.data()), h.size());
    out.write(reinterpret_cast<const char*>(f.body_bytes().data()), f.body_bytes().size());
  }
  return 0;
}
