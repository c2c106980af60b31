// Uses the installed safetensors reader/writer through dte::io.
#include <dte/io/safetensors.hpp>

#include <cstdio>
#include <vector>

int main() {
  dte::io::SafetensorsWriter w;
  const std::vector<float> x{1.0f, 2.0f, 3.0f};
  w.add<float>("x", {3}, x);
  const auto f = dte::io::SafetensorsFile::parse(w.serialize());
  const auto back = f.read_as<float>("x");
  std::printf("consumer_io: %zu elements round-tripped\n", back.size());
  return back == x ? 0 : 1;
}
