// envd filesystem.Filesystem and /files over real TCP.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <zlib.h>

#include <set>
#include <thread>

#include "sandbox-runtime/agent/envd/files.h"
#include "sandbox-runtime/agent/envd/filesystem.h"
#include "sandbox-runtime/agent/envd/watch.h"
#include "tests/sandbox-runtime/envd_harness.h"

using namespace envd_test;

namespace {

std::string multipart(const std::string& boundary, const std::vector<std::pair<std::string, std::string>>& files) {
  std::string b;
  for (auto& [name, data] : files) {
    b += "--" + boundary + "\r\nContent-Disposition: form-data; name=\"file\"; filename=\"" + name +
         "\"\r\nContent-Type: application/octet-stream\r\n\r\n" + data + "\r\n";
  }
  return b + "--" + boundary + "--\r\n";
}

std::string binary_blob() {
  std::string s;
  for (int i = 0; i < 300000; ++i) s += static_cast<char>((i * 7 + i / 256) & 0xff);
  s += "\r\n--xy";  // a delimiter prefix at the end of a part's data
  return s;
}

std::string gzip(const std::string& in) {
  z_stream zs = {};
  REQUIRE(deflateInit2(&zs, Z_BEST_SPEED, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  std::string out(deflateBound(&zs, in.size()) + 64, '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  zs.avail_in = static_cast<uInt>(in.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  REQUIRE(deflate(&zs, Z_FINISH) == Z_STREAM_END);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

std::string chunked(const std::string& body, size_t piece) {
  std::string o;
  for (size_t i = 0; i < body.size(); i += piece) {
    std::string p = body.substr(i, piece);
    char n[32];
    snprintf(n, sizeof n, "%zx\r\n", p.size());
    o += n + p + "\r\n";
  }
  return o + "0\r\n\r\n";
}

// What URLSearchParams does to a signature: '+', '/' and '=' escaped.
std::string qesc(const std::string& s) {
  std::string o;
  for (char ch : s) {
    if (ch == '+') o += "%2B";
    else if (ch == '/') o += "%2F";
    else if (ch == '=') o += "%3D";
    else o += ch;
  }
  return o;
}

}  // namespace

TEST_CASE("envd path resolution and permissions strings") {
  CHECK(sg::envd::resolve_path("/home/u", "a/../b/./c") == "/home/u/b/c");
  CHECK(sg::envd::resolve_path("/home/u", "/tmp/") == "/tmp");
  CHECK(sg::envd::resolve_path("/home/u", "~/x") == "/home/u/x");
  CHECK(sg::envd::resolve_path("/home/u", "") == "/home/u");
  CHECK(sg::envd::permissions_string(S_IFREG | 0644) == "-rw-r--r--");
  CHECK(sg::envd::permissions_string(S_IFDIR | 0755) == "drwxr-xr-x");
  CHECK(sg::envd::permissions_string(S_IFLNK | 0777) == "Lrwxrwxrwx");
  struct timespec ts = {1704067200, 0};
  CHECK(sg::envd::rfc3339_nanos(ts) == "2024-01-01T00:00:00Z");
  ts.tv_nsec = 120000000;
  CHECK(sg::envd::rfc3339_nanos(ts) == "2024-01-01T00:00:00.120Z");
}

TEST_CASE("envd Stat, MakeDir, ListDir, Move, Remove and their error codes") {
  Env env;
  auto r = env.unary("filesystem.Filesystem/Stat", {{"path", "missing"}});
  CHECK(r.status == 404);
  CHECK(r.j()["code"] == "not_found");

  r = env.unary("filesystem.Filesystem/MakeDir", {{"path", "a/b"}});
  REQUIRE(r.status == 200);
  auto e = r.j()["entry"];
  CHECK(e["name"] == "b");
  CHECK(e["path"] == env.home + "/a/b");
  CHECK(e["type"] == "FILE_TYPE_DIRECTORY");
  CHECK(e["permissions"] == "drwxr-xr-x");
  CHECK(e["owner"] == "root");  // tester shares uid 0; the first passwd entry names it
  r = env.unary("filesystem.Filesystem/MakeDir", {{"path", "a/b"}});
  CHECK(r.status == 409);
  CHECK(r.j()["code"] == "already_exists");

  (void)sg::sys::write_file(env.home + "/a/f.txt", "hello");
  (void)sg::sys::write_file(env.home + "/a/b/g.txt", "");
  symlink((env.home + "/a/f.txt").c_str(), (env.home + "/a/link").c_str());
  r = env.unary("filesystem.Filesystem/MakeDir", {{"path", "a/f.txt"}});
  CHECK(r.j()["code"] == "invalid_argument");

  r = env.unary("filesystem.Filesystem/Stat", {{"path", env.home + "/a/f.txt"}});
  REQUIRE(r.status == 200);
  e = r.j()["entry"];
  CHECK(e["size"] == "5");
  CHECK(e["type"] == "FILE_TYPE_FILE");
  CHECK(e["permissions"].get<std::string>().size() == 10);
  CHECK(e["modifiedTime"].get<std::string>().back() == 'Z');
  r = env.unary("filesystem.Filesystem/Stat", {{"path", "a/link"}});
  CHECK(r.j()["entry"]["type"] == "FILE_TYPE_SYMLINK");
  CHECK(r.j()["entry"]["symlinkTarget"] == env.home + "/a/f.txt");

  r = env.unary("filesystem.Filesystem/ListDir", {{"path", "a"}, {"depth", 1}});
  REQUIRE(r.status == 200);
  std::vector<std::string> names;
  json listing = r.j();
  for (auto& x : listing["entries"]) names.push_back(x["path"].get<std::string>());
  CHECK(names == std::vector<std::string>{env.home + "/a/b", env.home + "/a/f.txt", env.home + "/a/link"});
  r = env.unary("filesystem.Filesystem/ListDir", {{"path", "a"}, {"depth", "2"}});
  names.clear();
  listing = r.j();
  for (auto& x : listing["entries"]) names.push_back(x["path"].get<std::string>());
  CHECK(names == std::vector<std::string>{env.home + "/a/b", env.home + "/a/b/g.txt", env.home + "/a/f.txt",
                                          env.home + "/a/link"});
  r = env.unary("filesystem.Filesystem/ListDir", {{"path", "nope"}});
  CHECK(r.j()["code"] == "not_found");
  r = env.unary("filesystem.Filesystem/ListDir", {{"path", "a/f.txt"}});
  CHECK(r.j()["code"] == "invalid_argument");

  r = env.unary("filesystem.Filesystem/Move", {{"source", "a/f.txt"}, {"destination", "c/moved.txt"}});
  REQUIRE(r.status == 200);
  CHECK(r.j()["entry"]["path"] == env.home + "/c/moved.txt");
  r = env.unary("filesystem.Filesystem/Move", {{"source", "a/f.txt"}, {"destination", "x"}});
  CHECK(r.j()["code"] == "not_found");

  r = env.unary("filesystem.Filesystem/Remove", {{"path", "a"}});
  CHECK(r.status == 200);
  CHECK_FALSE(sg::sys::path_exists(env.home + "/a"));
  r = env.unary("filesystem.Filesystem/Remove", {{"path", "a"}});
  CHECK(r.j()["code"] == "not_found");
}

TEST_CASE("envd MakeDir as uid 1000 chowns what it creates") {
  Env env;
  auto r = env.unary("filesystem.Filesystem/MakeDir", {{"path", "x/y"}}, {{"Authorization", "Basic " + b64("user:")}});
  REQUIRE(r.status == 200);
  CHECK(r.j()["entry"]["owner"] == "user");
  struct stat st;
  REQUIRE(stat((env.user_home + "/x").c_str(), &st) == 0);
  CHECK(st.st_uid == 1000);
}

TEST_CASE("envd WatchDir streams a file creation; watchers poll") {
  Env env;
  (void)sg::sys::make_dirs(env.home + "/w/sub");
  auto c = env.stream("filesystem.Filesystem/WatchDir", {{"path", "w"}, {"recursive", true}});
  auto s = c->next_envelope();
  CHECK(s.msg == json{{"start", json::object()}});
  (void)sg::sys::write_file(env.home + "/w/sub/new.txt", "x");
  auto e = c->next_envelope();
  REQUIRE(e.msg.contains("filesystem"));
  CHECK(e.msg["filesystem"]["name"] == "sub/new.txt");
  CHECK(e.msg["filesystem"]["type"] == "EVENT_TYPE_CREATE");

  auto nf = env.stream("filesystem.Filesystem/WatchDir", {{"path", "nope"}});
  CHECK(nf->next_envelope().msg["error"]["code"] == "not_found");

  auto r = env.unary("filesystem.Filesystem/CreateWatcher", {{"path", "w"}});
  REQUIRE(r.status == 200);
  std::string id = r.j()["watcherId"];
  (void)sg::sys::write_file(env.home + "/w/polled.txt", "x");
  r = env.unary("filesystem.Filesystem/GetWatcherEvents", {{"watcherId", id}});
  REQUIRE(r.status == 200);
  bool seen = false;
  json evs = r.j();
  for (auto& ev : evs["events"]) seen |= ev["name"] == "polled.txt" && ev["type"] == "EVENT_TYPE_CREATE";
  CHECK(seen);
  r = env.unary("filesystem.Filesystem/RemoveWatcher", {{"watcherId", id}});
  CHECK(r.status == 200);
  r = env.unary("filesystem.Filesystem/GetWatcherEvents", {{"watcherId", id}});
  CHECK(r.j()["code"] == "not_found");
}

TEST_CASE("WatchHub: take() answers with a change made before it, whether or not the dispatcher ran") {
  TempDir dir;
  sg::envd::WatchHub hub(sg::envd::WatchLimits{}, nullptr);
  REQUIRE(hub.start());
  auto w = hub.watch(dir.path, false, false);
  REQUIRE(w);
  // No dispatcher from here on: only take() reads the kernel's queue.
  hub.stop();
  REQUIRE(sg::sys::write_file(dir.path + "/made.txt", "x"));
  std::vector<json> evs;
  REQUIRE((*w)->take(&evs, 100));
  bool seen = false;
  for (auto& ev : evs) seen |= ev["name"] == "made.txt" && ev["type"] == "EVENT_TYPE_CREATE";
  CHECK_MESSAGE(seen, json(evs).dump());
}

TEST_CASE("envd /files: multipart with nested paths, binary round trip, errors") {
  Env env;
  std::string blob = binary_blob();
  Client c(env.port());
  auto r = c.request("POST", "/files", {{"Content-Type", "multipart/form-data; boundary=xyz"}},
                     multipart("xyz", {{"deep/er/bin.dat", blob}, {"/tmp/../" + env.home.substr(1) + "/t.txt", "two"}}));
  REQUIRE(r.status == 200);
  auto j = r.j();
  REQUIRE(j.size() == 2);
  CHECK(j[0] == json{{"path", env.home + "/deep/er/bin.dat"}, {"name", "bin.dat"}, {"type", "file"}});
  CHECK(j[1]["path"] == env.home + "/t.txt");
  auto d = c.request("GET", "/files?path=deep%2Fer%2Fbin.dat");
  CHECK(d.status == 200);
  CHECK(d.body.size() == blob.size());
  CHECK(d.body == blob);
  CHECK(d.headers["content-disposition"] == "inline; filename=\"bin.dat\"");
  // Nothing but the two files was left in the destination directories.
  auto l = env.unary("filesystem.Filesystem/ListDir", {{"path", "deep/er"}});
  CHECK(l.j()["entries"].size() == 1);

  // The path query wins for a single file.
  r = c.request("POST", "/files?path=chosen.txt", {{"Content-Type", "multipart/form-data; boundary=B"}},
                multipart("B", {{"ignored.txt", "q"}}));
  CHECK(r.j()[0]["path"] == env.home + "/chosen.txt");
  // Octet stream, chunked.
  c.send_raw("POST /files?path=o.bin HTTP/1.1\r\nContent-Type: application/octet-stream\r\n"
             "Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n");
  auto h = c.read_head();
  CHECK(h.status == 200);
  for (std::string s; !(s = c.read_body_some()).empty();) {}
  CHECK(sg::sys::read_file(env.home + "/o.bin").value() == "abcde");

  Client c2(env.port());
  d = c2.request("GET", "/files?path=missing");
  CHECK(d.status == 404);
  CHECK(d.j()["code"] == 404);
  d = c2.request("GET", "/files?path=deep");
  CHECK(d.status == 400);
  Client c3(env.port());
  r = c3.request("POST", "/files?path=g.txt", {{"Content-Type", "application/octet-stream"}, {"Content-Encoding", "br"}}, "x");
  CHECK(r.status == 415);
  Client c4(env.port());
  // A truncated multipart upload leaves nothing behind.
  std::string body = "--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"part.txt\"\r\n\r\nhalf";
  r = c4.request("POST", "/files", {{"Content-Type", "multipart/form-data; boundary=B"}}, body);
  CHECK(r.status == 400);
  l = env.unary("filesystem.Filesystem/ListDir", {{"path", ""}});
  json top = l.j();
  REQUIRE(top["entries"].size() > 0);
  for (auto& x : top["entries"]) CHECK(x["name"].get<std::string>().find("part.txt") == std::string::npos);
}

TEST_CASE("envd GET /files: files without a true st_size, and files rewritten while read") {
  Env env;
  Client c(env.port());
  // procfs gives st_size 0: a short file is sent with the length read.
  auto v = c.request("GET", "/files?path=%2Fproc%2Fversion");
  REQUIRE(v.status == 200);
  CHECK(v.body == sg::sys::read_file("/proc/version").value());
  CHECK(v.headers["content-length"] == std::to_string(v.body.size()));
  CHECK(v.body.size() > 0);

  // A long one (smaps of this process, made long by 256 unmergeable
  // mappings) is sent chunked to its end.
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  char* base = static_cast<char*>(mmap(nullptr, 512 * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  REQUIRE(base != MAP_FAILED);
  for (size_t i = 0; i < 512; i += 2) REQUIRE(mprotect(base + i * page, page, PROT_READ) == 0);
  auto m = c.request("GET", "/files?path=%2Fproc%2F" + std::to_string(getpid()) + "%2Fsmaps");
  munmap(base, 512 * page);
  REQUIRE(m.status == 200);
  CHECK(m.headers.count("content-length") == 0);
  CHECK(m.headers["transfer-encoding"] == "chunked");
  CHECK(m.body.size() > (128u << 10));
  char addr[32];
  snprintf(addr, sizeof addr, "%lx-", reinterpret_cast<unsigned long>(base + 510 * page));
  CHECK(m.body.find(addr) != std::string::npos);
  CHECK((!m.body.empty() && m.body.back() == '\n'));

  // A small file rewritten in a loop (truncate, then write: what
  // `echo $i > f` does) is always read whole, with its exact length, on a
  // connection that stays open: never a cut body.
  std::string path = env.home + "/counter";
  (void)sg::sys::write_file(path, "0\n");
  {
    Client hc(env.port());  // HEAD: the size, and no body
    hc.send_raw("HEAD /files?path=counter HTTP/1.1\r\nHost: x\r\n\r\n");
    auto h = hc.read_head();
    CHECK(h.status == 200);
    CHECK(h.headers["content-length"] == "2");
  }
  // jthread: asks the writer to stop and joins it however the loop ends.
  std::jthread writer([&](std::stop_token stop) {
    for (int i = 1; !stop.stop_requested(); ++i) {
      sg::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC));
      std::string line = std::to_string(i) + "\n";
      if (fd) (void)!::write(fd.get(), line.data(), line.size());
    }
  });
  int whole = 0;
  for (int i = 0; i < 300; ++i) {
    auto r = c.request("GET", "/files?path=counter");
    REQUIRE(r.status == 200);
    REQUIRE(r.headers["content-length"] == std::to_string(r.body.size()));
    if (!r.body.empty()) {
      CHECK(r.body.back() == '\n');
      ++whole;
    }
  }
  writer.request_stop();
  writer.join();
  CHECK(whole > 0);
}

TEST_CASE("envd /files: Content-Encoding gzip uploads (octet-stream and multipart) and corrupt gzip") {
  Env env;
  // Large and compressible (several MiB out of a small body) plus binary.
  std::string big;
  for (int i = 0; i < 200000; ++i) big += "line " + std::to_string(i % 1000) + "\n";
  big += binary_blob();
  Client c(env.port());
  std::string gz = gzip(big);
  REQUIRE(gz.size() < big.size() / 4);
  auto r = c.request("POST", "/files?path=gz%2Fbig.txt",
                     {{"Content-Type", "application/octet-stream"}, {"Content-Encoding", "gzip"}}, gz);
  REQUIRE(r.status == 200);
  CHECK(r.j()[0]["path"] == env.home + "/gz/big.txt");
  auto d = c.request("GET", "/files?path=gz/big.txt");
  CHECK(d.body.size() == big.size());
  CHECK(d.body == big);
  // Chunked in small pieces, two concatenated gzip members, empty content.
  c.send_raw("POST /files?path=gz/two.txt HTTP/1.1\r\nContent-Type: application/octet-stream\r\n"
             "Content-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n" +
             chunked(gzip("first,") + gzip("second"), 7));
  CHECK(c.read_head().status == 200);
  for (std::string s; !(s = c.read_body_some()).empty();) {}
  CHECK(sg::sys::read_file(env.home + "/gz/two.txt").value() == "first,second");
  r = c.request("POST", "/files?path=gz/empty.txt",
                {{"Content-Type", "application/octet-stream"}, {"Content-Encoding", "GZIP"}}, gzip(""));
  CHECK(r.status == 200);
  CHECK(sg::sys::read_file(env.home + "/gz/empty.txt").value() == "");

  // Multipart: the gzip covers the whole body, boundaries included.
  std::string mp = multipart("zz", {{"gz/m1.bin", binary_blob()}, {"gz/m2.txt", "two"}});
  c.send_raw("POST /files HTTP/1.1\r\nContent-Type: multipart/form-data; boundary=zz\r\n"
             "Content-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(gzip(mp), 1000));
  auto h = c.read_head();
  CHECK(h.status == 200);
  std::string body;
  for (std::string s; !(s = c.read_body_some()).empty();) body += s;
  auto j = json::parse(body);
  REQUIRE(j.size() == 2);
  CHECK(j[1]["path"] == env.home + "/gz/m2.txt");
  CHECK(sg::sys::read_file(env.home + "/gz/m1.bin").value() == binary_blob());
  CHECK(sg::sys::read_file(env.home + "/gz/m2.txt").value() == "two");

  // Corrupt data (not gzip; flipped bytes mid-stream; truncated; trailing
  // garbage): a JSON 400 and nothing left behind.
  std::string flipped = gzip(big);
  for (size_t i = flipped.size() / 2; i < flipped.size() / 2 + 64; ++i) flipped[i] = static_cast<char>(~flipped[i]);
  std::string truncated = gzip(big).substr(0, gz.size() - 100);
  for (const std::string& bad : {std::string("x"), flipped, truncated, gzip("ok") + "junk", std::string()}) {
    Client cb(env.port());
    r = cb.request("POST", "/files?path=gz/bad.txt",
                   {{"Content-Type", "application/octet-stream"}, {"Content-Encoding", "gzip"}}, bad);
    CHECK(r.status == 400);
    CHECK(r.j()["code"] == 400);
    CHECK(r.j()["message"].get<std::string>().find("gzip") != std::string::npos);
    Client cm(env.port());
    r = cm.request("POST", "/files", {{"Content-Type", "multipart/form-data; boundary=zz"}, {"Content-Encoding", "gzip"}},
                   bad.empty() ? bad : bad.substr(0, bad.size() - 1));
    CHECK(r.status == 400);
  }
  auto l = env.unary("filesystem.Filesystem/ListDir", {{"path", "gz"}});
  json listing = l.j();
  std::set<std::string> names;
  for (auto& x : listing["entries"]) names.insert(x["name"].get<std::string>());
  CHECK(names == std::set<std::string>{"big.txt", "empty.txt", "m1.bin", "m2.txt", "two.txt"});
}

TEST_CASE("envd /files as uid 1000: parents and file chowned") {
  Env env;
  Client c(env.port());
  auto r = c.request("POST", "/files?username=user", {{"Content-Type", "multipart/form-data; boundary=B"}},
                     multipart("B", {{"n/e/s/t.txt", "hi"}}));
  REQUIRE(r.status == 200);
  struct stat st;
  REQUIRE(stat((env.user_home + "/n/e/s/t.txt").c_str(), &st) == 0);
  CHECK(st.st_uid == 1000);
  REQUIRE(stat((env.user_home + "/n").c_str(), &st) == 0);
  CHECK(st.st_uid == 1000);
  r = c.request("GET", "/files?path=n/e/s/t.txt&username=nobody");
  CHECK(r.status == 401);
}

TEST_CASE("envd /files signatures: token, valid, expired, missing") {
  Env env("tok");
  (void)sg::sys::write_file(env.home + "/s.txt", "signed");
  Client c(env.port());
  auto r = c.request("GET", "/files?path=s.txt");
  CHECK(r.status == 401);
  CHECK(r.j()["message"] == "missing signature");
  Client c1(env.port());
  r = c1.request("GET", "/files?path=s.txt", {{"X-Access-Token", "tok"}});
  CHECK(r.status == 200);
  CHECK(r.body == "signed");
  std::string sig = sg::envd::file_signature("s.txt", "read", "", "tok", std::nullopt);
  r = c1.request("GET", "/files?path=s.txt&signature=" + qesc(sig));
  CHECK(r.status == 200);
  int64_t future = sg::sys::unix_seconds() + 600, past = sg::sys::unix_seconds() - 10;
  sig = sg::envd::file_signature("s.txt", "read", "", "tok", future);
  r = c1.request("GET", "/files?path=s.txt&signature=" + qesc(sig) + "&signature_expiration=" + std::to_string(future));
  CHECK(r.status == 200);
  sig = sg::envd::file_signature("s.txt", "read", "", "tok", past);
  Client c2(env.port());
  r = c2.request("GET", "/files?path=s.txt&signature=" + qesc(sig) + "&signature_expiration=" + std::to_string(past));
  CHECK(r.status == 401);
  CHECK(r.j()["message"] == "signature is expired");
  Client c3(env.port());
  sig = sg::envd::file_signature("s.txt", "write", "", "tok", std::nullopt);  // wrong operation
  r = c3.request("GET", "/files?path=s.txt&signature=" + qesc(sig));
  CHECK(r.status == 401);
  Client c4(env.port());
  r = c4.request("GET", "/files?path=s.txt", {{"X-Access-Token", "bad"}});
  CHECK(r.status == 401);
  // The signature format: v1_ + unpadded base64 of sha256.
  std::string s = sg::envd::file_signature("/a", "read", "user", "t", std::nullopt);
  CHECK(s.rfind("v1_", 0) == 0);
  CHECK(s.size() == 3 + 43);
}

TEST_CASE("envd /files writes in place like E2B's envd: same inode, no temp file; a symlink is replaced, not followed") {
  Env env;
  Client c(env.port());
  auto r = c.request("POST", "/files?path=inplace.txt", {{"Content-Type", "application/octet-stream"}}, "first");
  REQUIRE(r.status == 200);
  struct stat a {};
  REQUIRE(::stat((env.home + "/inplace.txt").c_str(), &a) == 0);
  // A watcher of the directory sees only the named file.
  auto w = env.unary("filesystem.Filesystem/CreateWatcher", {{"path", ""}});
  REQUIRE(w.status == 200);
  std::string wid = w.j()["watcherId"];
  Client c2(env.port());
  r = c2.request("POST", "/files?path=inplace.txt", {{"Content-Type", "application/octet-stream"}}, "second, longer");
  REQUIRE(r.status == 200);
  struct stat b {};
  REQUIRE(::stat((env.home + "/inplace.txt").c_str(), &b) == 0);
  CHECK(a.st_ino == b.st_ino);
  CHECK(sg::sys::read_file(env.home + "/inplace.txt").value() == "second, longer");
  auto ev = env.unary("filesystem.Filesystem/GetWatcherEvents", {{"watcherId", wid}});
  REQUIRE(ev.status == 200);
  json events = ev.j().value("events", json::array());
  bool wrote = false;
  for (auto& e : events) {
    CHECK(e["name"] == "inplace.txt");
    if (e["type"] == "EVENT_TYPE_WRITE") wrote = true;
  }
  CHECK(wrote);
  // A symlink at the path: the upload replaces the link; its target is untouched.
  REQUIRE(sg::sys::write_file(env.home + "/target.txt", "keep").ok());
  REQUIRE(::symlink((env.home + "/target.txt").c_str(), (env.home + "/link.txt").c_str()) == 0);
  Client c3(env.port());
  r = c3.request("POST", "/files?path=link.txt", {{"Content-Type", "application/octet-stream"}}, "new");
  REQUIRE(r.status == 200);
  CHECK(sg::sys::read_file(env.home + "/target.txt").value() == "keep");
  struct stat l {};
  REQUIRE(::lstat((env.home + "/link.txt").c_str(), &l) == 0);
  CHECK(S_ISREG(l.st_mode));
  CHECK(sg::sys::read_file(env.home + "/link.txt").value() == "new");
}

TEST_CASE("envd reconfigure: a clone's token and environment replace the template's, for files, RPCs and /envs") {
  Env env("template-token");
  (void)sg::sys::write_file(env.home + "/r.txt", "mine");
  env.server->reconfigure("clone-token", {"SANDBOX_VAR=clone", "PATH=/usr/bin:/bin"});
  Client c(env.port());
  auto r = c.request("GET", "/files?path=r.txt", {{"X-Access-Token", "template-token"}});
  CHECK(r.status == 401);
  Client c1(env.port());
  r = c1.request("GET", "/files?path=r.txt", {{"X-Access-Token", "clone-token"}});
  CHECK(r.status == 200);
  CHECK(r.body == "mine");
  // A signature made with the old token no longer opens the file.
  std::string old_sig = sg::envd::file_signature("r.txt", "read", "", "template-token", std::nullopt);
  Client c2(env.port());
  r = c2.request("GET", "/files?path=r.txt&signature=" + qesc(old_sig));
  CHECK(r.status == 401);
  Client c3(env.port());
  r = c3.request("GET", "/envs", {{"X-Access-Token", "clone-token"}});
  REQUIRE(r.status == 200);
  CHECK(r.j()["SANDBOX_VAR"] == "clone");
  r = env.unary("filesystem.Filesystem/Stat", {{"path", "r.txt"}}, {{"X-Access-Token", "template-token"}});
  CHECK(r.status == 401);
  r = env.unary("filesystem.Filesystem/Stat", {{"path", "r.txt"}}, {{"X-Access-Token", "clone-token"}});
  CHECK(r.status == 200);
}
