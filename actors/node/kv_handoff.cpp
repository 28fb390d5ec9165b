#include "actors/node/kv_handoff.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>

namespace troupe::actors::node {

using cache::PoolKind;
using Clock = std::chrono::steady_clock;

msg::StateKind state_kind(PoolKind kind) {
  switch (kind) {
    case PoolKind::window: return msg::StateKind::SWA_WINDOW;
    case PoolKind::csa_entry: return msg::StateKind::COMPRESSED_ENTRIES;
    case PoolKind::csa_index: return msg::StateKind::INDEXER_KEYS;
    case PoolKind::hca_entry: return msg::StateKind::COMPRESSED_ENTRIES;
    case PoolKind::hca_ring: return msg::StateKind::HCA_INFLIGHT;
  }
  return msg::StateKind::SWA_WINDOW;
}

struct KvHandoff::Lease {
  std::string taker;
  transport::LocalRegion region;
  Clock::time_point expires;
  uint64_t bytes = 0;
};

KvHandoff::KvHandoff(transport::Transport& transport, KvHandoffOptions options)
    : transport_(transport), options_(std::move(options)) {}

KvHandoff::~KvHandoff() {
  std::vector<uint64_t> ids;
  {
    std::lock_guard lock(mu_);
    if (abandoned_) return;
    for (auto& [id, l] : leases_) ids.push_back(l->region.key.region_id);
    for (auto& r : free_regions_) ids.push_back(r.key.region_id);
    leases_.clear();
    free_regions_.clear();
  }
  for (uint64_t id : ids) (void)transport_.deregister_region(id);
}

Expected<transport::LocalRegion> KvHandoff::take_region(size_t bytes) {
  {
    std::lock_guard lock(mu_);
    // The smallest pooled region that fits and wastes at most half of itself.
    auto best = free_regions_.end();
    for (auto it = free_regions_.begin(); it != free_regions_.end(); ++it) {
      if (it->length >= bytes && it->length <= 2 * bytes && (best == free_regions_.end() || it->length < best->length)) {
        best = it;
      }
    }
    if (best != free_regions_.end()) {
      auto r = *best;
      free_regions_.erase(best);
      return r;
    }
  }
  // Not under the lock: allocation waits for the transport thread, which may be in on_confirm.
  constexpr size_t kGrain = 64u << 10;
  return transport_.allocate_region((bytes + kGrain - 1) / kGrain * kGrain);
}

Expected<uint64_t> KvHandoff::lend(const std::string& taker, const engine::SequenceImage& image,
                                   std::chrono::milliseconds ttl, msg::KvOffer::Builder offer) {
  const uint64_t total = image.bytes();
  transport::LocalRegion region;
  if (total > 0) {
    auto r = take_region(total);
    if (!r) return r.error();
    region = *r;
  }
  // Runs of pages of one pool with consecutive token pages become one descriptor.
  struct Run {
    PoolKind kind;
    int64_t first_index;
    uint64_t offset;
    uint64_t page_bytes;
    uint32_t pages;
  };
  std::vector<Run> runs;
  uint64_t offset = 0;
  for (const auto& p : image.pages) {
    std::memcpy(region.base + offset, p.bytes.data(), p.bytes.size());
    Run* last = runs.empty() ? nullptr : &runs.back();
    if (last && last->kind == p.kind && last->page_bytes == p.bytes.size() && p.index >= 0 &&
        last->first_index + last->pages == p.index) {
      ++last->pages;
    } else {
      runs.push_back({p.kind, p.index, offset, p.bytes.size(), 1});
    }
    offset += p.bytes.size();
  }
  const auto now = Clock::now();
  uint64_t id;
  {
    std::lock_guard lock(mu_);
    id = next_lease_++;
    auto l = std::make_unique<Lease>();
    l->taker = taker;
    l->region = region;
    l->expires = now + ttl;
    l->bytes = total;
    leases_[id] = std::move(l);
    ++stats_.leases;
  }

  const int64_t P = image.page_tokens;
  offer.setLeaseId(id);
  offer.setModel(options_.model);
  offer.setTokenCount(static_cast<uint64_t>(std::max<int64_t>(image.length, 0)));
  if (!image.tokens.empty()) {
    offer.setNextTokenId(static_cast<uint32_t>(image.tokens.back()));
    offer.setHasNextToken(true);
  }
  const auto wall = std::chrono::system_clock::now() + ttl;
  offer.setExpiresUnixNanos(
      static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(wall.time_since_epoch()).count()));
  offer.setTotalBytes(total);
  auto ds = offer.initDescriptors(static_cast<unsigned>(runs.size()));
  for (size_t i = 0; i < runs.size(); ++i) {
    const Run& r = runs[i];
    auto d = ds[static_cast<unsigned>(i)];
    d.setKind(state_kind(r.kind));
    d.setLayer(kAllLayers);
    int64_t rate = 0;
    if (r.kind == PoolKind::csa_entry || r.kind == PoolKind::csa_index) rate = options_.csa_rate;
    if (r.kind == PoolKind::hca_entry || r.kind == PoolKind::hca_ring) rate = options_.hca_rate;
    d.setCompressRate(static_cast<uint32_t>(rate));
    auto pages = d.initPages(r.pages);
    for (uint32_t k = 0; k < r.pages; ++k) pages.set(k, k);
    auto shape = d.initPageShape(1);
    shape.set(0, static_cast<uint32_t>(r.page_bytes / sizeof(float)));  // f32 rows of every layer, padded
    d.setDtype(msg::Dtype::F32);
    d.setPageBytes(r.page_bytes);
    d.setPageStride(r.page_bytes);
    d.setRegionOffset(r.offset);
    // Logical rows: positions for the window pool, entry indices for the entry
    // pools, ring slots for the HCA ring.
    const int64_t rows_per_page = r.kind == PoolKind::window ? P : (rate > 0 && r.kind != PoolKind::hca_ring ? P / rate : 0);
    if (r.kind == PoolKind::hca_ring) {
      d.setFirstIndex(0);
      d.setCount(static_cast<uint64_t>(rate > 0 ? image.length % rate : 0));
      d.setRingSlots(static_cast<uint32_t>(rate));
    } else {
      const int64_t first = r.first_index * rows_per_page;
      const int64_t valid = r.kind == PoolKind::window ? image.length : (rate > 0 ? image.length / rate : 0);
      d.setFirstIndex(static_cast<uint64_t>(first));
      d.setCount(static_cast<uint64_t>(std::clamp<int64_t>(valid - first, 0, rows_per_page * r.pages)));
    }
    d.setLocation(msg::Location::HOST);
    transport::to_wire(region.key, d.initRegion());
  }
  return id;
}

void KvHandoff::end_lease(uint64_t lease, bool confirmed) {
  std::vector<uint64_t> retire;
  {
    std::lock_guard lock(mu_);
    auto it = leases_.find(lease);
    if (it == leases_.end()) return;
    const transport::LocalRegion region = it->second->region;
    if (confirmed) stats_.bytes_lent += it->second->bytes;
    leases_.erase(it);
    --stats_.leases;
    if (abandoned_ || region.length == 0) return;
    // Only a region the taker is done with goes back to the pool: after an
    // expiry or a lost taker a late get must not read the next lease's pages.
    if (!confirmed) {
      retire.push_back(region.key.region_id);
    } else {
      // The newest stays; past pooled_regions the ones returned longest ago
      // go (a pool full of other sizes would otherwise make every lease of a
      // new size allocate, register and map a fresh region).
      free_regions_.push_back(region);
      while (free_regions_.size() > options_.pooled_regions) {
        retire.push_back(free_regions_.front().key.region_id);
        free_regions_.erase(free_regions_.begin());
      }
    }
  }
  for (uint64_t id : retire) (void)transport_.deregister_region(id);
}

void KvHandoff::on_confirm(const std::string& peer, uint64_t lease) {
  {
    std::lock_guard lock(mu_);
    auto it = leases_.find(lease);
    if (it == leases_.end() || it->second->taker != peer) return;
  }
  end_lease(lease, true);
  messages::FrameBuilder<msg::KvRelease> b;
  b.root().setLeaseId(lease);
  b.root().setReason(msg::ReleaseReason::CONFIRMED);
  (void)transport_.send(peer, b.finish(lease));
}

void KvHandoff::on_release(const std::string& peer, uint64_t lease) {
  {
    std::lock_guard lock(mu_);
    auto it = leases_.find(lease);
    if (it == leases_.end() || it->second->taker != peer) return;
  }
  // The taker's gets have finished (it releases after its completion): reusable.
  end_lease(lease, true);
}

size_t KvHandoff::expire(Clock::time_point now) {
  std::vector<uint64_t> gone;
  {
    std::lock_guard lock(mu_);
    for (auto& [id, l] : leases_) {
      if (l->expires <= now) gone.push_back(id);
    }
    stats_.expired_leases += gone.size();
  }
  for (uint64_t id : gone) {
    spdlog::warn("kv handoff: lease {} expired before its taker confirmed; releasing its pages", id);
    end_lease(id, false);
  }
  return gone.size();
}

std::vector<uint64_t> KvHandoff::on_peer_down(const std::string& peer) {
  std::vector<uint64_t> gone;
  {
    std::lock_guard lock(mu_);
    for (auto& [id, l] : leases_) {
      if (l->taker == peer) gone.push_back(id);
    }
  }
  for (uint64_t id : gone) end_lease(id, false);
  return gone;
}

void KvHandoff::pull(const std::string& owner, msg::KvOffer::Reader offer, engine::SequenceImage image, Pulled done) {
  const uint64_t lease = offer.getLeaseId();
  auto release = [&](const Error& why) {
    messages::FrameBuilder<msg::KvRelease> b;
    b.root().setLeaseId(lease);
    b.root().setReason(msg::ReleaseReason::FAILED);
    b.root().setMessage(why.what());
    (void)transport_.send(owner, b.finish(lease));
    {
      std::lock_guard lock(mu_);
      ++stats_.failed_pulls;
    }
    done(why);
  };
  if (!options_.model.empty() && offer.getModel().size() > 0 && options_.model != offer.getModel().cStr()) {
    return release(Error(ErrorCode::invalid_argument, fmt::format("the offer is for model '{}', this process serves '{}'",
                                                                  offer.getModel().cStr(), options_.model)));
  }
  if (offer.getTotalBytes() > options_.max_image_bytes) {
    return release(Error(ErrorCode::resource_exhausted,
                         fmt::format("the offer has {} bytes, more than the limit of {}", offer.getTotalBytes(),
                                     options_.max_image_bytes)));
  }
  const int64_t P = image.page_tokens;
  if (P <= 0) return release(Error(ErrorCode::invalid_argument, "the image has no page size"));
  // Pages first (their buffers must not move), then one get per page.
  struct Where {
    transport::RegionKey key;
    uint64_t offset;
  };
  std::vector<Where> where;
  uint64_t total = 0;
  image.pages.clear();
  for (auto d : offer.getDescriptors()) {
    PoolKind kind;
    const uint32_t rate = d.getCompressRate();
    switch (d.getKind()) {
      case msg::StateKind::SWA_WINDOW: kind = PoolKind::window; break;
      case msg::StateKind::INDEXER_KEYS: kind = PoolKind::csa_index; break;
      case msg::StateKind::HCA_INFLIGHT: kind = PoolKind::hca_ring; break;
      case msg::StateKind::COMPRESSED_ENTRIES:
        kind = static_cast<int64_t>(rate) == options_.csa_rate ? PoolKind::csa_entry : PoolKind::hca_entry;
        break;
      default:
        return release(Error(ErrorCode::unsupported, "the offer has a kind of state this engine does not keep"));
    }
    const uint64_t page_bytes = d.getPageBytes();
    if (page_bytes == 0 || page_bytes > (uint64_t{1} << 32) || d.getPageStride() < page_bytes) {
      return release(Error(ErrorCode::invalid_argument, "the offer has a page of a bad size"));
    }
    if (d.getRegion().getOwner() != owner) {
      return release(Error(ErrorCode::invalid_argument, "the offer names a region of another process"));
    }
    const auto key = transport::from_wire(d.getRegion());
    int64_t first_page = -1;
    if (kind == PoolKind::window) {
      first_page = static_cast<int64_t>(d.getFirstIndex()) / P;
    } else if (kind != PoolKind::hca_ring) {
      if (rate == 0 || P % rate != 0) return release(Error(ErrorCode::invalid_argument, "the offer has a bad compress rate"));
      first_page = static_cast<int64_t>(d.getFirstIndex()) / (P / rate);
    }
    auto pages = d.getPages();
    for (uint32_t k = 0; k < pages.size(); ++k) {
      engine::SequenceImage::Page p;
      p.kind = kind;
      p.index = kind == PoolKind::hca_ring ? -1 : first_page + k;
      total += page_bytes;
      if (total > options_.max_image_bytes) {
        return release(Error(ErrorCode::resource_exhausted, "the offer's pages exceed the image limit"));
      }
      p.bytes.resize(page_bytes);
      image.pages.push_back(std::move(p));
      where.push_back({key, d.getRegionOffset() + static_cast<uint64_t>(pages[k]) * d.getPageStride()});
    }
  }

  struct PullState {
    engine::SequenceImage image;
    Pulled done;
    size_t remaining = 0;
    transport::Status status = messages::Ok{};
    uint64_t bytes = 0;
    Clock::time_point issued;
  };
  auto st = std::make_shared<PullState>();
  st->image = std::move(image);
  st->done = std::move(done);
  st->bytes = total;
  // One batch of gets per region (every offer of ours uses one).
  std::map<uint64_t, std::pair<transport::RegionKey, std::vector<transport::RmaOp>>> batches;
  for (size_t i = 0; i < where.size(); ++i) {
    auto& b = batches[where[i].key.region_id];
    b.first = where[i].key;
    auto& page = st->image.pages[i].bytes;
    b.second.push_back({page.data(), where[i].offset, page.size()});
  }
  {
    messages::FrameBuilder<msg::KvPull> b;
    b.root().setLeaseId(lease);
    b.root().setMode(msg::PullMode::GET);
    (void)transport_.send(owner, b.finish(lease));
  }
  {
    std::lock_guard lock(mu_);
    ++stats_.pulls;
  }
  auto finish = [this, st, owner, lease] {
    {
      std::lock_guard lock(mu_);
      --stats_.pulls;
      if (st->status) stats_.bytes_pulled += st->bytes;
      else ++stats_.failed_pulls;
      stats_.rma_seconds += std::chrono::duration<double>(Clock::now() - st->issued).count();
    }
    if (st->status) {
      messages::FrameBuilder<msg::KvConfirm> b;
      b.root().setLeaseId(lease);
      b.root().setBytes(st->bytes);
      (void)transport_.send(owner, b.finish(lease));
      st->done(std::move(st->image));
    } else {
      messages::FrameBuilder<msg::KvRelease> b;
      b.root().setLeaseId(lease);
      b.root().setReason(msg::ReleaseReason::FAILED);
      b.root().setMessage(st->status.error().what());
      (void)transport_.send(owner, b.finish(lease));
      st->done(st->status.error());
    }
  };
  st->issued = Clock::now();
  if (batches.empty()) return finish();
  st->remaining = batches.size();
  for (auto& [id, b] : batches) {
    transport_.get(owner, b.first, std::move(b.second), [st, finish](transport::Status s) {
      if (!s && st->status) st->status = s.error();
      if (--st->remaining == 0) finish();
    });
  }
}

void KvHandoff::abandon() {
  std::lock_guard lock(mu_);
  abandoned_ = true;
  leases_.clear();
  free_regions_.clear();
  stats_.leases = 0;
}

KvHandoffStats KvHandoff::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

}  // namespace troupe::actors::node
