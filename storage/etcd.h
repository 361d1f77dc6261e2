// etcd v3 client over etcd's HTTP/JSON gateway (the grpc-gateway every
// etcd 3.4 member serves on its client URLs: POST /v3/kv/range, ...), for
// cluster mode (gateway/cluster.h, docs/cluster.md). No gRPC stack: each
// call is one JSON request (base/blocking_http.h); keys and values travel
// base64-encoded as the gateway wants.
//
// Endpoints: the members' client addresses. A call goes to the member
// that answered last and, when it cannot be reached, times out or answers
// 5xx (a member that lost its quorum), to the next one, so the loss of one
// member of three is not seen by callers.
//
// Thread-safe: calls may run concurrently (each has its own connection).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "base/blocking_http.h"
#include "base/status.h"

namespace sg::etcd {

struct KeyValue {
  std::string key, value;
  int64_t create_revision = 0, mod_revision = 0, version = 0, lease = 0;
};

struct RangeResult {
  std::vector<KeyValue> kvs;
  int64_t revision = 0;  // the store's revision when read
};

struct Event {
  enum class Type { kPut, kDelete };
  Type type = Type::kPut;
  KeyValue kv;  // for a delete: the key and mod_revision only
};

// One comparison of a transaction. target: "VERSION", "CREATE", "MOD",
// "VALUE", "LEASE"; result: "EQUAL", "NOT_EQUAL", "LESS", "GREATER".
struct Compare {
  std::string key;
  std::string target = "VERSION";
  std::string result = "EQUAL";
  int64_t number = 0;  // for VERSION, CREATE, MOD, LEASE
  std::string value;   // for VALUE
};

// One operation of a transaction branch.
struct Op {
  enum class Kind { kPut, kDelete };
  Kind kind = Kind::kPut;
  std::string key, value;
  int64_t lease = 0;
  static Op put(std::string k, std::string v, int64_t lease = 0) { return Op{Kind::kPut, std::move(k), std::move(v), lease}; }
  static Op del(std::string k) { return Op{Kind::kDelete, std::move(k), {}, 0}; }
};

struct TxnResult {
  bool succeeded = false;
  int64_t revision = 0;
};

// The end of the key range that holds every key starting with prefix.
std::string prefix_end(std::string_view prefix);

// "etcd://host:port,host:port" (or "http://...", or bare "host:port,...").
Result<std::vector<net::Endpoint>> parse_endpoints(std::string_view url);

class Client {
 public:
  explicit Client(std::vector<net::Endpoint> endpoints,
                  std::chrono::milliseconds timeout = std::chrono::milliseconds(2000));

  // Leases: a TTL in seconds; keep_alive returns the TTL left after the
  // renewal, kNotFound once the lease has expired.
  Result<int64_t> grant(int64_t ttl_s);
  Result<int64_t> keep_alive(int64_t lease);
  Status revoke(int64_t lease);

  // Returns the revision of the write.
  Result<int64_t> put(const std::string& key, const std::string& value, int64_t lease = 0);
  Result<RangeResult> get(const std::string& key);
  // Every key that starts with prefix, in key order (limit 0: all).
  Result<RangeResult> get_prefix(const std::string& prefix, int64_t limit = 0);
  // Returns how many keys were deleted.
  Result<int64_t> remove(const std::string& key);
  Result<TxnResult> txn(const std::vector<Compare>& compares, const std::vector<Op>& success,
                        const std::vector<Op>& failure = {});

  // Watches every key under prefix from start_revision (0: from now),
  // calling on_events for each batch until stop is set (Ok), on_events
  // returns false (Ok), or the stream fails (an error: the caller lists
  // again and watches from the revision it saw). kConflict when
  // start_revision was compacted away. Blocks: run it on a thread of its
  // own.
  Status watch_prefix(const std::string& prefix, int64_t start_revision,
                      const std::function<bool(const std::vector<Event>&, int64_t revision)>& on_events,
                      const std::atomic<bool>& stop);

  const std::vector<net::Endpoint>& endpoints() const { return endpoints_; }

 private:
  // POSTs a JSON body to path on a reachable member; the answer's body.
  Result<std::string> call(const std::string& path, const std::string& body);

  std::vector<net::Endpoint> endpoints_;
  std::chrono::milliseconds timeout_;
  std::atomic<size_t> preferred_{0};
};

}  // namespace sg::etcd
