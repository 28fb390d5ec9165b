// The batched engine: continuous batching of many sequences over the paged
// cache, one Model::forward call per step.
//
// Each step runs a decode token for every running sequence that has sampled
// one, prefill chunks of the others (oldest first) and admits waiting requests
// (longest cached prefix reused from the radix tree), within a token budget.
// When the device tier runs out, the engine tombstones checkpoint windows,
// spills or erases cached prefixes, moves cold pages of long sequences to the
// host tier, and then preempts the newest sequence (park with a host tier,
// recompute without); new requests wait (admission control) and stats() says
// why. A sequence that cannot fit alone finishes with an error.
//
// Threads: submit/abort/park/resume and stats/take_events are thread-safe and
// return at once; everything else happens on the engine thread: start() runs
// one, or the owner calls step() itself (never both). Events go to the
// callback given at construction (called on the engine thread; it must not
// block) or queue for take_events().
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <future>
#include <optional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cache/host/copy_engine.hpp"
#include "cache/host/page_mover.hpp"
#include "cache/planner.hpp"
#include "cache/pool/pool_set.hpp"
#include "cache/radix/shadow_radix.hpp"
#include "engine/json_schema.hpp"
#include "engine/request.hpp"
#include "model/decoder.hpp"
#include "model/forward.hpp"

namespace troupe::engine {

struct EngineOptions {
  uint64_t device_bytes = uint64_t{1} << 30;  // device tier budget (the pools' share of device memory)
  uint64_t host_bytes = 0;                    // host tier budget; 0: no host tier (no park, spill or cold pages)
  int64_t page_tokens = 0;                    // 0: CacheGeometry's default
  size_t slab_bytes = 0;                      // 0: PoolSet's default
  cache::PoolCounts initial_pages{};          // pages per pool taken up front (at least)
  // Where the pools start (cache/planner.hpp): sized for a mix of expected
  // contexts (prompt + output tokens, weight) or given fixed shares of
  // device_bytes per pool, the pages taken up front; neither: every pool starts
  // empty and grows as requests need it. Either way empty slabs move between
  // pools as demand shifts.
  std::vector<cache::ContextShare> pool_mix;
  std::optional<std::array<double, cache::kPoolKinds>> pool_ratios;
  double cache_share = 0;                     // with a mix: share kept for cached prefixes, [0, 1)
  int64_t step_tokens = 512;                  // tokens per forward call
  int32_t max_running = 256;                  // sequences admitted at once
  bool prefix_cache = true;
  int64_t checkpoint_every_pages = 0;         // extra prefill checkpoints (denser resume points, more window pages)
  int64_t decode_insert_every_pages = 16;     // insert a decoding sequence's prefix every N pages (0: at finish only)
  bool cold_pages = true;                     // with a readable host tier: old entry pages of long sequences move there
                                              // (only CSA entries where it is read over a bus: tiering.cpp's cold_pools)
  int64_t hot_pages = 2;                      // full token pages per sequence kept on the device when moving cold pages
  // Decode steps (every chunk one token) through model::Decoder: the key lists,
  // the indexer's picks and greedy samples made on the device, each batch size's
  // step recorded once as a CUDA graph and replayed. Sequences per such step:
  // -1 picks 64 on a backend with graphs and 0 (off: every step through
  // Model::forward) on others; a larger batch runs through Model::forward.
  int decode_batch = -1;
  int64_t decode_context = 0;                 // longest sequence the decoder's tables hold; 0: min(max positions, 131072)
  // What each token id writes (the tokenizer's), for SamplingParams' json schemas;
  // none: requests with a schema are refused.
  std::shared_ptr<const TokenVocabulary> vocabulary;
};

// The pools' budget for a fraction of memory: `fraction` (0, 1] of what the
// backend has free now (so after the weights) split evenly among `sharers`
// workers. Throws Error(invalid_argument) for a fraction out of range or a
// backend that cannot tell its free memory.
uint64_t pool_budget(const kernels::Backend& backend, double fraction, int sharers = 1);

// Pages per pool, by who holds them. A page with several holders counts for
// each; `leaked` are pages in use that no holder references.
struct PoolAudit {
  int64_t capacity = 0, in_use = 0, free = 0;
  int64_t leased = 0;     // running sequences
  int64_t parked = 0;     // parked sequences
  int64_t cached = 0;     // the radix tree
  int64_t in_flight = 0;  // copies between tiers
  int64_t leaked = 0;
};

// One request as the engine sees it, for policies (e.g. park the one with
// the largest projected state).
struct RequestStatus {
  RequestId id = 0;
  std::string phase;             // waiting, loading, running, parking, parked, resuming
  int64_t length = 0;            // tokens in the state
  int64_t tokens = 0;            // prompt + sampled
  int64_t max_tokens = 0;        // prompt + the most it may sample: the projected length
  int64_t device_bytes = 0;      // bytes of the pages it holds in each tier (shared pages count in full)
  int64_t host_bytes = 0;
};

struct EngineStats {
  int64_t steps = 0;
  int64_t forward_tokens = 0;       // tokens through the model
  int64_t prefill_tokens = 0, decode_tokens = 0;
  int64_t cached_tokens = 0;        // served by the radix tree
  int64_t recomputed_tokens = 0;
  int64_t submitted = 0, finished = 0, aborted = 0, errors = 0;
  int64_t parks = 0, resumes = 0, preemptions = 0;
  int64_t spilled_pages = 0, reloaded_pages = 0, cold_pages = 0, tombstoned_pages = 0, erased_nodes = 0;
  int64_t admission_waits = 0;      // steps in which a waiting request could not be admitted for memory
  int64_t decoder_steps = 0;        // steps run through model::Decoder (no host round trip inside)
  int64_t graph_replays = 0;        // of those, replayed from a recorded graph
  int64_t waiting = 0, running = 0, parked = 0;  // waiting: for admission, or parked and wanting to resume
  int64_t tree_nodes = 0, tree_pages = 0;
  uint64_t copied_bytes = 0;
  std::string waiting_reason;       // why the head of the queue waits (empty when nothing waits on memory)
  uint64_t device_budget_bytes = 0, device_free_bytes = 0;  // free: pages not in use, plus slabs no pool holds
  uint64_t host_budget_bytes = 0, host_free_bytes = 0;
  std::vector<RequestStatus> requests;  // refreshed with the audit (every 32 steps, and when idle)
  // Per pool; the holder columns (leased, parked, cached, in_flight, leaked)
  // are refreshed every 32 steps and whenever the engine is idle.
  std::array<PoolAudit, cache::kPoolKinds> device{}, host{};
};

// A request's whole state, detached from any engine: what PD handoff and
// migration move to another engine with the same model and page size. Pages
// are the raw bytes of the pool pages (cache/layout.hpp) a sequence holds.
struct SequenceImage {
  struct Page {
    int64_t index = 0;  // token page; -1 for the HCA ring
    cache::PoolKind kind = cache::PoolKind::window;
    std::vector<std::byte> bytes;
  };
  Request request;
  std::vector<int32_t> tokens;  // prompt and sampled tokens; the last one is not in the state yet
  int64_t length = 0;           // tokens in the state
  int32_t generated = 0;
  uint64_t seed = 0;
  Usage usage;
  int64_t page_tokens = 0;
  std::vector<Page> pages;
  uint64_t bytes() const;
};

class Engine {
 public:
  Engine(model::Model& model, EngineOptions options, std::function<void(const Event&)> on_event = nullptr);
  ~Engine();  // stops the thread; every request ends (no events) and every page is released
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // ---- any thread -------------------------------------------------------------------
  // Queues a request; a bad one finishes with an error event. Never blocks.
  RequestId submit(Request request);
  // The request finishes with `abort` and its pages are released. Unknown ids are ignored.
  void abort(RequestId id);
  // Moves all of a running request's state to the host tier and frees its
  // device pages (event `parked`); resume() brings it back (event `resumed`)
  // when the device tier has room. Tokens are identical to an unparked run.
  void park(RequestId id);
  void resume(RequestId id);
  // PD handoff: copies a parked request's state out; the request stays parked
  // until abort() (after the receiver confirms). Fulfilled on the engine
  // thread's next step; empty when the id is not parked.
  std::future<std::optional<SequenceImage>> export_parked(RequestId id);
  // Continues a request from another engine's export under a new id (events
  // as for submit; a bad image finishes with an error event).
  RequestId import(SequenceImage image);
  EngineStats stats() const;  // as of the end of the last step
  std::vector<Event> take_events();

  void start();  // runs steps on an engine thread until stop()
  void stop();

  // ---- the engine thread (or the owner, without start()) -----------------------------
  // One step: commands, finished copies, one forward call. False when there was nothing to do.
  bool step();
  // Steps until every request has finished or is parked.
  void run_until_idle();
  bool idle() const;
  // Drops every cached prefix nothing uses (for tests and memory pressure).
  void clear_cache();
  // Tombstones up to `max_pages` checkpoint windows inside unused cached
  // prefixes, as memory pressure does first; returns how many were freed.
  int64_t tombstone_windows(int64_t max_pages);
  // Who holds which pages, checked against the pools' reference counts.
  std::array<PoolAudit, cache::kPoolKinds> audit(cache::Tier tier) const;

  const cache::CacheGeometry& geometry() const { return geometry_; }
  model::Model& model() const { return model_; }

 private:
  struct Seq;
  struct Command;
  struct Batch;

  // engine.cpp
  void send(Command c);
  void drain_inbox();
  void emit(Event e);
  void publish_stats();
  void finish(Seq& s, FinishReason reason, ErrorCode code = ErrorCode::internal, std::string message = {});
  void admit_request(RequestId id, Request r);
  std::optional<SequenceImage> export_image(RequestId id);
  void import_image(RequestId id, SequenceImage image);
  // schedule.cpp
  bool try_admit(Seq& s, int64_t budget, Batch& batch);
  int64_t fit_chunk(Seq& s, int64_t n);
  void run_batch(Batch& batch);
  bool run_decode(Batch& batch);  // false: not a batch for the decoder (the caller runs Model::forward)
  void after_chunk(Seq& s, int64_t n, const float* rows, int64_t row_count, const int32_t* sampled = nullptr);
  void insert_prefix(Seq& s);
  // SamplingParams' json schemas: brings s.matcher up to the answer (nullopt: no schema
  // holds it yet; false: a token breaks it; throws what compiling it throws); whether the
  // value is whole; the tokens that may come next in `allowed` (left empty while no schema
  // holds the answer) and nullopt, or why none may: empty to finish with `stop`, else an error.
  std::optional<bool> sync_matcher(Seq& s);
  bool schema_whole(Seq& s);
  std::optional<std::string> schema_mask(Seq& s, TokenMask& allowed);
  bool handle_stall();
  void preempt(Seq& s);
  // Puts `s` in the waiting queue, by priority (larger first): at the end of its
  // priority's run when it is new, at its start when it waited or ran before.
  void enqueue(Seq& s, bool again);
  // tiering.cpp
  bool make_room(const cache::PoolCounts& need);
  bool evict_one();
  bool move_cold_pages(int64_t want, bool wait);
  void keep_headroom();
  void start_park(Seq& s);
  bool start_resume(Seq& s);
  bool start_reload(Seq& s);
  void unlock(Seq& s);
  Seq* find(RequestId id);

  model::Model& model_;
  EngineOptions options_;
  std::function<void(const Event&)> on_event_;
  cache::CacheGeometry geometry_;
  std::unique_ptr<cache::PoolSet> device_, host_;
  std::unique_ptr<cache::Tiers> tiers_;
  std::unique_ptr<cache::CopyEngine> copies_;
  std::unique_ptr<cache::PageMover> mover_;
  std::unique_ptr<cache::ShadowRadix> tree_;
  std::unique_ptr<model::Decoder> decoder_;  // null: decode steps through Model::forward
  uint64_t moves_ = 0;                       // page moves between tiers (row pointers changed)

  std::map<RequestId, std::unique_ptr<Seq>> seqs_;
  GrammarCache grammars_;  // SamplingParams::json_schema, compiled
  std::vector<RequestId> waiting_;  // by priority (larger first), then arrival
  uint64_t admit_counter_ = 0;
  EngineStats counters_;

  // Shared with other threads.
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::vector<Command> inbox_;
  std::vector<Event> outbox_;
  EngineStats published_;
  std::atomic<RequestId> next_id_{1};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace troupe::engine
