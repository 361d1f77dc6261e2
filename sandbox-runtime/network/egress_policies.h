// EgressPolicies: the egress policy of every sandbox that may get out, by
// sandbox id (docs/egress.md). The lifecycle core writes it (a create, a
// network update, an end) and so do template builds (their sandboxes);
// the egress proxy reads it for each connection and listens for changes,
// closing the open connections a new policy refuses, and so does the
// host's network (host_network.h), rewriting the sandbox's nftables chain. It is built before
// both, so neither needs the other: no hook is bound after construction.
//
// Thread safety: internally synchronised. The listener is called without
// the table's lock (it may read the table) and never after unlisten()
// has returned.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/thread_annotations.h"
#include "sandbox-runtime/network/egress_policy.h"

namespace sg::network {

class EgressPolicies {
 public:
  class Listener {
   public:
    virtual ~Listener() = default;
    // id's policy changed or is gone.
    virtual void policy_changed(const std::string& id) = 0;
  };

  void set(const std::string& id, EgressPolicy policy);
  void erase(const std::string& id);
  // nullopt: the sandbox may not get out (gone, or never had egress).
  std::optional<EgressPolicy> get(const std::string& id) const;
  size_t size() const;

  // Listeners (the egress proxy, the host network), each from its
  // constructor to its destructor.
  void listen(Listener* l);
  void unlisten(Listener* l);

 private:
  void notify(const std::string& id);

  mutable Mutex mu_;
  std::map<std::string, EgressPolicy> policies_ GUARDED_BY(mu_);
  // Held across a notification, so unlisten() waits for one in flight.
  Mutex listener_mu_;
  std::vector<Listener*> listeners_ GUARDED_BY(listener_mu_);
};

}  // namespace sg::network
