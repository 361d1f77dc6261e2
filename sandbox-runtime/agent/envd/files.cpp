// GET/POST /files: authentication, streaming download, streaming upload.
#include "sandbox-runtime/agent/envd/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>

#include <zlib.h>

#include "sandbox-runtime/agent/envd/filesystem.h"
#include "sandbox-runtime/agent/envd/rpc.h"
#include "sandbox-runtime/agent/envd/sha256.h"
#include "base/sys.h"

namespace sg::envd {
namespace {

constexpr size_t kIoChunk = 64 << 10;
constexpr size_t kMaxPartHeader = 16 << 10;

struct HttpFail {
  int status = 500;
  std::string message;
};

// One file being written, in place as E2B's envd writes it (open with
// O_CREAT, truncate, write), so a watcher of the directory sees CREATE and
// WRITE on the file the caller named and nothing else. The last path
// component is never followed: a symlink there (or a FIFO, a device) is
// replaced instead, through a temp file renamed over it, so an upload as
// `user` cannot write through a link into a file it could not open. A
// failed upload removes a file it created; an existing file keeps what was
// written of it (as with envd).
class Upload {
 public:
  ~Upload() {
    if (!fd_) return;
    fd_.reset();
    if (!tmp_.empty())
      ::unlink(tmp_.c_str());
    else if (created_)
      ::unlink(path_.c_str());
  }
  std::optional<HttpFail> begin(const std::string& path, const User& owner) {
    path_ = path;
    owner_ = owner;
    struct stat st;
    if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
      return HttpFail{400, "path is a directory: " + path};
    std::string dir = std::filesystem::path(path).parent_path().string();
    auto s = make_parents(dir, owner);
    if (!s) return HttpFail{s.error().code == Code::kInvalidArgument ? 400 : 500, s.error().message};
    fd_ = UniqueFd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644));
    if (fd_) {
      created_ = true;
      return std::nullopt;
    }
    if (errno != EEXIST) return fail("create", path);
    // It exists: a regular file is truncated and written in place.
    fd_ = UniqueFd(::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
    if (fd_) {
      if (::fstat(fd_.get(), &st) == 0 && S_ISREG(st.st_mode)) {
        if (::ftruncate(fd_.get(), 0) < 0) return fail("truncate", path);
        int fl = ::fcntl(fd_.get(), F_GETFL);
        if (fl >= 0) ::fcntl(fd_.get(), F_SETFL, fl & ~O_NONBLOCK);
        return std::nullopt;
      }
      fd_.reset();
    } else if (errno != ELOOP && errno != ENXIO && errno != EISDIR) {
      return fail("open", path);
    }
    // A symlink, FIFO, socket or device at the path: replaced, not followed.
    tmp_ = dir + "/." + std::filesystem::path(path).filename().string() + ".upload-" + sys::random_hex(6);
    fd_ = UniqueFd(::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (!fd_) return fail("create", tmp_);
    return std::nullopt;
  }
  std::optional<HttpFail> write(std::string_view data) {
    while (!data.empty()) {
      ssize_t n = ::write(fd_.get(), data.data(), data.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return fail("write", path_);
      data.remove_prefix(static_cast<size_t>(n));
    }
    return std::nullopt;
  }
  std::optional<HttpFail> commit(const std::vector<std::pair<std::string, std::string>>& metadata) {
    if (::fchown(fd_.get(), owner_.uid, owner_.gid) < 0) return fail("chown", path_);
    // The file's metadata is this upload's: earlier user.e2b.* attributes go.
    char names[64 * 1024];
    ssize_t len = ::flistxattr(fd_.get(), names, sizeof names);
    for (ssize_t i = 0; len > 0 && i < len;) {
      std::string name(names + i);
      i += static_cast<ssize_t>(name.size()) + 1;
      if (name.rfind("user.e2b.", 0) == 0) (void)::fremovexattr(fd_.get(), name.c_str());
    }
    for (auto& [k, v] : metadata)
      if (::fsetxattr(fd_.get(), ("user.e2b." + k).c_str(), v.data(), v.size(), 0) < 0)
        return fail("set metadata on", path_);
    if (!tmp_.empty() && ::rename(tmp_.c_str(), path_.c_str()) < 0) return fail("rename into", path_);
    fd_.reset();
    return std::nullopt;
  }

 private:
  HttpFail fail(const char* op, const std::string& p) {
    int e = errno;
    int status = (e == ENOSPC || e == EDQUOT) ? 507 : (e == EISDIR || e == ENOTDIR) ? 400 : 500;
    return HttpFail{status, std::string(op) + " " + p + ": " + std::strerror(e)};
  }
  std::string path_;
  std::string tmp_;       // set when replacing a non-regular file through a temp file
  bool created_ = false;  // the upload created path_ (removed again if it fails)
  User owner_;
  UniqueFd fd_;
};

// The request body as the upload parsers see it: the raw body, or with
// Content-Encoding: gzip the body inflated as it streams (gzip framing,
// concatenated members accepted as Go's gzip reader does). At most one
// input buffer and the caller's output buffer are held; nothing is
// buffered whole. Returns bytes, 0 at the end, -1 with *f set.
class BodyReader {
 public:
  BodyReader(Conn& c, bool gzip) : c_(c), gzip_(gzip) {}
  ~BodyReader() {
    if (z_init_) ::inflateEnd(&zs_);
  }
  BodyReader(const BodyReader&) = delete;
  BodyReader& operator=(const BodyReader&) = delete;

  long read(char* buf, size_t n, HttpFail* f) {
    if (!gzip_) {
      HttpError err;
      long k = c_.read_body(buf, n, &err);
      if (k < 0) *f = HttpFail{err.status ? err.status : 400, "upload body: " + err.message};
      return k;
    }
    if (done_ || n == 0) return 0;
    if (!z_init_) {
      zs_ = {};
      if (::inflateInit2(&zs_, 16 + MAX_WBITS) != Z_OK) {
        *f = HttpFail{500, "gzip: cannot initialise zlib"};
        return -1;
      }
      z_init_ = true;
      in_.resize(kIoChunk);
    }
    zs_.next_out = reinterpret_cast<Bytef*>(buf);
    zs_.avail_out = static_cast<uInt>(std::min<size_t>(n, 1u << 30));
    const size_t want = zs_.avail_out;
    for (;;) {
      if (zs_.avail_in == 0 && !eof_) {
        HttpError err;
        long k = c_.read_body(in_.data(), in_.size(), &err);
        if (k < 0) {
          *f = HttpFail{err.status ? err.status : 400, "upload body: " + err.message};
          return -1;
        }
        if (k == 0) {
          eof_ = true;
        } else {
          zs_.next_in = reinterpret_cast<Bytef*>(in_.data());
          zs_.avail_in = static_cast<uInt>(k);
        }
      }
      if (zs_.avail_in == 0 && eof_) {
        if (member_done_) {
          done_ = true;
          return static_cast<long>(want - zs_.avail_out);
        }
        *f = HttpFail{400, "invalid gzip body: unexpected end of the compressed data"};
        return -1;
      }
      if (member_done_) {  // more bytes after a complete member: the next member
        ::inflateReset(&zs_);
        member_done_ = false;
      }
      int r = ::inflate(&zs_, Z_NO_FLUSH);
      size_t produced = want - zs_.avail_out;
      if (r == Z_STREAM_END) {
        member_done_ = true;
        if (produced > 0) return static_cast<long>(produced);
        continue;
      }
      if (r == Z_OK || r == Z_BUF_ERROR) {
        if (produced > 0) return static_cast<long>(produced);
        continue;  // needs more input
      }
      if (r == Z_MEM_ERROR) {
        *f = HttpFail{500, "gzip: out of memory"};
        return -1;
      }
      *f = HttpFail{400, std::string("invalid gzip body: ") + (zs_.msg ? zs_.msg : "corrupt data")};
      return -1;
    }
  }

 private:
  Conn& c_;
  bool gzip_;
  z_stream zs_{};
  bool z_init_ = false, eof_ = false, member_done_ = false, done_ = false;
  std::string in_;
};

std::string header_param(const std::string& header, const std::string& key) {
  // key="value" or key=value inside a header like Content-Disposition.
  size_t pos = 0;
  std::string lh = lowercase(header);
  while ((pos = lh.find(key + "=", pos)) != std::string::npos) {
    if (pos > 0 && lh[pos - 1] != ';' && lh[pos - 1] != ' ' && lh[pos - 1] != '\t') {
      pos += key.size();
      continue;
    }
    size_t v = pos + key.size() + 1;
    if (v < header.size() && header[v] == '"') {
      std::string out;
      for (size_t i = v + 1; i < header.size(); ++i) {
        if (header[i] == '\\' && i + 1 < header.size()) out += header[++i];
        else if (header[i] == '"') return out;
        else out += header[i];
      }
      return out;
    }
    size_t end = header.find(';', v);
    std::string out = header.substr(v, end == std::string::npos ? std::string::npos : end - v);
    while (!out.empty() && (out.back() == ' ' || out.back() == '\r')) out.pop_back();
    return out;
  }
  return {};
}

json written_json(const std::string& path, const std::vector<std::pair<std::string, std::string>>& md) {
  json j{{"path", path}, {"name", std::filesystem::path(path).filename().string()}, {"type", "file"}};
  if (!md.empty()) {
    json m = json::object();
    for (auto& [k, v] : md) m[k] = v;
    j["metadata"] = m;
  }
  return j;
}

// read(2), again after a signal: > 0 bytes, 0 at the end, < 0 an error.
ssize_t read_retrying(int fd, char* p, size_t n) {
  for (;;) {
    ssize_t got = ::read(fd, p, n);
    if (got >= 0 || errno != EINTR) return got;
  }
}

void download(Conn& c, const Request& r, const User& user) {
  auto q = r.query.find("path");
  if (q == r.query.end() || q->second.empty()) return send_http_error(c, 400, "missing path query parameter");
  std::string path = resolve_path(user.home, q->second);
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) {
    int e = errno;
    if (e == ENOENT) return send_http_error(c, 404, "file not found: " + path);
    if (e == ENOTDIR) return send_http_error(c, 400, "bad path: " + path);
    return send_http_error(c, 500, "open " + path + ": " + std::strerror(e));
  }
  struct stat st;
  if (::fstat(fd.get(), &st) < 0) return send_http_error(c, 500, "stat " + path + ": " + std::strerror(errno));
  if (S_ISDIR(st.st_mode)) return send_http_error(c, 400, "path is a directory: " + path);
  std::string name = std::filesystem::path(path).filename().string();
  std::string quoted;
  for (char ch : name) {
    if (ch == '"' || ch == '\\') quoted += '\\';
    quoted += (ch == '\r' || ch == '\n') ? '_' : ch;
  }
  std::vector<std::pair<std::string, std::string>> h = {
      {"Content-Type", "application/octet-stream"},
      {"Content-Disposition", "inline; filename=\"" + quoted + "\""}};
  if (r.method == "HEAD") {
    c.begin_sized(200, h, static_cast<uint64_t>(st.st_size));
    return;
  }
  // The first chunk is read before the head. A file that ends inside it
  // (most files) is sent with the length read: one state of the file, even
  // while a writer truncates and rewrites it. A longer file with no size
  // (procfs, sysfs) is sent chunked to its end. Any other longer file is
  // sent with its fstat size; one that shrinks while it is sent closes the
  // connection, one that grows is cut at that size: never misframed.
  std::string buf(kIoChunk, '\0');
  size_t got = 0;
  bool eof = false;
  while (got < buf.size()) {
    ssize_t n = read_retrying(fd.get(), buf.data() + got, buf.size() - got);
    if (n < 0) return send_http_error(c, 500, "read " + path + ": " + std::strerror(errno));
    if (n == 0) {
      eof = true;
      break;
    }
    got += static_cast<size_t>(n);
  }
  if (eof) {
    c.send_response(200, h, std::string_view(buf.data(), got));
    return;
  }
  if (st.st_size == 0) {
    if (!c.begin_chunked(200, h) || !c.write_chunk(std::string_view(buf.data(), got))) return;
    for (;;) {
      ssize_t n = read_retrying(fd.get(), buf.data(), buf.size());
      if (n < 0) {
        c.set_close();  // no terminating chunk: the client sees the body cut
        return;
      }
      if (n == 0) break;
      if (!c.write_chunk(std::string_view(buf.data(), static_cast<size_t>(n)))) return;
    }
    c.end_chunked();
    return;
  }
  if (!c.begin_sized(200, h, static_cast<uint64_t>(st.st_size))) return;
  uint64_t left = static_cast<uint64_t>(st.st_size);
  size_t first = static_cast<size_t>(std::min<uint64_t>(left, got));
  if (!c.write_all(std::string_view(buf.data(), first))) return;
  left -= first;
  while (left > 0) {
    ssize_t n = read_retrying(fd.get(), buf.data(), std::min<uint64_t>(left, buf.size()));
    if (n <= 0) {
      c.set_close();
      return;
    }
    if (!c.write_all(std::string_view(buf.data(), static_cast<size_t>(n)))) return;
    left -= static_cast<uint64_t>(n);
  }
}

std::optional<HttpFail> parse_metadata(const Request& r, std::vector<std::pair<std::string, std::string>>* md) {
  for (auto& [k, v] : r.headers) {
    if (k.rfind("x-metadata-", 0) != 0) continue;
    std::string key = k.substr(11);
    auto printable = [](const std::string& s) {
      for (unsigned char ch : s)
        if (ch < 0x20 || ch > 0x7e) return false;
      return true;
    };
    if (key.empty() || !printable(key) || !printable(v))
      return HttpFail{400, "metadata keys and values must be printable ASCII"};
    md->emplace_back(key, v);
  }
  return std::nullopt;
}

std::optional<HttpFail> upload_octet(BodyReader& body, const std::string& path, const User& user,
                                     const std::vector<std::pair<std::string, std::string>>& md) {
  Upload up;
  if (auto f = up.begin(path, user)) return f;
  std::string buf(kIoChunk, '\0');
  for (;;) {
    HttpFail f;
    long n = body.read(buf.data(), buf.size(), &f);
    if (n < 0) return f;
    if (n == 0) break;
    if (auto f = up.write(std::string_view(buf.data(), static_cast<size_t>(n)))) return f;
  }
  return up.commit(md);
}

// Streaming multipart/form-data: parts named "file" are written to disk as
// their bytes arrive; only a delimiter's length of data is ever held back.
std::optional<HttpFail> upload_multipart(BodyReader& body, const std::string& boundary, const std::string* query_path,
                                         const User& user, const std::vector<std::pair<std::string, std::string>>& md,
                                         json* written) {
  const std::string delim = "\r\n--" + boundary;
  enum { kPreamble, kAfterDelim, kHeaders, kBody, kEpilogue } state = kPreamble;
  std::string buf = "\r\n";  // so the first boundary also follows a CRLF
  std::string chunk(kIoChunk, '\0');
  std::unique_ptr<Upload> up;
  std::string up_path;
  std::set<std::string> seen;
  bool used_query_path = false, eof = false;
  for (;;) {
    bool progress = true;
    while (progress) {
      progress = false;
      if (state == kPreamble || state == kBody) {
        size_t at = buf.find(delim);
        size_t safe = at != std::string::npos ? at : (buf.size() >= delim.size() ? buf.size() - delim.size() + 1 : 0);
        if (state == kBody && up && safe > 0)
          if (auto f = up->write(std::string_view(buf.data(), safe))) return f;
        if (at != std::string::npos) {
          if (state == kBody && up) {
            if (auto f = up->commit(md)) return f;
            written->push_back(written_json(up_path, md));
            up.reset();
          }
          buf.erase(0, at + delim.size());
          state = kAfterDelim;
          progress = true;
        } else {
          buf.erase(0, safe);
        }
      } else if (state == kAfterDelim) {
        size_t nl = buf.find("\r\n");
        if (buf.size() >= 2 && buf.compare(0, 2, "--") == 0) {
          state = kEpilogue;
          progress = true;
        } else if (nl != std::string::npos) {
          buf.erase(0, nl + 2);  // transport padding, then CRLF
          state = kHeaders;
          progress = true;
        } else if (buf.size() > 256) {
          return HttpFail{400, "malformed multipart boundary line"};
        }
      } else if (state == kHeaders) {
        size_t end = buf.find("\r\n\r\n");
        if (buf.compare(0, 2, "\r\n") == 0) end = 0;  // a part with no headers
        if (end == std::string::npos) {
          if (buf.size() > kMaxPartHeader) return HttpFail{400, "multipart part header larger than 16 KiB"};
          break;
        }
        std::string head = end == 0 ? std::string() : buf.substr(0, end);
        buf.erase(0, end == 0 ? 2 : end + 4);
        std::string disposition, name, filename;
        size_t s = 0;
        while (s < head.size()) {
          size_t e = head.find("\r\n", s);
          if (e == std::string::npos) e = head.size();
          std::string line = head.substr(s, e - s);
          s = e + 2;
          size_t colon = line.find(':');
          if (colon != std::string::npos && lowercase(line.substr(0, colon)) == "content-disposition")
            disposition = line.substr(colon + 1);
        }
        name = header_param(disposition, "name");
        filename = header_param(disposition, "filename");
        state = kBody;
        progress = true;
        if (name != "file") continue;  // other fields are ignored
        std::string target;
        if (query_path && !used_query_path) {
          target = *query_path;
          used_query_path = true;
        } else {
          target = filename;
        }
        if (target.empty()) return HttpFail{400, "multipart file part without a filename and no path query parameter"};
        std::string path = resolve_path(user.home, target);
        if (!seen.insert(path).second) return HttpFail{400, "duplicate path in one upload: " + path};
        up = std::make_unique<Upload>();
        up_path = path;
        if (auto f = up->begin(path, user)) return f;
      } else {  // kEpilogue
        buf.clear();
      }
    }
    if (eof) break;
    HttpFail f;
    long n = body.read(chunk.data(), chunk.size(), &f);
    if (n < 0) return f;
    if (n == 0) eof = true;
    else buf.append(chunk.data(), static_cast<size_t>(n));
  }
  if (state != kEpilogue) return HttpFail{400, "truncated multipart body (no closing boundary)"};
  return std::nullopt;
}

void upload(Conn& c, const Request& r, const User& user) {
  std::vector<std::pair<std::string, std::string>> md;
  if (auto f = parse_metadata(r, &md)) return send_http_error(c, f->status, f->message);
  bool gzip = false;
  if (auto* ce = r.header("content-encoding")) {
    std::string e = lowercase(*ce);
    size_t b = e.find_first_not_of(" \t"), t = e.find_last_not_of(" \t");
    e = b == std::string::npos ? std::string() : e.substr(b, t - b + 1);
    if (e == "gzip" || e == "x-gzip") {
      gzip = true;
    } else if (!e.empty() && e != "identity") {
      c.set_close();
      return send_http_error(c, 415, "Content-Encoding '" + *ce + "' is not supported; use gzip or identity");
    }
  }
  BodyReader body(c, gzip);
  const std::string* ct = r.header("content-type");
  std::string lct = ct ? lowercase(*ct) : "";
  auto q = r.query.find("path");
  const std::string* query_path = (q != r.query.end() && !q->second.empty()) ? &q->second : nullptr;
  if (lct.rfind("multipart/form-data", 0) == 0) {
    std::string boundary = header_param(*ct, "boundary");
    if (boundary.empty() || boundary.size() > 200) {
      c.set_close();
      return send_http_error(c, 400, "multipart/form-data without a valid boundary");
    }
    json written = json::array();
    if (auto f = upload_multipart(body, boundary, query_path, user, md, &written)) {
      c.set_close();
      return send_http_error(c, f->status, f->message);
    }
    if (written.empty()) return send_http_error(c, 400, "no part named 'file' in the upload");
    c.send_response(200, {{"Content-Type", "application/json"}}, written.dump());
    return;
  }
  if (lct.rfind("application/octet-stream", 0) == 0) {
    if (!query_path) {
      c.set_close();
      return send_http_error(c, 400, "octet-stream upload needs the path query parameter");
    }
    std::string path = resolve_path(user.home, *query_path);
    if (auto f = upload_octet(body, path, user, md)) {
      c.set_close();
      return send_http_error(c, f->status, f->message);
    }
    c.send_response(200, {{"Content-Type", "application/json"}}, json::array({written_json(path, md)}).dump());
    return;
  }
  c.set_close();
  send_http_error(c, 400, "unsupported Content-Type '" + (ct ? *ct : std::string()) +
                              "': use multipart/form-data or application/octet-stream");
}

}  // namespace

bool constant_time_equal(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char d = 0;
  for (size_t i = 0; i < a.size(); ++i) d |= static_cast<unsigned char>(a[i] ^ b[i]);
  return d == 0;
}

std::string file_signature(const std::string& path, const std::string& operation, const std::string& username,
                           const std::string& token, std::optional<int64_t> expiration) {
  std::string s = path + ":" + operation + ":" + username + ":" + token;
  if (expiration) s += ":" + std::to_string(*expiration);
  auto h = sha256(s);
  return "v1_" + base64_encode(std::string_view(reinterpret_cast<const char*>(h.data()), h.size()), false);
}

void send_http_error(Conn& c, int status, const std::string& msg) {
  json j{{"code", status}, {"message", msg}};
  c.send_response(status, {{"Content-Type", "application/json"}}, j.dump());
}

void serve_files(Conn& c, const Request& r, const FilesContext& ctx) {
  bool write = r.method == "POST";
  auto qv = [&](const char* k) -> const std::string* {
    auto it = r.query.find(k);
    return it == r.query.end() ? nullptr : &it->second;
  };
  const std::string* username = qv("username");
  if (!ctx.access_token.empty()) {
    const std::string* tok = r.header("x-access-token");
    const std::string* sig = qv("signature");
    if (tok) {
      if (!constant_time_equal(*tok, ctx.access_token)) {
        c.set_close();
        return send_http_error(c, 401, "invalid access token");
      }
    } else if (sig) {
      std::optional<int64_t> exp;
      if (const std::string* e = qv("signature_expiration")) {
        char* end = nullptr;
        long long v = std::strtoll(e->c_str(), &end, 10);
        if (e->empty() || *end) {
          c.set_close();
          return send_http_error(c, 401, "invalid signature expiration");
        }
        exp = v;
      }
      const std::string* p = qv("path");
      std::string want = file_signature(p ? *p : "", write ? "write" : "read", username ? *username : "",
                                        ctx.access_token, exp);
      if (!constant_time_equal(*sig, want)) {
        c.set_close();
        return send_http_error(c, 401, "invalid signature");
      }
      if (exp && *exp < sys::unix_seconds()) {
        c.set_close();
        return send_http_error(c, 401, "signature is expired");
      }
    } else {
      c.set_close();
      return send_http_error(c, 401, "missing signature");
    }
  }
  std::string uname = username && !username->empty() ? *username : ctx.default_user;
  auto user = ctx.users->find(uname);
  if (!user) {
    c.set_close();
    return send_http_error(c, 401, "invalid username: '" + uname + "'");
  }
  if (write) upload(c, r, *user);
  else download(c, r, *user);
}

}  // namespace sg::envd
