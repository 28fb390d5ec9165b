// kv_handoff_bench: the PD KV handoff between two processes over UCX on
// loopback (actors/node/kv_handoff: lend -> KvOffer -> pull by RMA get ->
// KvConfirm -> KvRelease), next to ucx_perftest ucp_get at the same size and
// UCX settings, in the same run. Prints a markdown table.
//
//   kv_handoff_bench [--sizes 1048576,...] [--page-bytes 2097152] [--trials 3]
//                    [--iters 8] [--perftest PATH] [--no-perftest]
//
// The owner process lends an image of `size` bytes in pages of `page-bytes`
// (one descriptor per run of pages) each time the taker asks; the taker pulls
// it with one get per page into fresh page buffers, as the decode side of a
// handoff does. Reported per size (best of --trials, each the mean of --iters
// handoffs):
//   pull GB/s      bytes / (first get issued .. last get completed): the RMA
//                  part, what ucx_perftest measures
//   handoff GB/s   bytes / (ask .. KvRelease back): everything, including the
//                  owner's copy into the lent region, the frames and the
//                  taker's page allocation
//   ucp_get GB/s   ucx_perftest -t ucp_get -s <size> -e (error mode PEER, as ours)
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>

#include <condition_variable>
#include <csignal>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "bench/ucx_perftest.hpp"
#include "actors/node/kv_handoff.hpp"
#include "tests/transport/args.hpp"
#include "transport/ucx.hpp"

using namespace troupe;
using namespace troupe::transport;
using namespace troupe::bench;
using troupe::actors::node::KvHandoff;
using troupe::actors::node::KvHandoffOptions;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kPageTokens = 64;

engine::SequenceImage make_image(size_t bytes, size_t page_bytes) {
  engine::SequenceImage im;
  im.page_tokens = kPageTokens;
  const size_t n = std::max<size_t>(1, bytes / page_bytes);
  im.length = static_cast<int64_t>(n) * kPageTokens;
  im.tokens.assign(static_cast<size_t>(im.length) + 1, 1);
  for (size_t i = 0; i < n; ++i) {
    engine::SequenceImage::Page p;
    p.index = static_cast<int64_t>(i);
    p.kind = cache::PoolKind::window;
    p.bytes.resize(page_bytes);
    std::memset(p.bytes.data(), static_cast<int>(i * 13 + 1), page_bytes);
    im.pages.push_back(std::move(p));
  }
  return im;
}

// ------------------------------------------------------------------ owner

int own() {
  UcxOptions o;
  o.name = "owner";
  UcxTransport t(o);
  KvHandoffOptions ko;
  ko.pooled_regions = 2;
  KvHandoff kv(t, ko);
  std::map<std::pair<size_t, size_t>, engine::SequenceImage> images;
  std::mutex mu;
  TransportEvents e;
  e.on_frame = [&](const std::string& peer, Frame f) {
    if (f.kind() == msg::Kind::HEARTBEAT) {  // "lend me an image": seq = bytes, sentUnixNanos = page bytes
      auto v = messages::open<msg::Heartbeat>(f);
      const size_t bytes = v->root().getSeq(), page = v->root().getSentUnixNanos();
      std::lock_guard lock(mu);
      auto& im = images[{bytes, page}];
      if (im.pages.empty()) im = make_image(bytes, page);
      messages::FrameBuilder<msg::KvOffer> b;
      auto lease = kv.lend(peer, im, std::chrono::seconds(60), b.root());
      if (!lease) {
        spdlog::error("lend: {}", lease.error().what());
        return;
      }
      (void)t.send(peer, b.finish(f.request_id()));
    } else if (f.kind() == msg::Kind::KV_CONFIRM) {
      kv.on_confirm(peer, messages::open<msg::KvConfirm>(f)->root().getLeaseId());
    } else if (f.kind() == msg::Kind::KV_RELEASE) {
      kv.on_release(peer, messages::open<msg::KvRelease>(f)->root().getLeaseId());
    }
  };
  if (!t.start(std::move(e))) return 1;
  std::printf("READY ucx=%s\n", t.address().c_str());
  std::fflush(stdout);
  char c;
  while (::read(0, &c, 1) > 0) {
  }
  kv.abandon();
  return 0;
}

// ------------------------------------------------------------------ taker

class Taker {
 public:
  explicit Taker(const std::string& address) {
    UcxOptions o;
    o.name = "taker";
    o.listen_host.clear();
    t_ = std::make_unique<UcxTransport>(o);
    kv_ = std::make_unique<KvHandoff>(*t_, KvHandoffOptions{});
    TransportEvents e;
    e.on_frame = [this](const std::string& peer, Frame f) {
      if (f.kind() == msg::Kind::KV_OFFER) {
        auto v = messages::open<msg::KvOffer>(f);
        engine::SequenceImage meta;
        meta.page_tokens = kPageTokens;
        kv_->pull(peer, v->root(), std::move(meta), [this](Expected<engine::SequenceImage> im) {
          std::lock_guard lock(mu_);
          if (!im) spdlog::error("pull: {}", im.error().what());
          ok_ = im.ok();
          // The pages are dropped here, as the engine drops them after import.
        });
      } else if (f.kind() == msg::Kind::KV_RELEASE) {
        std::lock_guard lock(mu_);
        released_ = f.request_id();
        cv_.notify_all();
      }
    };
    if (!t_->start(std::move(e))) throw std::runtime_error("start");
    auto p = t_->connect(address, std::chrono::seconds(10));
    if (!p) throw std::runtime_error(p.error().what());
  }

  struct Result {
    double pull = 0, handoff = 0;  // bytes/s
  };

  // `iters` handoffs of one image; mean rates.
  Result run(size_t bytes, size_t page, int iters) {
    double rma = 0, total = 0;
    for (int i = 0; i < iters; ++i) {
      const double rma0 = kv_->stats().rma_seconds;
      const uint64_t id = ++asked_;
      messages::FrameBuilder<msg::Heartbeat> b;
      b.root().setSeq(bytes);
      b.root().setSentUnixNanos(page);
      auto t0 = Clock::now();
      (void)t_->send("owner", b.finish(id));
      std::unique_lock lock(mu_);
      // The lease id is the owner's; the KvRelease frame carries it as request id,
      // so wait for any release after this ask.
      cv_.wait(lock, [&] { return released_ != 0; });
      released_ = 0;
      total += std::chrono::duration<double>(Clock::now() - t0).count();
      rma += kv_->stats().rma_seconds - rma0;
      if (!ok_) throw std::runtime_error("a pull failed");
    }
    const double moved = static_cast<double>(std::max<size_t>(bytes / page, 1) * page) * iters;
    return {moved / rma, moved / total};
  }

  ~Taker() { kv_->abandon(); }

 private:
  std::unique_ptr<UcxTransport> t_;
  std::unique_ptr<KvHandoff> kv_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t released_ = 0, asked_ = 0;
  bool ok_ = true;
};

// ------------------------------------------------------------------ processes

}  // namespace

int main(int argc, char** argv) {
  test::Args args(argc, argv);
  std::vector<size_t> sizes = {1u << 20, 16u << 20, 64u << 20, 256u << 20};
  if (auto list = args.get("--sizes"); !list.empty()) {
    sizes.clear();
    for (size_t pos = 0; pos < list.size();) {
      size_t comma = list.find(',', pos);
      sizes.push_back(std::stoull(list.substr(pos, comma - pos)));
      pos = comma == std::string::npos ? list.size() : comma + 1;
    }
  }
  const size_t page = static_cast<size_t>(args.num("--page-bytes", 2 << 20));
  const int trials = static_cast<int>(args.num("--trials", 3));
  const int iters = static_cast<int>(args.num("--iters", 8));
  const std::string perftest_bin = args.get("--perftest", "ucx_perftest");
  const bool no_perftest = args.flag("--no-perftest");
  setenv("UCX_NET_DEVICES", "lo", 0);
  setenv("UCX_MM_ERROR_HANDLING", "y", 0);
  spdlog::set_level(spdlog::level::warn);
  if (args.flag("--own")) return own();

  auto owner = spawn({"/proc/self/exe", "--own"});
  std::string ready = read_line(owner.out);
  Taker taker(ready.substr(ready.find("ucx=") + 4));

  std::cout << "| image | pages | pull GB/s | handoff GB/s | ucp_get GB/s | pull / ucp_get |\n";
  std::cout << "|---|---|---|---|---|---|\n";
  for (size_t size : sizes) {
    const size_t p = std::min(page, size);
    taker.run(size, p, 2);  // warm-up: regions pooled, pages faulted in once
    Taker::Result best;
    double get = 0;
    for (int t = 0; t < trials; ++t) {
      auto r = taker.run(size, p, iters);
      best.pull = std::max(best.pull, r.pull);
      best.handoff = std::max(best.handoff, r.handoff);
      if (!no_perftest) {
        const size_t n = std::clamp<size_t>((size_t{4} << 30) / size, 16, 2000);
        get = std::max(get, perftest(perftest_bin, "ucp_get", size, n).bytes_per_s);
      }
    }
    std::cout << fmt::format("| {} | {} x {} | {:.2f} | {:.2f} | {:.2f} | {:.0f}% |\n", human(size), size / p, human(p),
                             best.pull / 1e9, best.handoff / 1e9, get / 1e9, get > 0 ? 100.0 * best.pull / get : 0.0)
              << std::flush;
  }
  close(owner.in);
  waitpid(owner.pid, nullptr, 0);
  return 0;
}
