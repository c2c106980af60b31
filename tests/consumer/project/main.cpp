// Uses only the installed headers through dte::dte.
#include <dte/dte.hpp>

#include <cstdio>
#include <vector>

int main() {
  std::vector<float> theta{0.5f, 1.0f}, m{1e-3f, 0.0f}, v{1e-6f, 0.0f};
  const auto k =
      dte::AdamWInverse::bind({.lr = 1e-5, .weight_decay = 0.1, .step = 1}, theta, {m, v});
  int changed = 0;
  for (std::size_t i = 0; i < k.size(); ++i)
    changed += dte::BF16Detect::changed(k.current(i), k(i));
  std::printf("consumer: dte %s, %d of %zu changed\n", dte::version_string, changed, k.size());
  return k.size() == 2 ? 0 : 1;
}
