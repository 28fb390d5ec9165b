// frame_test_server [--tcp-port N] [--ucx] [--name NAME] [--connect ADDR]...
//   [--token-interval-ms N] [--max-body N] [--partial-timeout-ms N] [--max-queued-bytes N]
// A real troupe endpoint for two-process and cross-language
// tests: a FrameServer on TCP and (with --ucx) a UCX transport, both served
// by TestService. Prints one line "READY tcp=PORT ucx=ADDRESS" on stdout,
// then serves until SIGTERM/SIGINT (logs on stderr).
//   --offer-bytes N   after each UCX peer connects, register N bytes (pattern
//                     seed = N) and send it a KvOffer (lease id N) to take.
//   --flood-bytes N   after each UCX peer connects, send it StageActivation
//                     frames of about N bytes back to back until it is gone
//                     (rendezvous transfers always in flight, for kill tests).
//   --no-probe-replies  never answer a peer's inbox probe (UcxOptions::answer_probes),
//                     as if this process's answers could not reach the peer.
// Client mode, for tests that kill a client:
//   --tcp-client HOST:PORT --generate N   submit one GenerateRequest, print
//                     READY after its first TokenChunk, keep reading.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <csignal>
#include <cstdio>
#include <thread>

#include "messages/kinds.hpp"
#include "tests/transport/args.hpp"
#include "tests/transport/pattern.hpp"
#include "tests/transport/test_service.hpp"
#include "transport/frame_server.hpp"
#include "transport/tcp.hpp"
#include "transport/ucx.hpp"

using namespace troupe;

namespace {
volatile std::sig_atomic_t g_stop = 0;
void on_signal(int) { g_stop = 1; }

int run_client(const std::string& hostport, uint32_t max_tokens) {
  auto colon = hostport.rfind(':');
  auto sock = transport::TcpFrameSocket::connect(hostport.substr(0, colon),
                                                 static_cast<uint16_t>(std::stoi(hostport.substr(colon + 1))),
                                                 std::chrono::seconds(5));
  if (!sock) {
    std::fprintf(stderr, "%s\n", sock.error().what());
    return 1;
  }
  messages::FrameBuilder<msg::GenerateRequest> b;
  b.root().getPrompt().initTokenIds(3).set(0, 5);
  b.root().setMaxTokens(max_tokens);
  if (auto s = (*sock)->send(b.finish(1)); !s) return 1;
  bool ready = false;
  for (;;) {
    auto f = (*sock)->receive(std::chrono::seconds(60));
    if (!f) return 0;
    if (!ready && f->kind() == msg::Kind::TOKEN_CHUNK) {
      std::printf("READY\n");
      std::fflush(stdout);
      ready = true;
    }
    if (f->kind() == msg::Kind::FINISH) return 0;
  }
}

}  // namespace

int main(int argc, char** argv) {
  test::Args args(argc, argv);
  int tcp_port = static_cast<int>(args.num("--tcp-port", 0));
  int interval_ms = static_cast<int>(args.num("--token-interval-ms", 2));
  bool ucx = args.flag("--ucx");
  std::string name = args.get("--name", "test-server");
  std::vector<std::string> connect = args.all("--connect");
  uint64_t offer_bytes = static_cast<uint64_t>(args.num("--offer-bytes", 0));
  uint64_t flood_bytes = static_cast<uint64_t>(args.num("--flood-bytes", 0));
  uint32_t max_body = static_cast<uint32_t>(args.num("--max-body", 8u << 20));
  std::string tcp_client = args.get("--tcp-client");
  uint32_t generate = static_cast<uint32_t>(args.num("--generate", 16));
  int partial_timeout_ms = static_cast<int>(args.num("--partial-timeout-ms", 30000));
  size_t max_queued = static_cast<size_t>(args.num("--max-queued-bytes", 64u << 20));
  if (!tcp_client.empty()) return run_client(tcp_client, generate);
  spdlog::set_default_logger(spdlog::stderr_color_mt("server"));
  spdlog::set_pattern("[%H:%M:%S.%e] [%l] %v");
  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);
  setenv("UCX_NET_DEVICES", "lo", 0);

  test::TestService service{std::chrono::milliseconds(interval_ms)};
  transport::FrameServerOptions so;
  so.port = static_cast<uint16_t>(tcp_port);
  so.limits.max_body_bytes = max_body;
  so.partial_frame_timeout = std::chrono::milliseconds(partial_timeout_ms);
  so.max_queued_bytes = max_queued;
  transport::FrameServer server(so, service);
  if (auto s = server.start(); !s) {
    spdlog::error("{}", s.error().what());
    return 1;
  }
  std::unique_ptr<transport::UcxTransport> ut;
  std::vector<transport::LocalRegion> offered;
  std::mutex offered_mu;
  if (ucx) {
    transport::UcxOptions uo;
    uo.name = name;
    uo.answer_probes = !args.flag("--no-probe-replies");
    ut = std::make_unique<transport::UcxTransport>(uo);
    auto events = server.transport_events(*ut);
    if (offer_bytes) {
      auto up = events.on_peer_up;
      auto* t = ut.get();
      events.on_peer_up = [up, t, offer_bytes, &offered, &offered_mu](const std::string& peer) {
        up(peer);
        // allocate_region blocks on the transport thread: do it elsewhere.
        std::thread([t, peer, offer_bytes, &offered, &offered_mu] {
          auto r = t->allocate_region(offer_bytes);
          if (!r) return spdlog::error("offer: {}", r.error().what());
          test::fill_pattern(r->base, r->length, offer_bytes);
          {
            std::lock_guard lock(offered_mu);
            offered.push_back(*r);
          }
          messages::FrameBuilder<msg::KvOffer> b;
          b.root().setLeaseId(offer_bytes);
          b.root().setTokenCount(1);
          auto d = b.root().initDescriptors(1)[0];
          d.setKind(msg::StateKind::SWA_WINDOW);
          d.initPages(1).set(0, 0);
          d.setPageBytes(offer_bytes);
          d.setPageStride(offer_bytes);
          d.setDtype(msg::Dtype::U8);
          transport::to_wire(r->key, d.initRegion());
          (void)t->send(peer, b.finish(7));
        }).detach();
      };
    }
    if (flood_bytes) {
      auto up = events.on_peer_up;
      auto* t = ut.get();
      events.on_peer_up = [up, t, flood_bytes](const std::string& peer) {
        up(peer);
        std::thread([t, peer, flood_bytes] {
          messages::FrameBuilder<msg::StageActivation> b;
          b.root().getPayload().initInline(flood_bytes);
          auto f = b.finish(1);
          for (uint64_t i = 0; !g_stop; ++i) {
            auto s = t->send(peer, f.with_request_id(i));
            if (s.ok()) continue;
            if (s.error().code() != ErrorCode::resource_exhausted) return;  // the peer is gone
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
        }).detach();
      };
    }
    if (auto s = ut->start(std::move(events)); !s) {
      spdlog::error("{}", s.error().what());
      return 1;
    }
    for (auto& a : connect) {
      auto p = ut->connect(a, std::chrono::seconds(10));
      if (!p) {
        spdlog::error("connect {}: {}", a, p.error().what());
        return 1;
      }
    }
  }
  std::printf("READY tcp=%u ucx=%s\n", server.port(), ut ? ut->address().c_str() : "-");
  std::fflush(stdout);
  while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  spdlog::info("stopping");
  ut.reset();
  server.stop();
  return 0;
}
