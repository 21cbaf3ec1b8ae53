// Copyright 2025 The jax_ep Authors. SPDX-License-Identifier: Apache-2.0
//
// The registry of the native groups: every group of this process by its
// process-unique id, the lookup the FFI handlers make on every call (never
// throws), and the queries of the management API that only read a group
// (runtime/group.h).

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ffi/runtime/group.h"
#include "ffi/runtime/group_internal.h"

namespace jax_ep::runtime {
namespace {

std::map<int64_t, std::shared_ptr<Group>>& Registry() {
  static auto* groups = new std::map<int64_t, std::shared_ptr<Group>>();
  return *groups;
}

std::atomic<int64_t> next_group_id{1};

using detail::FindOrThrow;
using detail::RegistryMutex;

}  // namespace

namespace detail {

std::mutex& RegistryMutex() {
  static std::mutex* mu = new std::mutex();
  return *mu;
}

int64_t Register(std::shared_ptr<Group> group) {
  group->id = next_group_id.fetch_add(1);
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Registry()[group->id] = group;
  return group->id;
}

std::shared_ptr<Group> Unregister(int64_t group_id) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(group_id);
  if (it == Registry().end()) return nullptr;
  std::shared_ptr<Group> group = std::move(it->second);
  Registry().erase(it);
  return group;
}

std::shared_ptr<Group> FindOrThrow(int64_t group_id, const char* fn) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(group_id);
  if (it == Registry().end()) {
    throw std::invalid_argument(std::string(fn) +
                                ": unknown native group id " +
                                std::to_string(group_id));
  }
  return it->second;
}

}  // namespace detail

std::vector<uint64_t> PointerTable(int64_t group_id) {
  auto g = FindOrThrow(group_id, "group_pointer_table");
  return g->table_host;
}

bool ReceivesWhileSending(int64_t group_id) {
  return FindOrThrow(group_id, "group_receives_while_sending")
      ->receive_while_sending;
}

std::optional<std::string> ErrorMessage(int64_t group_id) {
  auto g = FindOrThrow(group_id, "group_error");
  if (std::optional<std::string> msg = PendingError(*g)) return msg;
  // NOTES: a ConnectLocal set is addressed by its primary id (the one group_id
  // of the program), but a timeout lands in the mailbox of the member whose
  // device spun: look at every member, or PeerBackend's status check on a
  // non-primary device would raise without the op / rank / peer message.
  std::vector<std::shared_ptr<Group>> members;
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    for (int64_t id : g->local_siblings) {
      auto it = Registry().find(id);
      if (id != group_id && it != Registry().end())
        members.push_back(it->second);
    }
  }
  for (const auto& member : members) {
    if (std::optional<std::string> msg = PendingError(*member)) return msg;
  }
  return std::nullopt;
}

LookupResult Lookup(int64_t group_id, int device) noexcept {
  LookupResult result;
  try {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    auto& registry = Registry();
    auto it = registry.find(group_id);
    if (it == registry.end()) {
      result.error = "unknown native group id " + std::to_string(group_id) +
                     " (destroyed, or created in another process)";
      return result;
    }
    std::shared_ptr<Group> g = it->second;
    if (g->config.device != device) {
      // One program serves every local device: pick the set's member here.
      std::shared_ptr<Group> match;
      int matches = 0;
      for (int64_t sibling : g->local_siblings) {
        auto s = registry.find(sibling);
        if (s != registry.end() && s->second->config.device == device) {
          match = s->second;
          ++matches;
        }
      }
      if (matches != 1) {
        result.error =
            "native group " + std::to_string(group_id) +
            " lives on device " + std::to_string(g->config.device) +
            " but the op runs on device " + std::to_string(device) +
            (matches == 0 ? std::string(" (no group of its set is there)")
                          : std::string(" (several groups of its set are "
                                        "there)"));
        return result;
      }
      g = match;
    }
    if (!g->connected) {
      result.error = "native group " + std::to_string(g->id) +
                     " is not connected (call group_connect or "
                     "group_connect_local first)";
      return result;
    }
    result.group = std::move(g);
  } catch (...) {
    result.group = nullptr;
    result.error = "native group lookup failed";
  }
  return result;
}

}  // namespace jax_ep::runtime
