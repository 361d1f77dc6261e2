// EgressPolicies: see egress_policies.h.
#include "sandbox-runtime/network/egress_policies.h"

#include <vector>

namespace sg::network {

void EgressPolicies::set(const std::string& id, EgressPolicy policy) {
  {
    MutexLock g(mu_);
    policies_[id] = std::move(policy);
  }
  notify(id);
}

void EgressPolicies::erase(const std::string& id) {
  {
    MutexLock g(mu_);
    if (policies_.erase(id) == 0) return;
  }
  notify(id);
}

std::optional<EgressPolicy> EgressPolicies::get(const std::string& id) const {
  MutexLock g(mu_);
  auto it = policies_.find(id);
  if (it == policies_.end()) return std::nullopt;
  return it->second;
}

size_t EgressPolicies::size() const {
  MutexLock g(mu_);
  return policies_.size();
}

void EgressPolicies::listen(Listener* l) {
  MutexLock g(listener_mu_);
  listeners_.push_back(l);
}

void EgressPolicies::unlisten(Listener* l) {
  MutexLock g(listener_mu_);
  std::erase(listeners_, l);
}

void EgressPolicies::notify(const std::string& id) {
  MutexLock g(listener_mu_);
  for (Listener* l : listeners_) l->policy_changed(id);
}

}  // namespace sg::network
