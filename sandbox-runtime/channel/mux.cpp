// Mux implementation (mux.h; the protocol is docs/channel.md, "Data streams").
//
// One thread runs a level-triggered epoll loop over the channel, an eventfd
// for requests from other threads, every stream's local fd and the watched
// fds. A stream fd is registered only for what the loop wants from it now
// (EPOLLIN while the peer's credit is positive and the channel is not backed
// up, EPOLLOUT while peer bytes wait for it) and removed from epoll when it
// wants nothing, so a hung-up fd the loop cannot serve yet never spins it.
//
// Memory bounds, all fixed: per stream the inbound buffer holds at most the
// window we granted (kInitialWindow); the channel's output holds at most
// kChannelOutHighWater plus one frame of DATA, max_control_out of control
// messages and a little of our own answers; past that the peer is not
// reading and the channel is given up. The decoder holds one partial frame.
#include "sandbox-runtime/channel/mux.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "sandbox-runtime/channel/frame.h"
#include "base/log.h"
#include "base/sys.h"

namespace sg::channel {

namespace {

constexpr int kChannelReadsPerRound = 4;  // then the streams get their turn
constexpr size_t kCompactAt = 64 * 1024;
constexpr size_t kMaxResetReason = 1024;
// Slack for the frames the Mux itself answers with (CREDIT, RESET, CLOSE,
// OPEN) on top of data and control output, before the peer counts as not
// reading.
constexpr size_t kOwnFramesSlack = 256 * 1024;
constexpr int kMaxEvents = 64;

// epoll_event.data.u64 tags: stream ids are below 2^32, the rest above.
constexpr uint64_t kTagChannel = 1ull << 32;
constexpr uint64_t kTagWake = kTagChannel + 1;
constexpr uint64_t kTagWatchBase = kTagChannel + 2;

void put_u32(std::string& out, uint32_t v) {
  char b[4] = {static_cast<char>(v & 0xff), static_cast<char>((v >> 8) & 0xff), static_cast<char>((v >> 16) & 0xff),
               static_cast<char>((v >> 24) & 0xff)};
  out.append(b, 4);
}

uint32_t get_u32(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
         (static_cast<uint32_t>(p[3]) << 24);
}

// Same bytes as channel::encode, without building a Frame (no payload copy).
void put_frame(std::string& out, uint32_t stream, FrameType type, std::string_view payload) {
  assert(payload.size() <= kMaxPayload);
  put_u32(out, stream);
  out.push_back(static_cast<char>(type));
  out.push_back(0);
  out.push_back(0);
  out.push_back(0);
  put_u32(out, static_cast<uint32_t>(payload.size()));
  out.append(payload.data(), payload.size());
}

bool is_socket(int fd) {
  int type = 0;
  socklen_t len = sizeof type;
  return ::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0;
}

// send(MSG_NOSIGNAL) on sockets, so a closed peer is EPIPE, not SIGPIPE.
ssize_t write_some(int fd, bool sock, const char* p, size_t n) {
  for (;;) {
    ssize_t r = sock ? ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) : ::write(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    return r;
  }
}

ssize_t read_some(int fd, char* p, size_t n) {
  for (;;) {
    ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    return r;
  }
}

bool set_nonblocking(int fd) {
  int fl = ::fcntl(fd, F_GETFL);
  return fl >= 0 && ::fcntl(fd, F_SETFL, fl | O_NONBLOCK) == 0;
}

}  // namespace

struct Mux::Impl {
  struct Stream {
    uint32_t id = 0;
    UniqueFd fd;
    bool sock = false;
    bool ours = false;      // opened by this side
    bool accepted = false;  // ours: the peer's first CREDIT arrived
    // Local fd -> peer.
    int64_t send_window = kInitialWindow;  // the peer's credit
    bool local_eof = false;                // CLOSE sent
    // Peer -> local fd. Invariant: buffered() + recv_window + unacked == kInitialWindow
    // while the peer's direction is open.
    std::string in;
    size_t in_pos = 0;
    int64_t recv_window = kInitialWindow;  // bytes the peer may still send
    uint32_t unacked = 0;                  // written to the fd, not yet credited
    bool peer_closed = false;
    bool shut_wr = false;
    uint32_t registered = 0;  // epoll events now registered; 0: not in the epoll set
    size_t buffered() const { return in.size() - in_pos; }
  };

  struct PendingOpen {
    uint32_t id;
    UniqueFd fd;
    std::string payload;
  };

  Impl(MuxConfig c, OpenHandler o, ControlHandler ctl)
      : cfg(c), on_open(std::move(o)), on_control(std::move(ctl)), scratch(new char[kMaxPayload]) {
    next_id = cfg.odd_ids ? 1 : 2;
    wake.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    ep.reset(::epoll_create1(EPOLL_CLOEXEC));
  }

  // ---- configuration (fixed before run) ----
  MuxConfig cfg;
  OpenHandler on_open;
  ControlHandler on_control;
  UniqueFd ep, wake;
  std::vector<std::pair<int, std::function<void()>>> watched;

  // ---- Mux-thread state ----
  std::unordered_map<uint32_t, Stream> streams;
  Decoder dec;
  std::string out;  // encoded frames not yet written to the channel
  size_t out_pos = 0;
  // A hold's cut: output stops at this offset of out (a frame boundary);
  // npos: no hold. Frames queued meanwhile wait behind it.
  size_t gate = std::string::npos;
  bool chan_sock = false;
  uint32_t chan_events = 0;
  uint32_t our_high = 0;   // highest id of ours handed to the loop
  uint32_t peer_high = 0;  // highest id the peer opened
  size_t stream_buffered_total = 0;
  bool throttled = false;  // out_pending() >= kChannelOutHighWater, as last applied to the streams
  bool drop_stale = false;  // settling's HOLD is out and HELD not back: see settling
  std::optional<Status> exit;
  std::unique_ptr<char[]> scratch;

  // ---- shared ----
  std::mutex mu;
  std::deque<PendingOpen> opens;  // GUARDED_BY(mu)
  std::string ctl_out;            // GUARDED_BY(mu): encoded control frames
  bool stop_req = false;          // GUARDED_BY(mu)
  std::string fail_req;           // GUARDED_BY(mu)
  bool started = false;           // GUARDED_BY(mu)
  bool finished = false;          // GUARDED_BY(mu)
  uint32_t next_id;               // GUARDED_BY(mu)
  // The host's hold (hold()/release()): requested, HOLD sent, HELD back.
  enum class Hold { kNone, kRequested, kSent, kHeld };
  Hold hold_phase = Hold::kNone;  // GUARDED_BY(mu)
  bool release_req = false;       // GUARDED_BY(mu)
  bool release_reset = false;     // GUARDED_BY(mu)
  // settle(): HELD releases the hold by itself; until then the peer's
  // frames on stream 0 and on our streams are the previous host's.
  bool settling = false;          // GUARDED_BY(mu)
  std::condition_variable hold_cv;

  struct AtomicStats {
    std::atomic<uint64_t> streams_opened{0}, streams_refused{0}, bytes_in{0}, bytes_out{0}, protocol_errors{0},
        streams_reset_in{0}, stale_dropped{0};
    std::atomic<size_t> open_streams{0}, stream_buffered{0}, channel_out{0}, peak_stream_buffered{0},
        peak_channel_out{0};
  } st;

  // ---- helpers ----
  void signal_wake() {
    uint64_t one = 1;
    ssize_t r = ::write(wake.get(), &one, sizeof one);
    (void)r;  // EAGAIN only when the counter is saturated: a wakeup is pending anyway
  }

  bool is_ours(uint32_t id) const { return (id & 1) == (cfg.odd_ids ? 1u : 0u); }
  size_t out_pending() const { return out.size() - out_pos; }
  // Bytes that may go out now: up to the gate.
  size_t out_sendable() const { return (gate == std::string::npos ? out.size() : gate) - out_pos; }
  size_t out_hard_limit() const { return kChannelOutHighWater + kHeaderSize + kMaxPayload + cfg.max_control_out + kOwnFramesSlack; }

  void note_out() {
    size_t p = out_pending();
    st.channel_out.store(p, std::memory_order_relaxed);
    if (p > st.peak_channel_out.load(std::memory_order_relaxed)) st.peak_channel_out.store(p, std::memory_order_relaxed);
  }
  void note_buffered() {
    st.stream_buffered.store(stream_buffered_total, std::memory_order_relaxed);
    if (stream_buffered_total > st.peak_stream_buffered.load(std::memory_order_relaxed))
      st.peak_stream_buffered.store(stream_buffered_total, std::memory_order_relaxed);
  }

  void send_frame(uint32_t id, FrameType t, std::string_view payload) {
    put_frame(out, id, t, payload);
    note_out();
  }
  void send_reset(uint32_t id, std::string_view reason) {
    send_frame(id, FrameType::kReset, reason.substr(0, kMaxResetReason));
  }
  void send_credit(uint32_t id, uint32_t v) {
    std::string p;
    put_u32(p, v);
    send_frame(id, FrameType::kCredit, p);
  }

  // A channel the peer closed or reset (it died) is kUnavailable, as a
  // clean EOF with a frame cut short is: the peer is gone, not wrong.
  static Error peer_gone_or(Error e, int err) {
    if (err == ECONNRESET || err == EPIPE) return Error(ErrorKind::kUnavailable, e.message());
    return e;
  }

  void fatal(Status s) {
    if (!exit) exit = std::move(s);
  }

  bool want_read(const Stream& s) const { return !s.local_eof && s.send_window > 0 && !throttled; }
  bool want_write(const Stream& s) const { return s.buffered() > 0; }
  bool done(const Stream& s) const { return s.local_eof && s.peer_closed && s.shut_wr; }

  void remove(uint32_t id) {
    auto it = streams.find(id);
    if (it == streams.end()) return;
    if (it->second.registered) ::epoll_ctl(ep.get(), EPOLL_CTL_DEL, it->second.fd.get(), nullptr);
    stream_buffered_total -= it->second.buffered();
    note_buffered();
    // Closed after the count is updated: whoever sees the EOF sees the count.
    UniqueFd closing = std::move(it->second.fd);
    streams.erase(it);
    st.open_streams.store(streams.size(), std::memory_order_relaxed);
  }

  // A per-stream protocol violation by the peer: RESET it and count.
  void protocol_error(uint32_t id, std::string_view why) {
    st.protocol_errors.fetch_add(1, std::memory_order_relaxed);
    LOG_DEBUG("mux: stream " << id << ": " << why << "; resetting it");
    send_reset(id, why);
    remove(id);
  }

  void local_failure(Stream& s, const char* op) {
    std::string why = std::string(op) + " local end: " + std::strerror(errno);
    uint32_t id = s.id;
    LOG_DEBUG("mux: stream " << id << ": " << why << "; resetting it");
    send_reset(id, why);
    remove(id);
  }

  // Re-registers s for what it wants now, or removes it when both ways are closed.
  void update(Stream& s) {
    if (done(s)) {
      remove(s.id);
      return;
    }
    uint32_t want = (want_read(s) ? EPOLLIN : 0u) | (want_write(s) ? EPOLLOUT : 0u);
    if (want == s.registered) return;
    struct epoll_event ev {};
    ev.events = want;
    ev.data.u64 = s.id;
    int op = s.registered == 0 ? EPOLL_CTL_ADD : want == 0 ? EPOLL_CTL_DEL : EPOLL_CTL_MOD;
    if (::epoll_ctl(ep.get(), op, s.fd.get(), &ev) != 0) {
      local_failure(s, "poll");
      return;
    }
    s.registered = want;
  }

  // One frame from the local fd. False if the stream is gone.
  bool stream_read(Stream& s) {
    size_t want = std::min<size_t>(kMaxPayload, static_cast<size_t>(s.send_window));
    ssize_t n = read_some(s.fd.get(), scratch.get(), want);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      local_failure(s, "read");
      return false;
    }
    if (n == 0) {
      s.local_eof = true;
      send_frame(s.id, FrameType::kClose, {});
      return true;
    }
    send_frame(s.id, FrameType::kData, std::string_view(scratch.get(), static_cast<size_t>(n)));
    s.send_window -= n;
    st.bytes_out.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
    return true;
  }

  // Writes buffered peer bytes to the local fd and returns credit. False if
  // the stream is gone.
  bool stream_write(Stream& s) {
    while (s.buffered() > 0) {
      ssize_t n = write_some(s.fd.get(), s.sock, s.in.data() + s.in_pos, s.buffered());
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        local_failure(s, "write");
        return false;
      }
      s.in_pos += static_cast<size_t>(n);
      s.unacked += static_cast<uint32_t>(n);
      stream_buffered_total -= static_cast<size_t>(n);
    }
    note_buffered();
    if (s.in_pos == s.in.size()) {
      s.in.clear();
      s.in_pos = 0;
      if (s.in.capacity() > kCompactAt) std::string().swap(s.in);
    } else if (s.in_pos > kCompactAt && s.in_pos > s.in.size() / 2) {
      s.in.erase(0, s.in_pos);
      s.in_pos = 0;
    }
    if (!s.peer_closed && s.unacked > 0 && (s.unacked >= kInitialWindow / 2 || s.buffered() == 0)) {
      send_credit(s.id, s.unacked);
      s.recv_window += s.unacked;
      s.unacked = 0;
    }
    if (s.peer_closed && s.buffered() == 0 && !s.shut_wr) {
      // A non-socket local fd (a pipe) has no half-close; the peer's EOF
      // then reaches it when the stream ends and the fd is closed.
      if (s.sock) ::shutdown(s.fd.get(), SHUT_WR);
      s.shut_wr = true;
    }
    return true;
  }

  Stream& add_stream(uint32_t id, UniqueFd fd, bool ours) {
    Stream& s = streams[id];
    s.id = id;
    s.sock = is_socket(fd.get());
    s.fd = std::move(fd);
    s.ours = ours;
    s.accepted = !ours;
    st.open_streams.store(streams.size(), std::memory_order_relaxed);
    st.streams_opened.fetch_add(1, std::memory_order_relaxed);
    return s;
  }

  // A frame for an id with no live stream: dropped if the id was in use
  // before (frames in flight after a RESET or close), else the peer made
  // it up.
  void unknown_stream(const Frame& f) {
    bool seen = is_ours(f.stream) ? f.stream <= our_high : f.stream <= peer_high;
    if (seen || f.type == FrameType::kReset) return;
    st.protocol_errors.fetch_add(1, std::memory_order_relaxed);
    send_reset(f.stream, "unknown stream");
  }

  void on_peer_open(const Frame& f) {
    uint32_t id = f.stream;
    if (streams.count(id)) {
      protocol_error(id, "OPEN on a stream that is open");
      return;
    }
    if (is_ours(id)) {
      st.protocol_errors.fetch_add(1, std::memory_order_relaxed);
      send_reset(id, "OPEN with a stream id of the wrong parity");
      return;
    }
    peer_high = std::max(peer_high, id);
    if (streams.size() >= cfg.max_streams) {
      st.streams_refused.fetch_add(1, std::memory_order_relaxed);
      send_reset(id, "stream limit reached (" + std::to_string(cfg.max_streams) + " open)");
      return;
    }
    Result<UniqueFd> fd = on_open ? on_open(f.payload) : Result<UniqueFd>(not_found_error("no stream services"));
    if (!fd) {
      st.streams_refused.fetch_add(1, std::memory_order_relaxed);
      send_reset(id, fd.error().message());
      return;
    }
    if (!fd->valid() || !set_nonblocking(fd->get())) {
      st.streams_refused.fetch_add(1, std::memory_order_relaxed);
      send_reset(id, "local end unusable");
      return;
    }
    Stream& s = add_stream(id, std::move(*fd), false);
    send_credit(id, 0);  // the acceptance
    update(s);
  }

  void on_frame(Frame& f) {
    if (f.type == FrameType::kHold || f.type == FrameType::kHeld || f.type == FrameType::kRelease) {
      on_hold_frame(f);
      return;
    }
    if (drop_stale && (f.stream == kControlStream || is_ours(f.stream))) {
      st.stale_dropped.fetch_add(1, std::memory_order_relaxed);
      return;  // sent to the previous host (settle())
    }
    if (f.stream == kControlStream) {
      if (f.type != FrameType::kData) {
        fatal(internal_error("control stream frame of type " + std::to_string(static_cast<int>(f.type))));
        return;
      }
      if (on_control) on_control(f.payload);
      return;
    }
    if (f.type == FrameType::kOpen) {
      on_peer_open(f);
      return;
    }
    auto it = streams.find(f.stream);
    if (it == streams.end()) {
      unknown_stream(f);
      return;
    }
    Stream& s = it->second;
    switch (f.type) {
      case FrameType::kData: {
        if (s.peer_closed) return protocol_error(s.id, "DATA after CLOSE");
        if (static_cast<int64_t>(f.payload.size()) > s.recv_window) return protocol_error(s.id, "DATA beyond the window");
        if (f.payload.empty()) return;
        size_t len = f.payload.size();
        s.recv_window -= static_cast<int64_t>(len);
        st.bytes_in.fetch_add(len, std::memory_order_relaxed);
        if (s.in.empty()) {
          s.in = std::move(f.payload);
          s.in_pos = 0;
        } else {
          s.in.append(f.payload);
        }
        stream_buffered_total += len;
        note_buffered();
        break;
      }
      case FrameType::kClose:
        if (s.peer_closed) return protocol_error(s.id, "second CLOSE");
        s.peer_closed = true;
        break;
      case FrameType::kReset:
        if (s.ours && !s.accepted)
          st.streams_refused.fetch_add(1, std::memory_order_relaxed);
        else
          st.streams_reset_in.fetch_add(1, std::memory_order_relaxed);
        LOG_DEBUG("mux: stream " << s.id << " reset by the peer: " << f.payload.substr(0, 200));
        remove(s.id);
        return;
      case FrameType::kCredit: {
        if (f.payload.size() != 4) return protocol_error(s.id, "CREDIT payload is not 4 bytes");
        uint32_t v = get_u32(f.payload);
        s.accepted = true;
        if (s.send_window + static_cast<int64_t>(v) > INT32_MAX) return protocol_error(s.id, "credit overflow");
        s.send_window += v;
        break;
      }
      case FrameType::kOpen:
      case FrameType::kHold:
      case FrameType::kHeld:
      case FrameType::kRelease:
        break;  // handled above
    }
    update_after_input(s);
  }

  // HOLD / HELD / RELEASE (docs/channel.md, "Hold"). The host sends HOLD
  // and RELEASE, the agent HELD; anything else is the peer breaking the
  // protocol. A HELD that comes after its hold timed out is dropped.
  void on_hold_frame(const Frame& f) {
    const char* what = f.type == FrameType::kHold ? "HOLD" : f.type == FrameType::kHeld ? "HELD" : "RELEASE";
    bool host = cfg.odd_ids;
    if (f.stream != kControlStream || host != (f.type == FrameType::kHeld) ||
        (f.type == FrameType::kRelease ? !(f.payload.empty() || f.payload == "reset") : !f.payload.empty())) {
      fatal(internal_error(std::string("unexpected ") + what + " frame on stream " + std::to_string(f.stream)));
      return;
    }
    if (f.type == FrameType::kHeld) {
      std::lock_guard<std::mutex> l(mu);
      if (hold_phase == Hold::kSent) {
        if (settling) {
          // Everything the peer sent the previous host is through.
          settling = false;
          drop_stale = false;
          release_req = true;
          release_reset = false;
        } else {
          hold_phase = Hold::kHeld;
        }
        hold_cv.notify_all();
      }
      return;
    }
    if (f.type == FrameType::kHold) {
      if (gate != std::string::npos) return;  // held already
      send_frame(kControlStream, FrameType::kHeld, {});
      gate = out.size();
      return;
    }
    if (f.payload == "reset") {
      // A new host: the streams and answers of the old one go. What was
      // queued before the cut went out; what came after it is dropped.
      std::vector<uint32_t> ids;
      for (auto& [id, st2] : streams) ids.push_back(id);
      for (uint32_t id : ids) remove(id);
      if (gate != std::string::npos) out.resize(gate);
      peer_high = 0;
      std::lock_guard<std::mutex> l(mu);
      ctl_out.clear();
    }
    gate = std::string::npos;
    note_out();
  }

  // The host's side of hold() and release(), on the Mux thread.
  void apply_hold_requests() {
    std::lock_guard<std::mutex> l(mu);
    if (hold_phase == Hold::kRequested) {
      send_frame(kControlStream, FrameType::kHold, {});
      gate = out.size();
      hold_phase = Hold::kSent;
      drop_stale = settling;
    }
    if (release_req) {
      // The end of this side's cut: RELEASE goes at the cut, before what
      // was queued behind it.
      std::string rel;
      put_frame(rel, kControlStream, FrameType::kRelease, release_reset ? "reset" : "");
      if (gate == std::string::npos)
        out.append(rel);
      else
        out.insert(gate, rel);
      gate = std::string::npos;
      release_req = false;
      hold_phase = Hold::kNone;
      settling = false;
      drop_stale = false;
      hold_cv.notify_all();
      note_out();
    }
  }

  void update_after_input(Stream& s) {
    uint32_t id = s.id;
    if (!stream_write(s)) return;
    auto it = streams.find(id);
    if (it != streams.end()) update(it->second);
  }

  void read_channel() {
    for (int i = 0; i < kChannelReadsPerRound && !exit; ++i) {
      ssize_t n = read_some(cfg.channel_fd, scratch.get(), kMaxPayload);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        fatal(peer_gone_or(sys::errno_error("read", "channel"), errno));
        return;
      }
      if (n == 0) {
        if (dec.buffered() > 0)
          fatal(Error(ErrorKind::kUnavailable, "channel closed by the peer in the middle of a frame"));
        else
          fatal(Status::Ok());
        return;
      }
      if (!dec.feed(std::string_view(scratch.get(), static_cast<size_t>(n)))) {
        fatal(internal_error("malformed frame from the peer: " + dec.error()));
        return;
      }
      while (!exit) {
        std::optional<Frame> f = dec.next();
        if (!f) break;
        on_frame(*f);
      }
    }
  }

  void flush_channel() {
    while (out_sendable() > 0) {
      ssize_t n = write_some(cfg.channel_fd, chan_sock, out.data() + out_pos, out_sendable());
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        fatal(peer_gone_or(sys::errno_error("write", "channel"), errno));
        break;
      }
      out_pos += static_cast<size_t>(n);
    }
    if (out_pos == out.size()) {
      out.clear();
      out_pos = 0;
      if (gate != std::string::npos) gate = 0;
      if (out.capacity() > 4 * kChannelOutHighWater) std::string().swap(out);
    } else if (out_pos > kCompactAt && out_pos > out.size() / 2) {
      out.erase(0, out_pos);
      if (gate != std::string::npos) gate -= out_pos;
      out_pos = 0;
    }
    note_out();
  }

  void update_channel_events() {
    uint32_t want = EPOLLIN | (out_sendable() > 0 ? EPOLLOUT : 0u);
    if (want == chan_events) return;
    struct epoll_event ev {};
    ev.events = want;
    ev.data.u64 = kTagChannel;
    if (::epoll_ctl(ep.get(), EPOLL_CTL_MOD, cfg.channel_fd, &ev) != 0) fatal(sys::errno_error("epoll_ctl", "channel"));
    chan_events = want;
  }

  // Streams start or stop reading local fds as the channel backs up or drains.
  void apply_throttle() {
    bool t = out_pending() >= kChannelOutHighWater;
    if (t == throttled) return;
    throttled = t;
    std::vector<uint32_t> ids;
    ids.reserve(streams.size());
    for (auto& [id, s] : streams) ids.push_back(id);
    for (uint32_t id : ids) {
      auto it = streams.find(id);
      if (it != streams.end()) update(it->second);
    }
  }

  void take_requests() {
    std::deque<PendingOpen> new_opens;
    {
      std::lock_guard<std::mutex> l(mu);
      if (!fail_req.empty()) fatal(internal_error(fail_req));
      if (stop_req) fatal(Status::Ok());
      new_opens.swap(opens);
      // Control output waits while the channel is backed up, so it is bounded
      // by max_control_out there (send_control) rather than here.
      if (!ctl_out.empty() && out_pending() < kChannelOutHighWater) {
        out.append(ctl_out);
        ctl_out.clear();
        note_out();
      }
    }
    for (PendingOpen& p : new_opens) {
      our_high = std::max(our_high, p.id);
      if (exit) continue;  // closing p.fd tells its other end
      if (streams.size() >= cfg.max_streams || !set_nonblocking(p.fd.get())) {
        st.streams_refused.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      send_frame(p.id, FrameType::kOpen, p.payload);
      Stream& s = add_stream(p.id, std::move(p.fd), true);
      update(s);
    }
  }

  void on_stream_event(uint32_t id, uint32_t events) {
    auto it = streams.find(id);
    if (it == streams.end()) return;  // removed earlier in this batch
    if ((events & (EPOLLOUT | EPOLLERR | EPOLLHUP)) && want_write(it->second)) {
      if (!stream_write(it->second)) return;
      it = streams.find(id);
      if (it == streams.end()) return;
    }
    // throttled is refreshed once per loop round; the live check keeps one
    // round's reads from overshooting the bound.
    if ((events & (EPOLLIN | EPOLLERR | EPOLLHUP)) && want_read(it->second) && out_pending() < kChannelOutHighWater) {
      if (!stream_read(it->second)) return;
    }
    it = streams.find(id);
    if (it != streams.end()) update(it->second);
  }

  Status run() {
    {
      std::lock_guard<std::mutex> l(mu);
      if (started) return internal_error("Mux::run called twice");
      started = true;
    }
    if (!wake || !ep) return sys::errno_error("eventfd/epoll_create1", "mux");
    if (!set_nonblocking(cfg.channel_fd)) return sys::errno_error("fcntl O_NONBLOCK", "channel");
    chan_sock = is_socket(cfg.channel_fd);
    struct epoll_event ev {};
    ev.events = EPOLLIN;
    ev.data.u64 = kTagChannel;
    if (::epoll_ctl(ep.get(), EPOLL_CTL_ADD, cfg.channel_fd, &ev) != 0) return sys::errno_error("epoll_ctl", "channel");
    chan_events = EPOLLIN;
    ev.data.u64 = kTagWake;
    if (::epoll_ctl(ep.get(), EPOLL_CTL_ADD, wake.get(), &ev) != 0) return sys::errno_error("epoll_ctl", "eventfd");
    for (size_t i = 0; i < watched.size(); ++i) {
      ev.data.u64 = kTagWatchBase + i;
      if (::epoll_ctl(ep.get(), EPOLL_CTL_ADD, watched[i].first, &ev) != 0)
        return sys::errno_error("epoll_ctl", "watched fd " + std::to_string(watched[i].first));
    }

    struct epoll_event evs[kMaxEvents];
    for (;;) {
      take_requests();
      apply_hold_requests();
      if (!exit) flush_channel();
      if (!exit) apply_throttle();
      if (!exit && out_pending() > out_hard_limit())
        fatal(internal_error("peer is not reading the channel (" + std::to_string(out_pending()) + " bytes unsent)"));
      if (!exit) update_channel_events();
      if (exit) break;
      int n = ::epoll_wait(ep.get(), evs, kMaxEvents, -1);
      if (n < 0) {
        if (errno == EINTR) continue;
        fatal(sys::errno_error("epoll_wait", "mux"));
        break;
      }
      for (int i = 0; i < n && !exit; ++i) {
        uint64_t tag = evs[i].data.u64;
        uint32_t e = evs[i].events;
        if (tag == kTagChannel) {
          if (e & (EPOLLIN | EPOLLHUP | EPOLLERR)) read_channel();
        } else if (tag == kTagWake) {
          uint64_t v;
          ssize_t r = ::read(wake.get(), &v, sizeof v);
          (void)r;
        } else if (tag >= kTagWatchBase) {
          watched[tag - kTagWatchBase].second();
        } else {
          on_stream_event(static_cast<uint32_t>(tag), e);
        }
      }
    }

    // Teardown: whatever is still queued goes out best effort, then every
    // stream fd closes, which its other end sees as EOF.
    std::deque<PendingOpen> dropped;
    {
      std::lock_guard<std::mutex> l(mu);
      finished = true;
      dropped.swap(opens);
      out.append(ctl_out);
      ctl_out.clear();
      hold_cv.notify_all();
    }
    if (out_pending() > 0 && exit->ok()) {
      std::optional<Status> keep = std::move(exit);
      exit.reset();
      flush_channel();
      exit = std::move(keep);
    }
    std::vector<uint32_t> ids;
    for (auto& [id, s] : streams) ids.push_back(id);
    for (uint32_t id : ids) remove(id);
    for (auto& [fd, h] : watched) ::epoll_ctl(ep.get(), EPOLL_CTL_DEL, fd, nullptr);
    ::epoll_ctl(ep.get(), EPOLL_CTL_DEL, cfg.channel_fd, nullptr);
    return *exit;
  }
};

Mux::Mux(MuxConfig cfg, OpenHandler on_open, ControlHandler on_control)
    : impl_(std::make_unique<Impl>(cfg, std::move(on_open), std::move(on_control))) {}

Mux::~Mux() = default;

Status Mux::run() { return impl_->run(); }

Result<uint32_t> Mux::open_stream(UniqueFd local_fd, std::string open_payload) {
  if (!local_fd) return invalid_error("open_stream: invalid local fd");
  if (open_payload.size() > kMaxPayload) return invalid_error("open_stream: OPEN payload over 64 KiB");
  uint32_t id;
  {
    std::lock_guard<std::mutex> l(impl_->mu);
    if (impl_->finished) return Error(ErrorKind::kUnavailable, "channel is closed");
    if (impl_->st.open_streams.load() + impl_->opens.size() >= impl_->cfg.max_streams)
      return Error(ErrorKind::kQuota, "stream limit reached (" + std::to_string(impl_->cfg.max_streams) + " open)");
    if (impl_->next_id > UINT32_MAX - 2) return Error(ErrorKind::kUnavailable, "channel stream ids exhausted");
    id = impl_->next_id;
    impl_->next_id += 2;
    impl_->opens.push_back(Impl::PendingOpen{id, std::move(local_fd), std::move(open_payload)});
  }
  impl_->signal_wake();
  return id;
}

Status Mux::send_control(std::string payload) {
  if (payload.size() > kMaxPayload) return invalid_error("control message over 64 KiB");
  {
    std::lock_guard<std::mutex> l(impl_->mu);
    if (impl_->finished) return Error(ErrorKind::kUnavailable, "channel is closed");
    if (impl_->ctl_out.size() + kHeaderSize + payload.size() > impl_->cfg.max_control_out) {
      if (impl_->fail_req.empty())
        impl_->fail_req = "peer is not reading the channel (" + std::to_string(impl_->ctl_out.size()) +
                          " bytes of control messages unsent)";
      impl_->signal_wake();
      return Error(ErrorKind::kUnavailable, impl_->fail_req);
    }
    put_frame(impl_->ctl_out, kControlStream, FrameType::kData, payload);
  }
  impl_->signal_wake();
  return Status::Ok();
}

Status Mux::hold(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> l(impl_->mu);
  if (impl_->finished) return Error(ErrorKind::kUnavailable, "channel is closed");
  if (impl_->hold_phase != Impl::Hold::kNone) return conflict_error("the channel is held already");
  impl_->hold_phase = Impl::Hold::kRequested;
  impl_->signal_wake();
  bool held = impl_->hold_cv.wait_for(l, timeout, [&] { return impl_->hold_phase == Impl::Hold::kHeld || impl_->finished; });
  if (held && impl_->hold_phase == Impl::Hold::kHeld) return Status::Ok();
  if (impl_->finished) return Error(ErrorKind::kUnavailable, "channel closed while holding it");
  impl_->release_req = true;
  impl_->release_reset = false;
  impl_->signal_wake();
  return Error(ErrorKind::kTimeout, "the agent did not answer HOLD within " +
                                                 std::to_string(timeout.count()) + " ms");
}

Status Mux::settle(std::chrono::milliseconds wait) {
  std::unique_lock<std::mutex> l(impl_->mu);
  if (impl_->finished) return Error(ErrorKind::kUnavailable, "channel is closed");
  if (impl_->hold_phase != Impl::Hold::kNone) return conflict_error("the channel is held already");
  impl_->hold_phase = Impl::Hold::kRequested;
  impl_->settling = true;
  impl_->signal_wake();
  impl_->hold_cv.wait_for(l, wait, [&] { return !impl_->settling || impl_->finished; });
  if (!impl_->settling) return Status::Ok();
  if (impl_->finished) return Error(ErrorKind::kUnavailable, "channel closed while settling it");
  return Error(ErrorKind::kTimeout, "the agent did not answer HOLD within " + std::to_string(wait.count()) +
                                        " ms; the channel stays held until it does");
}

void Mux::release(bool reset) {
  {
    std::lock_guard<std::mutex> l(impl_->mu);
    if (impl_->hold_phase == Impl::Hold::kNone) {
      // No cut on this side: RELEASE goes in order with the control
      // messages sent before and after it.
      put_frame(impl_->ctl_out, kControlStream, FrameType::kRelease, reset ? "reset" : "");
    } else {
      impl_->release_req = true;
      impl_->release_reset = reset;
    }
  }
  impl_->signal_wake();
}

void Mux::stop() {
  {
    std::lock_guard<std::mutex> l(impl_->mu);
    impl_->stop_req = true;
  }
  impl_->signal_wake();
}

void Mux::fail(std::string reason) {
  {
    std::lock_guard<std::mutex> l(impl_->mu);
    if (impl_->fail_req.empty()) impl_->fail_req = reason.empty() ? "closed" : std::move(reason);
  }
  impl_->signal_wake();
}

void Mux::watch_fd(int fd, std::function<void()> on_readable) {
  impl_->watched.emplace_back(fd, std::move(on_readable));
}

Mux::Stats Mux::stats() const {
  const auto& a = impl_->st;
  Stats s;
  s.streams_opened = a.streams_opened.load();
  s.streams_refused = a.streams_refused.load();
  s.bytes_in = a.bytes_in.load();
  s.bytes_out = a.bytes_out.load();
  s.protocol_errors = a.protocol_errors.load();
  s.streams_reset_in = a.streams_reset_in.load();
  s.stale_dropped = a.stale_dropped.load();
  s.open_streams = a.open_streams.load();
  s.stream_buffered = a.stream_buffered.load();
  s.channel_out_buffered = a.channel_out.load();
  s.peak_stream_buffered = a.peak_stream_buffered.load();
  s.peak_channel_out_buffered = a.peak_channel_out.load();
  return s;
}

}  // namespace sg::channel
