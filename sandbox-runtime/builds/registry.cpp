// pull_image: see registry.h.
#include "sandbox-runtime/builds/registry.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <map>
#include <nlohmann/json.hpp>

#include "base/base64.h"
#include "base/fd.h"
#include "base/sys.h"

extern char** environ;

namespace sg::builds {

namespace {

using json = nlohmann::json;

constexpr const char* kManifestTypes[] = {
    "application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json", "application/vnd.docker.distribution.manifest.v2+json"};

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool valid_digest(const std::string& d) {
  if (d.size() != 71 || d.rfind("sha256:", 0) != 0) return false;
  for (size_t i = 7; i < d.size(); ++i)
    if (!((d[i] >= '0' && d[i] <= '9') || (d[i] >= 'a' && d[i] <= 'f'))) return false;
  return true;
}

struct Response {
  int status = 0;
  std::map<std::string, std::string> headers;  // lower-case names, the last hop's
};

// One request through curl; the body into out (bounded by max).
class Http {
 public:
  explicit Http(const RegistryOptions& opt) : opt_(opt) {
    dir_ = "/tmp/sandgate-pull-" + sys::random_hex(6);
  }
  ~Http() { (void)sys::remove_tree(dir_); }

  Result<Response> get(const std::string& url, const std::vector<std::string>& headers, const std::string& out,
                       uint64_t max) {
    if (Status s = sys::make_dirs(dir_, 0700); !s) return s.error();
    std::string hfile = dir_ + "/req-headers", dfile = dir_ + "/resp-headers";
    std::string hs;
    for (const std::string& h : headers) hs += h + "\n";
    {
      UniqueFd f(::open(hfile.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
      if (!f || ::write(f.get(), hs.data(), hs.size()) != static_cast<ssize_t>(hs.size()))
        return sys::errno_error("write", hfile);
    }
    std::vector<std::string> argv = {"curl", "-sS", "--proto", "=http,https", "--proto-redir", "=http,https", "-L",
                                     "--max-redirs", "5", "--max-time", std::to_string(opt_.request_timeout.count()),
                                     "--connect-timeout", "20", "--max-filesize", std::to_string(max), "-D", dfile,
                                     "-o", out, "-H", "@" + hfile, "-w", "%{http_code}", url};
    std::string outtext;
    int code = 0;
    if (Status s = run(argv, &outtext, &code); !s) return s.error();
    if (code == 63) return invalid_error("GET " + url + ": larger than " + std::to_string(max) + " bytes");
    if (code == 28) return Error(ErrorKind::kTimeout, "GET " + url + ": no answer within " + std::to_string(opt_.request_timeout.count()) + " s");
    if (code != 0) return Error(ErrorKind::kUnavailable, "GET " + url + ": " + sys::read_tail(dir_ + "/curl.err", 300));
    Response r;
    r.status = std::atoi(outtext.c_str());
    auto raw = sys::read_file(dfile, 1 << 20);
    if (raw) {
      // The last header block (after redirects).
      std::string text = *raw;
      size_t last = text.rfind("HTTP/");
      std::string block = last == std::string::npos ? text : text.substr(last);
      size_t at = 0;
      while (at < block.size()) {
        size_t eol = block.find('\n', at);
        if (eol == std::string::npos) eol = block.size();
        std::string line = block.substr(at, eol - at);
        if (!line.empty() && line.back() == '\r') line.pop_back();
        size_t colon = line.find(':');
        if (colon != std::string::npos) {
          std::string v = line.substr(colon + 1);
          while (!v.empty() && v[0] == ' ') v.erase(0, 1);
          r.headers[lower(line.substr(0, colon))] = v;
        }
        at = eol + 1;
      }
    }
    return r;
  }

  const std::string& dir() const { return dir_; }

 private:
  Status run(const std::vector<std::string>& argv, std::string* out, int* code) {
    std::string wfile = dir_ + "/curl.out", efile = dir_ + "/curl.err";
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, wfile.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_addopen(&fa, 2, efile.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    pid_t pid;
    int rc = posix_spawnp(&pid, "curl", &fa, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) return sys::errno_error("spawn", "curl (Debian package curl)", rc);
    int st = 0;
    while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
    *code = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
    auto o = sys::read_file(wfile, 4096);
    *out = o ? *o : "";
    return Status::Ok();
  }

  const RegistryOptions& opt_;
  std::string dir_;
};

// "Bearer realm="https://auth/token",service="reg",scope="repository:a:pull""
std::map<std::string, std::string> challenge(const std::string& h, std::string* scheme) {
  std::map<std::string, std::string> out;
  size_t sp = h.find(' ');
  *scheme = lower(h.substr(0, sp));
  if (sp == std::string::npos) return out;
  std::string rest = h.substr(sp + 1);
  size_t at = 0;
  while (at < rest.size()) {
    while (at < rest.size() && (rest[at] == ' ' || rest[at] == ',')) ++at;
    size_t eq = rest.find('=', at);
    if (eq == std::string::npos) break;
    std::string k = lower(rest.substr(at, eq - at));
    std::string v;
    size_t i = eq + 1;
    if (i < rest.size() && rest[i] == '"') {
      ++i;
      while (i < rest.size() && rest[i] != '"') v += rest[i++];
      ++i;
    } else {
      while (i < rest.size() && rest[i] != ',') v += rest[i++];
    }
    out[k] = v;
    at = i;
  }
  return out;
}

std::string url_escape(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      char b[4];
      std::snprintf(b, sizeof b, "%%%02X", c);
      out += b;
    }
  }
  return out;
}

class Puller {
 public:
  Puller(const ImageRef& ref, const std::optional<RegistryCredentials>& creds, const RegistryOptions& opt)
      : ref_(ref), creds_(creds), opt_(opt), http_(opt) {
    bool local = ref.registry.rfind("localhost", 0) == 0 || ref.registry.rfind("127.0.0.1", 0) == 0 ||
                 ref.registry.rfind("[::1]", 0) == 0;
    for (const std::string& r : opt.insecure) local = local || r == ref.registry;
    base_ = std::string(local ? "http://" : "https://") + ref.registry + "/v2/" + ref.repository;
  }

  Result<PulledImage> pull() {
    PulledImage img;
    std::string accept = "Accept: ";
    for (const char* t : kManifestTypes) accept += std::string(t) + ", ";
    accept.resize(accept.size() - 2);
    Result<json> m = manifest(ref_.reference, accept, &img.manifest_digest);
    if (!m) return m.error();
    std::string mt = m->value("mediaType", "");
    if (m->contains("manifests")) {  // an index: the linux/amd64 image
      std::string digest;
      for (const json& e : (*m)["manifests"]) {
        const json& p = e.value("platform", json::object());
        if (p.value("os", "") == "linux" && p.value("architecture", "") == "amd64") {
          digest = e.value("digest", "");
          break;
        }
      }
      if (!valid_digest(digest)) return not_found_error("image " + ref_.text() + " has no linux/amd64 image");
      m = manifest(digest, accept, &img.manifest_digest);
      if (!m) return m.error();
    }
    if (!m->contains("layers") || !(*m)["layers"].is_array() || !m->contains("config"))
      return invalid_error("image " + ref_.text() + ": a manifest without config and layers");
    std::string config_digest = (*m)["config"].value("digest", "");
    Result<std::string> cfg_file = blob(config_digest, (*m)["config"].value("size", uint64_t{0}), 1 << 20);
    if (!cfg_file) return cfg_file.error();
    auto cfg_text = sys::read_file(*cfg_file, 1 << 20);
    if (!cfg_text) return cfg_text.error();
    json cfg = json::parse(*cfg_text, nullptr, false);
    if (cfg.is_object() && cfg.contains("config") && cfg["config"].is_object()) {
      const json& c = cfg["config"];
      if (c.contains("Env") && c["Env"].is_array())
        for (const json& e : c["Env"])
          if (e.is_string()) {
            std::string kv = e.get<std::string>();
            size_t eq = kv.find('=');
            if (eq != std::string::npos && eq > 0) img.config.env.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
          }
      if (c.contains("WorkingDir") && c["WorkingDir"].is_string()) img.config.workdir = c["WorkingDir"];
      if (c.contains("User") && c["User"].is_string()) img.config.user = c["User"];
    }
    for (const json& l : (*m)["layers"]) {
      std::string type = l.value("mediaType", "");
      if (type.find("nondistributable") != std::string::npos || type.find("foreign") != std::string::npos)
        return invalid_error("image " + ref_.text() + ": foreign layers are not supported");
      Result<std::string> f = blob(l.value("digest", ""), l.value("size", uint64_t{0}), opt_.max_blob_bytes);
      if (!f) return f.error();
      img.layer_files.push_back(*f);
    }
    return img;
  }

 private:
  // A GET with the auth dance: on a 401, Basic with the credentials or a
  // Bearer token from the challenge's realm, once.
  Result<Response> get(const std::string& path, const std::vector<std::string>& headers, const std::string& out,
                       uint64_t max) {
    for (int round = 0;; ++round) {
      std::vector<std::string> h = headers;
      if (!auth_.empty()) h.push_back("Authorization: " + auth_);
      Result<Response> r = http_.get(base_ + path, h, out, max);
      if (!r) return r.error();
      if (r->status != 401) return r;
      if (round > 0) {
        return Error(ErrorKind::kUnauthorized, "registry " + ref_.registry + " refused " +
                                                   std::string(creds_ ? "the credentials" : "an anonymous pull") +
                                                   " for " + ref_.repository);
      }
      std::string scheme;
      auto c = challenge(r->headers["www-authenticate"], &scheme);
      if (scheme == "basic") {
        if (!creds_) return Error(ErrorKind::kUnauthorized, "registry " + ref_.registry + " needs credentials (fromImageRegistry)");
        auth_ = "Basic " + base64_encode(creds_->username + ":" + creds_->password);
      } else if (scheme == "bearer" && !c["realm"].empty()) {
        Result<std::string> token = bearer(c);
        if (!token) return token.error();
        auth_ = "Bearer " + *token;
      } else {
        return Error(ErrorKind::kUnauthorized, "registry " + ref_.registry + ": unsupported authentication '" +
                                                   r->headers["www-authenticate"] + "'");
      }
    }
  }

  Result<std::string> bearer(std::map<std::string, std::string>& c) {
    std::string url = c["realm"] + (c["realm"].find('?') == std::string::npos ? "?" : "&") +
                      "service=" + url_escape(c["service"]) + "&scope=" +
                      url_escape(c["scope"].empty() ? "repository:" + ref_.repository + ":pull" : c["scope"]);
    if (url.rfind("https://", 0) != 0 && url.rfind("http://", 0) != 0) return invalid_error("registry token realm '" + c["realm"] + "'");
    std::vector<std::string> h;
    if (creds_) h.push_back("Authorization: Basic " + base64_encode(creds_->username + ":" + creds_->password));
    std::string out = http_.dir() + "/token";
    Result<Response> r = http_.get(url, h, out, 1 << 20);
    if (!r) return r.error();
    if (r->status == 401 || r->status == 403)
      return Error(ErrorKind::kUnauthorized, "registry token service refused " +
                                                 std::string(creds_ ? "the credentials" : "an anonymous pull"));
    if (r->status != 200) return Error(ErrorKind::kUnavailable, "registry token service answered " + std::to_string(r->status));
    auto text = sys::read_file(out, 1 << 20);
    if (!text) return text.error();
    json j = json::parse(*text, nullptr, false);
    std::string t = j.is_object() ? j.value("token", j.value("access_token", "")) : "";
    if (t.empty()) return invalid_error("registry token service: no token in its answer");
    return t;
  }

  Result<json> manifest(const std::string& reference, const std::string& accept, std::string* digest_out) {
    std::string out = http_.dir() + "/manifest";
    Result<Response> r = get("/manifests/" + reference, {accept}, out, opt_.max_manifest_bytes);
    if (!r) return r.error();
    if (r->status == 404) return not_found_error("image " + ref_.text() + " not found (manifest " + reference + ")");
    if (r->status != 200) return Error(ErrorKind::kUnavailable, "registry answered " + std::to_string(r->status) + " for the manifest of " + ref_.text());
    Result<std::string> got = sha256_file(out);
    if (!got) return got.error();
    if (reference.rfind("sha256:", 0) == 0 && *got != reference)
      return invalid_error("image " + ref_.text() + ": manifest digest mismatch (" + *got + ", want " + reference + ")");
    *digest_out = *got;
    auto text = sys::read_file(out, opt_.max_manifest_bytes);
    if (!text) return text.error();
    json j = json::parse(*text, nullptr, false);
    if (!j.is_object()) return invalid_error("image " + ref_.text() + ": the manifest is not JSON");
    return j;
  }

  // A blob by digest into the cache, verified (digest and size).
  Result<std::string> blob(const std::string& digest, uint64_t size, uint64_t max) {
    if (!valid_digest(digest)) return invalid_error("image " + ref_.text() + ": a malformed digest '" + digest + "'");
    if (size > max) return invalid_error("image " + ref_.text() + ": blob " + digest + " is larger than " + std::to_string(max) + " bytes");
    std::string path = opt_.blob_dir + "/" + digest.substr(7);
    struct stat cached {};
    if (::stat(path.c_str(), &cached) == 0) {  // its digest verified when it was stored
      if (static_cast<uint64_t>(cached.st_size) != size)
        return invalid_error("image " + ref_.text() + ": blob " + digest + " is " + std::to_string(cached.st_size) +
                             " bytes, the manifest says " + std::to_string(size) + " (size mismatch)");
      return path;
    }
    if (Status s = sys::make_dirs(opt_.blob_dir, 0700); !s) return s.error();
    std::string tmp = path + ".partial-" + sys::random_hex(4);
    if (opt_.log) opt_.log("pull " + digest.substr(0, 19) + " (" + std::to_string(size) + " bytes)");
    Result<Response> r = get("/blobs/" + digest, {}, tmp, std::max<uint64_t>(size, 1));
    auto drop = [&](Error e) -> Result<std::string> {
      ::unlink(tmp.c_str());
      return e;
    };
    if (!r) return drop(r.error());
    if (r->status == 404) return drop(not_found_error("image " + ref_.text() + ": blob " + digest + " not found"));
    if (r->status != 200) return drop(Error(ErrorKind::kUnavailable, "registry answered " + std::to_string(r->status) + " for blob " + digest));
    Result<std::string> got = sha256_file(tmp);
    if (!got) return drop(got.error());
    struct stat st {};
    ::stat(tmp.c_str(), &st);
    if (*got != digest || static_cast<uint64_t>(st.st_size) != size)
      return drop(invalid_error("image " + ref_.text() + ": blob digest or size mismatch (got " + *got + ", " +
                                std::to_string(st.st_size) + " bytes; want " + digest + ", " + std::to_string(size) + ")"));
    if (::rename(tmp.c_str(), path.c_str()) != 0) return drop(sys::errno_error("rename", tmp));
    return path;
  }

  ImageRef ref_;
  std::optional<RegistryCredentials> creds_;
  const RegistryOptions& opt_;
  Http http_;
  std::string base_;
  std::string auth_;
};

}  // namespace

Result<std::string> sha256_file(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return sys::errno_error("open", path);
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n < 0) {
        EVP_MD_CTX_free(ctx);
        return sys::errno_error("read", path);
      }
      break;
    }
    EVP_DigestUpdate(ctx, buf, static_cast<size_t>(n));
  }
  unsigned char d[EVP_MAX_MD_SIZE];
  unsigned len = 0;
  EVP_DigestFinal_ex(ctx, d, &len);
  EVP_MD_CTX_free(ctx);
  static const char* h = "0123456789abcdef";
  std::string out = "sha256:";
  for (unsigned i = 0; i < len; ++i) {
    out += h[d[i] >> 4];
    out += h[d[i] & 15];
  }
  return out;
}

Result<ImageRef> parse_image_ref(const std::string& s) {
  if (s.empty() || s.size() > 512) return invalid_error("image reference '" + s + "'");
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_' || c == '/' || c == ':' || c == '@'))
      return invalid_error("image reference '" + s + "': unexpected character");
  ImageRef r;
  std::string rest = s;
  size_t slash = rest.find('/');
  std::string first = slash == std::string::npos ? "" : rest.substr(0, slash);
  if (!first.empty() && (first.find('.') != std::string::npos || first.find(':') != std::string::npos || first == "localhost")) {
    r.registry = first;
    rest = rest.substr(slash + 1);
  } else {
    r.registry = "registry-1.docker.io";
  }
  if (size_t at = rest.find('@'); at != std::string::npos) {
    r.reference = rest.substr(at + 1);
    rest.resize(at);
    if (!valid_digest(r.reference)) return invalid_error("image reference '" + s + "': a malformed digest");
  } else if (size_t colon = rest.rfind(':'); colon != std::string::npos && rest.find('/', colon) == std::string::npos) {
    r.reference = rest.substr(colon + 1);
    rest.resize(colon);
  } else {
    r.reference = "latest";
  }
  if (rest.empty() || r.reference.empty()) return invalid_error("image reference '" + s + "'");
  if (r.registry == "registry-1.docker.io" && rest.find('/') == std::string::npos) rest = "library/" + rest;
  for (char c : rest)
    if (std::isupper(static_cast<unsigned char>(c))) return invalid_error("image reference '" + s + "': repository names are lower case");
  r.repository = rest;
  return r;
}

Result<PulledImage> pull_image(const ImageRef& ref, const std::optional<RegistryCredentials>& creds,
                               const RegistryOptions& opt) {
  Puller p(ref, creds, opt);
  return p.pull();
}

}  // namespace sg::builds
