// SPDX-License-Identifier: Apache-2.0
// The global operator new and delete of the `dte` command, metered (alloc_meter.hpp). Each block
// carries a 16-byte header just before the pointer returned: its size, its account, and the
// distance back to what malloc returned (16, or the alignment for over-aligned types).
#include "alloc_meter.hpp"

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>

namespace dte::tool::meter {

namespace {

struct Header {
  std::size_t size;
  std::uint32_t account;
  std::uint32_t offset;
};
static_assert(sizeof(Header) == 16);

struct Account {
  std::atomic<std::int64_t> current{0}, peak{0};
};

Account table[accounts];
std::atomic<int> current_account{0};

void add(int a, std::int64_t n) noexcept {
  const std::int64_t now = table[a].current.fetch_add(n, std::memory_order_relaxed) + n;
  std::int64_t p = table[a].peak.load(std::memory_order_relaxed);
  while (now > p && !table[a].peak.compare_exchange_weak(p, now, std::memory_order_relaxed)) {
  }
}

void* allocate(std::size_t size, std::size_t align) noexcept {
  const std::size_t offset = align > sizeof(Header) ? align : sizeof(Header);
  if (size > static_cast<std::size_t>(-1) / 2) return nullptr;
  void* base = nullptr;
  if (align > alignof(std::max_align_t)) {
    const std::size_t total = (size + offset + align - 1) / align * align;
    base = std::aligned_alloc(align, total);
  } else {
    base = std::malloc(size + offset);
  }
  if (base == nullptr) return nullptr;
  auto* user = static_cast<std::byte*>(base) + offset;
  const int a = current_account.load(std::memory_order_relaxed);
  *reinterpret_cast<Header*>(user - sizeof(Header)) = {size, static_cast<std::uint32_t>(a),
                                                       static_cast<std::uint32_t>(offset)};
  add(a, static_cast<std::int64_t>(size));
  return user;
}

void release(void* p) noexcept {
  if (p == nullptr) return;
  auto* user = static_cast<std::byte*>(p);
  const Header h = *reinterpret_cast<const Header*>(user - sizeof(Header));
  add(static_cast<int>(h.account), -static_cast<std::int64_t>(h.size));
  std::free(user - h.offset);
}

void* allocate_or_throw(std::size_t size, std::size_t align) {
  for (;;) {
    if (void* p = allocate(size == 0 ? 1 : size, align)) return p;
    std::new_handler handler = std::get_new_handler();
    if (handler == nullptr) throw std::bad_alloc();
    handler();
  }
}

}  // namespace

void charge(int a) noexcept {
  current_account.store(a >= 0 && a < accounts ? a : 0, std::memory_order_relaxed);
}
int charged() noexcept {
  return current_account.load(std::memory_order_relaxed);
}
Figures figures(int a) noexcept {
  return {table[a].current.load(std::memory_order_relaxed),
          table[a].peak.load(std::memory_order_relaxed)};
}
void reset_peak(int a) noexcept {
  table[a].peak.store(table[a].current.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

}  // namespace dte::tool::meter

using dte::tool::meter::allocate;
using dte::tool::meter::allocate_or_throw;
using dte::tool::meter::release;

void* operator new(std::size_t n) {
  return allocate_or_throw(n, alignof(std::max_align_t));
}
void* operator new[](std::size_t n) {
  return allocate_or_throw(n, alignof(std::max_align_t));
}
void* operator new(std::size_t n, std::align_val_t a) {
  return allocate_or_throw(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return allocate_or_throw(n, static_cast<std::size_t>(a));
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  return allocate(n == 0 ? 1 : n, alignof(std::max_align_t));
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return allocate(n == 0 ? 1 : n, alignof(std::max_align_t));
}
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return allocate(n == 0 ? 1 : n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return allocate(n == 0 ? 1 : n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept {
  release(p);
}
void operator delete[](void* p) noexcept {
  release(p);
}
void operator delete(void* p, std::size_t) noexcept {
  release(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  release(p);
}
void operator delete(void* p, std::align_val_t) noexcept {
  release(p);
}
void operator delete[](void* p, std::align_val_t) noexcept {
  release(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  release(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  release(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  release(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  release(p);
}
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  release(p);
}
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  release(p);
}
