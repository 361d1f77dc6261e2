// Implementation of templates between cluster nodes (cluster_templates.h);
// the transfer itself is template_transfer.h's.
#include "gateway/cluster_templates.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <set>
#include <tuple>

#include <nlohmann/json.hpp>

#include "base/log.h"
#include "base/sys.h"
#include "gateway/cluster_routes.h"
#include "gateway/template_transfer.h"
#include "sandbox-runtime/host/envd_client.h"

namespace sg::gateway {

using nlohmann::json;

namespace {

// A file's portable name: "layers/<name>" or "images/<name>" (the
// directories builds and snapshots keep templates' trees in).
bool portable(std::string_view rel) {
  std::string_view name;
  if (rel.rfind("layers/", 0) == 0) name = rel.substr(7);
  else if (rel.rfind("images/", 0) == 0) name = rel.substr(7);
  else return false;
  if (name.empty() || name.size() > 128 || name == "blobs") return false;
  if (!std::isalnum(static_cast<unsigned char>(name[0]))) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  });
}

// The path's name under data_dir, "" when it is not under it.
std::string relative(const std::string& data_dir, const std::string& path) {
  std::string root = data_dir + "/";
  if (path.size() <= root.size() || path.compare(0, root.size(), root) != 0) return "";
  std::string rel = path.substr(root.size());
  return portable(rel) ? rel : "";
}

std::string str_of(const json& j, const char* k) {
  auto it = j.find(k);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}
int64_t int_of(const json& j, const char* k) {
  auto it = j.find(k);
  return it != j.end() && it->is_number_integer() ? it->get<int64_t>() : 0;
}

// A published record, read back.
struct Record {
  std::string id, name, tenant, team, node;
  bool is_public = false;
  int64_t disk_mb = 0, created_at = 0, revision = 0;
  json tags;  // [{tag, build, cpu, memoryMB, config, rootfs: {file}|{template}, layers: [rel]}]
};

std::optional<Record> parse_record(const etcd::KeyValue& kv) {
  json j = json::parse(kv.value, nullptr, false);
  if (!j.is_object()) return std::nullopt;
  Record r;
  r.id = str_of(j, "id");
  r.name = str_of(j, "name");
  r.tenant = str_of(j, "tenant");
  r.team = str_of(j, "team");
  r.node = str_of(j, "node");
  r.is_public = j.value("public", false);
  r.disk_mb = int_of(j, "diskMB");
  r.created_at = int_of(j, "createdAt");
  r.revision = kv.mod_revision;
  auto tags = j.find("tags");
  if (r.id.empty() || r.id != kv.key || r.name.empty() || r.tenant.empty() || r.node.empty() || tags == j.end() ||
      !tags->is_array() || tags->empty())
    return std::nullopt;
  for (const json& t : *tags) {
    if (!t.is_object() || str_of(t, "tag").empty() || str_of(t, "build").empty() || !t.contains("layers") ||
        !t["layers"].is_array() || !t.contains("rootfs") || !t["rootfs"].is_object())
      return std::nullopt;
    for (const json& l : t["layers"])
      if (!l.is_string() || !portable(l.get<std::string>())) return std::nullopt;
    std::string file = str_of(t["rootfs"], "file");
    if (file.empty() == str_of(t["rootfs"], "template").empty() || (!file.empty() && !portable(file))) return std::nullopt;
  }
  r.tags = *tags;
  return r;
}

// The server's own templates: rootfs path -> name, and name -> rootfs path.
struct ServerTemplates {
  std::map<std::string, std::string> by_path, by_name;
};

ServerTemplates server_templates(storage::Store& store) {
  ServerTemplates s;
  if (Result<std::vector<storage::TemplateRow>> all = store.list_templates(""); all)
    for (const storage::TemplateRow& t : *all)
      if (!t.tenant_id) {
        s.by_path[t.rootfs_path] = t.name;
        s.by_name[t.name] = t.rootfs_path;
      }
  return s;
}

// The record of a template made here; nullopt (why says why) when its
// files are not all portable.
std::optional<json> record_of(const storage::SharedTemplate& t, const std::string& data_dir, const std::string& node,
                              const ServerTemplates& servers, std::string* why) {
  json tags = json::array();
  for (const storage::SharedBuild& b : t.tags) {
    json rootfs;
    if (std::string rel = relative(data_dir, b.rootfs_path); !rel.empty()) rootfs = {{"file", rel}};
    else if (auto it = servers.by_path.find(b.rootfs_path); it != servers.by_path.end()) rootfs = {{"template", it->second}};
    else {
      *why = "its base " + b.rootfs_path + " is neither a template file nor a server template";
      return std::nullopt;
    }
    json layers = json::array();
    json listed = json::parse(b.layers, nullptr, false);
    if (!listed.is_array()) listed = json::array();
    for (const json& l : listed) {
      std::string rel = l.is_string() ? relative(data_dir, l.get<std::string>()) : "";
      if (rel.empty()) {
        *why = "its layer " + (l.is_string() ? l.get<std::string>() : l.dump()) + " is not a template file";
        return std::nullopt;
      }
      layers.push_back(rel);
    }
    tags.push_back({{"tag", b.tag},
                    {"build", b.build_id},
                    {"cpu", b.cpu_count},
                    {"memoryMB", b.memory_mb},
                    {"config", b.config},
                    {"rootfs", rootfs},
                    {"layers", layers}});
  }
  return json{{"id", t.row.id},
              {"name", t.row.name},
              {"tenant", *t.row.tenant_id},
              {"team", t.team},
              {"public", t.row.is_public},
              {"node", node},
              {"diskMB", t.row.disk_size_mb},
              {"createdAt", t.row.created_at},
              {"tags", tags}};
}

}  // namespace

ClusterTemplates::ClusterTemplates(Cluster& cluster, storage::Store& store, ClusterTemplatesConfig cfg)
    : cluster_(cluster), store_(store), cfg_(std::move(cfg)) {}

ClusterTemplates::~ClusterTemplates() { stop(); }

void ClusterTemplates::start() {
  thread_ = std::thread([this] {
    std::unique_lock<std::mutex> g(mu_);
    while (!stop_) {
      wanted_ = false;
      g.unlock();
      sync();
      g.lock();
      cv_.wait_for(g, cfg_.sync_every, [&] { return stop_ || wanted_; });
    }
  });
}

void ClusterTemplates::stop() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void ClusterTemplates::sync_soon() {
  {
    std::lock_guard<std::mutex> g(mu_);
    wanted_ = true;
  }
  cv_.notify_all();
}

void ClusterTemplates::sync() {
  if (!cluster_.member()) return;
  const std::string& self = cluster_.self().id;
  std::map<std::string, etcd::KeyValue> records;
  for (etcd::KeyValue& kv : cluster_.template_records()) records[kv.key] = std::move(kv);

  // This node's templates, published as they are now.
  Result<std::vector<storage::SharedTemplate>> mine = store_.shared_templates();
  if (!mine) {
    LOG_WARN("cluster: templates: " << mine.error().message());
    return;
  }
  ServerTemplates servers = server_templates(store_);
  std::set<std::string> published;
  for (const storage::SharedTemplate& t : *mine) {
    std::string why;
    std::optional<json> rec = record_of(t, cfg_.data_dir, self, servers, &why);
    if (!rec) {
      if (unpublishable_.emplace(t.row.id, why).second)
        LOG_WARN("cluster: template " << t.row.name << " (" << t.row.id << ") stays on this node: " << why);
      continue;
    }
    published.insert(t.row.id);
    std::string value = rec->dump();
    if (auto it = records.find(t.row.id); it != records.end() && it->second.value == value) continue;
    if (Result<int64_t> p = cluster_.etcd().put(cluster_.prefix() + "templates/" + t.row.id, value); !p)
      LOG_WARN("cluster: publish template " << t.row.id << ": " << p.error().message());
  }
  // Records of this node's templates that are gone (deleted).
  for (const auto& [id, kv] : records) {
    std::optional<Record> r = parse_record(kv);
    if (!r || r->node != self || published.count(id)) continue;
    std::string key = cluster_.prefix() + "templates/" + id;
    (void)cluster_.etcd().txn({etcd::Compare{key, "MOD", "EQUAL", kv.mod_revision, {}}}, {etcd::Op::del(key)});
  }

  // Copies whose record is gone: their origin deleted them.
  std::lock_guard<std::mutex> g(copy_mu_);
  Result<std::map<std::string, int64_t>> copies = store_.template_copies();
  if (!copies) return;
  bool dropped = false;
  for (const auto& [id, rev] : *copies) {
    if (records.count(id)) continue;
    if (Status s = store_.drop_template_copy(id, cfg_.clock()); !s) {
      LOG_WARN("cluster: drop template copy " << id << ": " << s.error().message());
      continue;
    }
    LOG_INFO("cluster: template copy " << id << " dropped: its origin no longer has it");
    dropped = true;
  }
  if (dropped && cfg_.collect) cfg_.collect();
}

Status ClusterTemplates::ensure(const std::string& tenant_id, const std::string& ref) {
  Result<storage::TemplateRef> want = storage::parse_template_ref(ref);
  if (!want) return Status::Ok();  // the local resolution answers it
  // The record the ref names: by id first, then the tenant's own, then
  // the newest.
  std::optional<Record> best;
  auto rank = [&](const Record& r) {
    return std::tuple(r.id == want->name, r.tenant == tenant_id, r.revision);
  };
  for (const etcd::KeyValue& kv : cluster_.template_records()) {
    std::optional<Record> r = parse_record(kv);
    if (!r || (r->id != want->name && r->name != want->name)) continue;
    if (!want->team.empty() && r->team != want->team) continue;
    if (r->tenant != tenant_id && !r->is_public) continue;
    if (!best || rank(*r) > rank(*best)) best = std::move(r);
  }
  Result<std::optional<storage::TemplateRow>> local = store_.find_template(tenant_id, want->name);
  if (!local) return local.error();
  std::lock_guard<std::mutex> g(copy_mu_);
  // A copy here that the cluster no longer has (its record deleted
  // before sync saw it): never served.
  if (*local && (*local)->origin_node && (!best || best->id != (*local)->id)) {
    if (Status s = store_.drop_template_copy((*local)->id, cfg_.clock()); !s) return s;
    if (cfg_.collect) cfg_.collect();
  }
  if (!best || best->node == cluster_.self().id) return Status::Ok();
  // A template made here of that name answers first, as on one host.
  if (*local && !(*local)->origin_node) return Status::Ok();

  Result<std::map<std::string, int64_t>> copies = store_.template_copies();
  if (!copies) return copies.error();
  if (auto it = copies->find(best->id); it != copies->end() && it->second == best->revision) return Status::Ok();
  const Record& rec = *best;
  std::optional<NodeInfo> origin;
  for (const NodeInfo& n : cluster_.nodes())
    if (n.id == rec.node) origin = n;
  if (!origin)
    return Error(ErrorKind::kUnavailable, "template '" + rec.name + "' is held by cluster node " + rec.node +
                                              ", which is not in the cluster now; retry once it is back");
  LOG_INFO("cluster: copying template " << rec.name << " (" << rec.id << ") from node " << rec.node);
  ServerTemplates servers = server_templates(store_);
  int64_t now = cfg_.clock();
  storage::SharedTemplate copy;
  copy.team = rec.team;
  storage::TemplateRow& row = copy.row;
  row.id = rec.id;
  row.name = rec.name;
  row.tenant_id = rec.tenant;
  row.status = "ready";
  row.is_public = rec.is_public;
  row.disk_size_mb = rec.disk_mb;
  row.created_at = rec.created_at;
  row.updated_at = now;
  row.origin_node = rec.node;
  row.origin_revision = rec.revision;
  std::set<std::string> done;
  auto have = [&](const std::string& rel) -> Status {
    std::string path = cfg_.data_dir + "/" + rel;
    if (!done.insert(rel).second) return Status::Ok();
    if (!sys::path_exists(path))
      if (Status s = pull(*origin, rel); !s) return s.error().with_context("template '" + rec.name + "'");
    storage::TemplateFileRow f{path, rec.tenant, rel.rfind("images/", 0) == 0 ? storage::kFileImage : storage::kFileLayer,
                               rec.id, static_cast<int64_t>(sys::disk_usage(path)), now, now};
    return store_.add_template_file(f);
  };
  // The row holds its default build's files and shape.
  auto take_build = [&row](const storage::SharedBuild& b) {
    row.rootfs_path = b.rootfs_path;
    row.layers = b.layers;
    row.config = b.config;
    row.build_id = b.build_id;
    row.cpu_count = b.cpu_count;
    row.memory_mb = b.memory_mb;
  };
  for (const json& t : rec.tags) {
    storage::SharedBuild b;
    b.tag = str_of(t, "tag");
    b.build_id = str_of(t, "build");
    b.cpu_count = int_of(t, "cpu");
    b.memory_mb = int_of(t, "memoryMB");
    b.config = str_of(t, "config");
    if (std::string file = str_of(t["rootfs"], "file"); !file.empty()) {
      if (Status s = have(file); !s) return s;
      b.rootfs_path = cfg_.data_dir + "/" + file;
    } else {
      std::string base = str_of(t["rootfs"], "template");
      auto it = servers.by_name.find(base);
      if (it == servers.by_name.end())
        return not_found_error("template '" + rec.name + "' stands on the server template '" + base +
                               "', which node " + cluster_.self().id + " does not have");
      b.rootfs_path = it->second;
    }
    json layers = json::array();
    for (const json& l : t["layers"]) {
      if (Status s = have(l.get<std::string>()); !s) return s;
      layers.push_back(cfg_.data_dir + "/" + l.get<std::string>());
    }
    b.layers = layers.dump();
    if (cfg_.prepare) {
      runtime::SandboxSpec spec;
      spec.id = "template";
      spec.rootfs = b.rootfs_path;
      for (const json& l : layers) spec.layers.push_back(l.get<std::string>());
      spec.cpu_count = static_cast<uint32_t>(b.cpu_count);
      spec.memory_mb = static_cast<uint64_t>(b.memory_mb);
      spec.start = host::start_command_of(b.config, cfg_.ready_timeout);
      if (Status s = cfg_.prepare(spec); !s) return s.error().with_context("prepare the copy of template '" + rec.name + "'");
    }
    if (b.tag == storage::kDefaultTag) take_build(b);
    copy.tags.push_back(std::move(b));
  }
  if (row.rootfs_path.empty() && !copy.tags.empty()) take_build(copy.tags.front());  // no "default": the first tag's
  if (Status s = store_.install_template_copy(copy); !s) return s;
  copies_made_.fetch_add(1);
  return Status::Ok();
}

Status ClusterTemplates::pull(const NodeInfo& origin, const std::string& rel) {
  Result<UniqueFd> fd = cluster_wire::open_tunnel(origin, cluster_.secret(), cluster_wire::kTemplateFilesTarget, rel, "",
                                                  "template file " + rel);
  if (!fd) return fd.error();
  std::string dest = cfg_.data_dir + "/" + rel;
  std::string parent = dest.substr(0, dest.rfind('/'));
  if (Status s = sys::make_dirs(parent, 0700); !s) return s;
  std::string tmp = dest + ".partial-" + sys::random_hex(4);
  if (Status s = sys::make_dirs(tmp, 0755); !s) return s;
  struct Drop {
    std::string dir;
    ~Drop() {
      if (!dir.empty()) {
        (void)sys::remove_tree(dir);
        ::unlink((dir + ".log").c_str());
      }
    }
  } drop{tmp};
  Result<uint64_t> total = transfer::receive_tree(fd->get(), tmp, tmp + ".log", cfg_.transfer_idle);
  if (!total) return Error(ErrorKind::kUnavailable, "copy " + rel + " from node " + origin.id + ": " + total.error().message());
  ::unlink((tmp + ".log").c_str());
  if (::rename(tmp.c_str(), dest.c_str()) != 0) {
    if (errno != EEXIST && errno != ENOTEMPTY) return sys::errno_error("rename", tmp);
    // Made meanwhile (a build of the same recipe here): that one is kept.
  } else {
    drop.dir.clear();
  }
  files_pulled_.fetch_add(1);
  bytes_pulled_.fetch_add(*total);
  return Status::Ok();
}

Result<UniqueFd> ClusterTemplates::serve(const std::string& rel) {
  if (!portable(rel)) return invalid_error("template file '" + rel + "': not a template file's name");
  std::string path = cfg_.data_dir + "/" + rel;
  Result<std::vector<storage::TemplateFileRow>> files = store_.template_files();
  if (!files) return files.error();
  bool known = std::any_of(files->begin(), files->end(), [&](const storage::TemplateFileRow& f) { return f.path == path; });
  struct stat st;
  if (!known || ::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return not_found_error("node " + cluster_.self().id + " has no template file " + rel);
  if (served_->serving.fetch_add(1) >= cfg_.max_serving) {
    served_->serving.fetch_sub(1);
    return Error(ErrorKind::kUnavailable, "node " + cluster_.self().id + " is serving " +
                                              std::to_string(cfg_.max_serving) + " template transfers; retry");
  }
  int sp[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp) != 0) {
    served_->serving.fetch_sub(1);
    return sys::errno_error("socketpair", rel);
  }
  UniqueFd mine(sp[0]), theirs(sp[1]);
  std::string err_path = cfg_.data_dir + "/layers/.serve-" + sys::random_hex(6) + ".log";
  // The peer's end closes when the stream (and its trailer, if tar ended
  // well) is written.
  std::thread([served = served_, out = std::move(theirs), path, err_path, rel]() mutable {
    bool sent = transfer::send_tree(path, out.get(), err_path);
    out.reset();
    if (sent) served->files.fetch_add(1);
    else LOG_WARN("cluster: serving template file " << rel << " stopped: " << sys::read_tail(err_path, 400));
    ::unlink(err_path.c_str());
    served->serving.fetch_sub(1);
  }).detach();
  return mine;
}

std::string ClusterTemplates::metrics() const {
  std::string m;
  m += "# TYPE sandgate_cluster_template_copies_total counter\nsandgate_cluster_template_copies_total " +
       std::to_string(copies_made_.load()) + "\n";
  m += "# TYPE sandgate_cluster_template_files_pulled_total counter\nsandgate_cluster_template_files_pulled_total " +
       std::to_string(files_pulled_.load()) + "\n";
  m += "# TYPE sandgate_cluster_template_bytes_pulled_total counter\nsandgate_cluster_template_bytes_pulled_total " +
       std::to_string(bytes_pulled_.load()) + "\n";
  m += "# TYPE sandgate_cluster_template_files_served_total counter\nsandgate_cluster_template_files_served_total " +
       std::to_string(served_->files.load()) + "\n";
  return m;
}

}  // namespace sg::gateway
