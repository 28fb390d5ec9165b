// transport_bench: UcxTransport frames and page puts between two processes
// on 127.0.0.1, next to ucx_perftest (ucp_am_bw, ucp_put_bw) at the same
// sizes and UCX settings, in the same run. Prints a markdown table.
//
//   transport_bench [--sizes 64,4096,...] [--trials 3] [--gib 1] [--perftest PATH]
//                   [--spin-us N] [--spin-in-flight] [--frame-arena-mb N] [--frame-chunk-kb N] [--frame-from-kb N]
//                   [--no-perftest] [--no-puts]
//
// Frames: the client sends n frames back to back (at most max(32 MiB, 4
// frames) queued), then a marker; the server answers the marker once it has
// counted all n. Frame bytes = 24-byte header
// + body; the body is a StageActivation whose inline payload fills it (the
// 64 B row sends the smallest frame, an empty TokenChunk). ucx_perftest
// ucp_am_bw gets -s <body bytes> -H 32 (our active-message header: frame
// header + sequence number) and -e (error mode PEER, as ours).
// Puts: batches of 16 puts of one size into a region the server allocated
// (allocate_region: UCX memory a local peer maps), one completion (flush) per
// batch, up to 4 batches in flight, from one source buffer to one remote
// offset as ucp_put_bw does; next to ucp_put_bw -s <size> -e. A second put row targets caller
// memory registered with register_region.
// --frame-arena-mb / --frame-chunk-kb / --frame-from-kb: UcxOptions::
// put_frames_arena_bytes, put_frames_chunk_bytes and put_frames_from_bytes on
// both sides (arena 0: every large frame by rendezvous; default: the
// transport's defaults).
// Each measurement runs --trials times, interleaved with its peer; the best
// of each is reported (the machine is shared).
#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <future>
#include <iostream>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <cstring>

#include "bench/ucx_perftest.hpp"
#include "messages/kinds.hpp"
#include "tests/transport/args.hpp"
#include "transport/ucx.hpp"

using namespace troupe;
using namespace troupe::transport;
using namespace troupe::bench;
using messages::FrameBuilder;
using Clock = std::chrono::steady_clock;

namespace {

constexpr size_t kRegionBytes = 64u << 20;

// ------------------------------------------------------------------ server

int g_spin_us = 0;
bool g_spin_in_flight = false;
int g_frame_arena_mb = -1;  // -1: the transport's default
int g_frame_chunk_kb = -1;
int g_frame_from_kb = -1;

void apply_frame_arena(UcxOptions& o) {
  if (g_frame_arena_mb >= 0) o.put_frames_arena_bytes = static_cast<size_t>(g_frame_arena_mb) << 20;
  if (g_frame_chunk_kb > 0) o.put_frames_chunk_bytes = static_cast<size_t>(g_frame_chunk_kb) << 10;
  if (g_frame_from_kb > 0) o.put_frames_from_bytes = static_cast<size_t>(g_frame_from_kb) << 10;
}

int serve() {
  UcxOptions o;
  o.name = "bench-server";
  o.spin_after_work_us = g_spin_us;
  o.spin_while_in_flight = g_spin_in_flight;
  apply_frame_arena(o);
  UcxTransport t(o);
  std::atomic<uint64_t> count{0};
  std::vector<uint8_t> caller(kRegionBytes);
  TransportEvents e;
  std::mutex mu;
  std::condition_variable cv;
  std::string client;
  e.on_peer_up = [&](const std::string& p) {
    std::lock_guard lock(mu);
    client = p;
    cv.notify_all();
  };
  e.on_frame = [&](const std::string& p, Frame f) {
    if (f.kind() == msg::Kind::HEARTBEAT) {  // marker: answer with the count
      FrameBuilder<msg::Ack> a;
      a.root().setDetail(std::to_string(count.exchange(0)));
      (void)t.send(p, a.finish(f.request_id()));
      return;
    }
    count.fetch_add(1, std::memory_order_relaxed);
  };
  if (!t.start(std::move(e))) return 1;
  std::printf("READY ucx=%s\n", t.address().c_str());
  std::fflush(stdout);
  {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return !client.empty(); });
  }
  auto allocated = t.allocate_region(kRegionBytes);
  auto registered = t.register_region(caller.data(), caller.size());
  if (!allocated || !registered) return 1;
  FrameBuilder<msg::KvOffer> offer;
  auto ds = offer.root().initDescriptors(2);
  to_wire(allocated->key, ds[0].initRegion());
  to_wire(registered->key, ds[1].initRegion());
  (void)t.send(client, offer.finish(1));
  // Runs until the client closes its stdin pipe (our parent exits).
  char c;
  while (::read(0, &c, 1) > 0) {
  }
  return 0;
}

// ------------------------------------------------------------------ client

class Client {
 public:
  explicit Client(const std::string& address) {
    UcxOptions o;
    o.name = "bench-client";
    o.listen_host.clear();
    o.spin_after_work_us = g_spin_us;
    o.spin_while_in_flight = g_spin_in_flight;
    apply_frame_arena(o);
    t_ = std::make_unique<UcxTransport>(o);
    TransportEvents e;
    e.on_frame = [this](const std::string&, Frame f) {
      std::lock_guard lock(mu_);
      if (f.kind() == msg::Kind::KV_OFFER) {
        auto v = messages::open<msg::KvOffer>(f);
        allocated_ = from_wire(v->root().getDescriptors()[0].getRegion());
        registered_ = from_wire(v->root().getDescriptors()[1].getRegion());
      } else if (f.kind() == msg::Kind::ACK) {
        acked_ = std::stoull(messages::open<msg::Ack>(f)->root().getDetail().cStr());
        ack_id_ = f.request_id();
      }
      cv_.notify_all();
    };
    if (!t_->start(std::move(e))) throw std::runtime_error("start");
    auto p = t_->connect(address, std::chrono::seconds(10));
    if (!p) throw std::runtime_error(p.error().what());
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return allocated_.length > 0; });
  }

  // Sends n frames, at most `window` bytes queued, and waits until the
  // server counted them; frames/s.
  double frames(const Frame& f, size_t n, size_t window) {
    uint64_t marker = ++markers_;
    auto t0 = Clock::now();
    for (size_t i = 0; i < n; ++i) {
      while (t_->stats().send_queue_bytes > window) std::this_thread::sleep_for(std::chrono::microseconds(20));
      (void)t_->send("bench-server", f);
    }
    (void)t_->send("bench-server", FrameBuilder<msg::Heartbeat>().finish(marker));
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return ack_id_ == marker; });
    double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (acked_ != n) spdlog::warn("server counted {} of {} frames", acked_, n);
    spdlog::debug("{} frames of {} bytes in {:.3f} s; {} by put so far", n, f.body_bytes().size(), s,
                  t_->stats().frames_by_put);
    return n / s;
  }

  // n puts of `size` bytes in batches of 16 (one completion each), up to 4
  // batches in flight; bytes/s.
  double puts(bool into_allocated, size_t size, size_t n) {
    const RegionKey& key = into_allocated ? allocated_ : registered_;
    if (src_.size() < kRegionBytes) src_.assign(kRegionBytes, 7);
    // Like ucp_put_bw: one source buffer and one remote destination of the
    // message size, reused by every put.
    std::mutex mu;
    std::condition_variable cv;
    int in_flight = 0;
    bool failed = false;
    auto t0 = Clock::now();
    size_t done = 0;
    while (done < n) {
      std::vector<RmaOp> ops;
      for (size_t k = 0; k < 16 && done < n; ++k, ++done) ops.push_back({src_.data(), 0, size});
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return in_flight < 4; });
      ++in_flight;
      lock.unlock();
      t_->put("bench-server", key, std::move(ops), [&](Status s) {
        std::lock_guard l(mu);
        failed |= !s.ok();
        --in_flight;
        cv.notify_all();
      });
    }
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return in_flight == 0; });
    if (failed) throw std::runtime_error("a put failed");
    double s = std::chrono::duration<double>(Clock::now() - t0).count();
    return n * static_cast<double>(size) / s;
  }

 private:
  std::unique_ptr<UcxTransport> t_;
  std::mutex mu_;
  std::condition_variable cv_;
  RegionKey allocated_, registered_;
  uint64_t acked_ = 0, ack_id_ = 0, markers_ = 0;
  std::vector<uint8_t> src_;
};

Frame frame_of_size(size_t target) {
  if (target <= 64) return FrameBuilder<msg::TokenChunk>().finish(1);
  FrameBuilder<msg::StageActivation> b;
  b.root().getPayload().initInline(0);
  size_t overhead = messages::kHeaderBytes + b.finish(1).body_bytes().size();
  FrameBuilder<msg::StageActivation> c;
  c.root().getPayload().initInline(target > overhead ? target - overhead : 0);
  return c.finish(1);
}

}  // namespace

int main(int argc, char** argv) {
  test::Args args(argc, argv);
  bool serve_mode = args.flag("--serve");
  std::vector<size_t> sizes = {64, 4096, 65536, 1u << 20, 4u << 20, 16u << 20, 64u << 20};
  if (auto list = args.get("--sizes"); !list.empty()) {
    sizes.clear();
    for (size_t pos = 0; pos < list.size();) {
      size_t comma = list.find(',', pos);
      sizes.push_back(std::stoull(list.substr(pos, comma - pos)));
      pos = comma == std::string::npos ? list.size() : comma + 1;
    }
  }
  int trials = static_cast<int>(args.num("--trials", 3));
  std::string perftest_bin = args.get("--perftest", "ucx_perftest");
  double target_gib = std::atof(args.get("--gib", "1").c_str());
  g_spin_us = static_cast<int>(args.num("--spin-us", 0));
  g_spin_in_flight = args.flag("--spin-in-flight");
  g_frame_arena_mb = static_cast<int>(args.num("--frame-arena-mb", -1));
  g_frame_chunk_kb = static_cast<int>(args.num("--frame-chunk-kb", -1));
  g_frame_from_kb = static_cast<int>(args.num("--frame-from-kb", -1));
  bool no_perftest = args.flag("--no-perftest");
  bool no_puts = args.flag("--no-puts");  // frames only (profiling the frame path)
  setenv("UCX_NET_DEVICES", "lo", 0);
  setenv("UCX_MM_ERROR_HANDLING", "y", 0);
  spdlog::set_default_logger(spdlog::stderr_color_mt("bench"));  // stdout is the table
  spdlog::set_level(std::getenv("TROUPE_BENCH_DEBUG") ? spdlog::level::debug : spdlog::level::warn);
  if (serve_mode) return serve();

  std::vector<std::string> server_args = {"/proc/self/exe", "--serve", "--spin-us", std::to_string(g_spin_us)};
  if (g_spin_in_flight) server_args.push_back("--spin-in-flight");
  if (g_frame_arena_mb >= 0) {
    server_args.push_back("--frame-arena-mb");
    server_args.push_back(std::to_string(g_frame_arena_mb));
  }
  for (auto [flag, v] : {std::pair{"--frame-chunk-kb", g_frame_chunk_kb}, std::pair{"--frame-from-kb", g_frame_from_kb}}) {
    if (v > 0) {
      server_args.push_back(flag);
      server_args.push_back(std::to_string(v));
    }
  }
  auto server = spawn(server_args);
  std::string ready = read_line(server.out);
  auto addr = ready.substr(ready.find("ucx=") + 4);
  Client client(addr);

  std::cout << "| size | frame bytes | troupe frames/s | troupe GB/s | ucp_am_bw GB/s, poll | ucp_am_bw GB/s, sleep | "
               "troupe / poll | troupe put GB/s | ucp_put_bw GB/s | put / ucp_put_bw | put into caller memory GB/s |\n";
  std::cout << "|---|---|---|---|---|---|---|---|---|---|---|\n";
  auto median = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  for (size_t size : sizes) {
    Frame f = frame_of_size(size);
    size_t frame_bytes = messages::kHeaderBytes + f.body_bytes().size();
    size_t body = f.body_bytes().size();
    size_t n = std::clamp<size_t>(static_cast<size_t>(target_gib * (1ull << 30) / frame_bytes), 16, 200000);
    size_t n_put = std::clamp<size_t>(static_cast<size_t>(target_gib * (1ull << 30) / size), 64, 200000);
    size_t window = std::max<size_t>(32u << 20, 4 * frame_bytes);
    client.frames(f, std::max<size_t>(n / 10, 4), window);  // warm-up
    double fps = 0, am = 0, am_sleep = 0, put = 0, put_pt = 0, put_caller = 0;
    std::vector<double> am_ratio, put_ratio;  // per trial, measured back to back
    for (int t = 0; t < trials; ++t) {
      double ours = client.frames(f, n, window);
      fps = std::max(fps, ours);
      if (!no_perftest) {
        auto r = perftest(perftest_bin, "ucp_am_bw", body, n, true);
        am = std::max(am, r.bytes_per_s);
        if (r.bytes_per_s > 0) am_ratio.push_back(ours * body / r.bytes_per_s);
        am_sleep = std::max(am_sleep, perftest(perftest_bin, "ucp_am_bw", body, n, true, true).bytes_per_s);
      }
      if (no_puts) continue;
      double p = client.puts(true, size, n_put);
      put = std::max(put, p);
      if (!no_perftest) {
        double pt = perftest(perftest_bin, "ucp_put_bw", size, n_put, false).bytes_per_s;
        put_pt = std::max(put_pt, pt);
        if (pt > 0) put_ratio.push_back(p / pt);
      }
      put_caller = std::max(put_caller, client.puts(false, size, std::max<size_t>(n_put / 4, 16)));
    }
    std::cout << fmt::format("| {} | {} | {:.0f} | {:.2f} | {:.2f} | {:.2f} | {:.0f}% | {:.2f} | {:.2f} | {:.0f}% | {:.2f} |\n",
                             human(size), frame_bytes, fps, fps * frame_bytes / 1e9, am / 1e9, am_sleep / 1e9,
                             100.0 * median(am_ratio), put / 1e9, put_pt / 1e9, 100.0 * median(put_ratio),
                             put_caller / 1e9)
              << std::flush;
  }
  close(server.in);
  kill(server.pid, SIGTERM);
  waitpid(server.pid, nullptr, 0);
  return 0;
}
