// UcxTransport: registered regions and one-sided puts/gets with packed rkeys.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>

#include "transport/ucx_impl.hpp"

namespace troupe::transport {
namespace {

void rma_cb(void* request, ucs_status_t st, void* user) {
  static_cast<Batch*>(user)->op_done(st);
  ucp_request_free(request);
}

}  // namespace

void Batch::op_done(ucs_status_t st) {
  if (st != UCS_OK && status) status = Error(ErrorCode::unavailable, fmt::format("put/get failed: {}", ucs_status_string(st)));
  --outstanding;
  maybe_finish();
}

void Batch::maybe_finish() {
  if (!issued || outstanding > 0) return;
  if (conn_id) impl->release_rkey(conn_id, region_id);
  // The user's completion runs outside UCX callbacks, like every event.
  impl->user_calls.push_back([impl = impl, d = std::move(done), s = std::move(status)]() mutable {
    --impl->rma_in_flight;
    d(std::move(s));
  });
  delete this;
}

Expected<LocalUcxRegion> UcxTransport::Impl::map_memory(void* base, size_t length, bool allocate) {
  if (length == 0) return Error(ErrorCode::invalid_argument, "cannot register an empty region");
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  mp.address = allocate ? nullptr : base;
  mp.length = length;
  mp.flags = allocate ? UCP_MEM_MAP_ALLOCATE : 0;
  ucp_mem_h memh = nullptr;
  if (auto st = ucp_mem_map(ctx, &mp, &memh); st != UCS_OK) {
    return Error(ErrorCode::resource_exhausted, fmt::format("cannot register {} bytes: {}", length, ucs_status_string(st)));
  }
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  if (auto st = ucp_mem_query(memh, &attr); st != UCS_OK) {
    ucp_mem_unmap(ctx, memh);
    return Error(ErrorCode::internal, fmt::format("ucp_mem_query: {}", ucs_status_string(st)));
  }
  void* packed = nullptr;
  size_t packed_len = 0;
  if (auto st = ucp_rkey_pack(ctx, memh, &packed, &packed_len); st != UCS_OK) {
    ucp_mem_unmap(ctx, memh);
    return Error(ErrorCode::internal, fmt::format("ucp_rkey_pack: {}", ucs_status_string(st)));
  }
  LocalUcxRegion r;
  r.memh = memh;
  r.base = static_cast<std::byte*>(allocate ? attr.address : base);
  r.length = length;
  r.allocated = allocate;
  r.key.owner = opt.name;
  r.key.address = reinterpret_cast<uint64_t>(r.base);
  r.key.length = length;
  r.key.packed_key.assign(static_cast<uint8_t*>(packed), static_cast<uint8_t*>(packed) + packed_len);
  ucp_rkey_buffer_release(packed);
  return r;
}

Expected<LocalRegion> UcxTransport::Impl::map_region(void* base, size_t length, bool allocate) {
  auto m = map_memory(base, length, allocate);
  if (!m) return m.error();
  LocalUcxRegion& r = *m;
  r.key.region_id = next_region++;
  if (allocate) std::memset(r.base, 0, length);
  LocalRegion out{r.key, r.base, r.length};
  regions[r.key.region_id] = std::move(r);
  ++n_regions;
  return out;
}

Status UcxTransport::Impl::unmap_region(uint64_t region_id) {
  auto it = regions.find(region_id);
  if (it == regions.end()) return Error(ErrorCode::not_found, fmt::format("no region {}", region_id));
  ucp_mem_unmap(ctx, it->second.memh);  // frees it too when UCX allocated it
  regions.erase(it);
  --n_regions;
  return Ok{};
}

Expected<Conn::RemoteKey*> UcxTransport::Impl::rkey_for(Conn& c, const RegionKey& remote) {
  if (auto it = c.rkeys.find(remote.region_id); it != c.rkeys.end()) {
    if (it->second.forgotten) {
      return Error(ErrorCode::unavailable,
                   fmt::format("region {} of {} was forgotten and is still in use", remote.region_id, c.name));
    }
    it->second.last_use = ++rkey_clock;
    return &it->second;
  }
  if (remote.packed_key.size() < 8) {
    return Error(ErrorCode::invalid_argument, fmt::format("region {} of {} has no usable key", remote.region_id, c.name));
  }
  ucp_rkey_h rkey = nullptr;
  if (auto st = ucp_ep_rkey_unpack(c.tx(), remote.packed_key.data(), &rkey); st != UCS_OK) {
    return Error(ErrorCode::invalid_argument,
                 fmt::format("cannot unpack the key of region {} of {}: {}", remote.region_id, c.name, ucs_status_string(st)));
  }
  // Room for it: the least recently used idle key goes.
  while (c.rkeys.size() >= std::max<size_t>(opt.max_remote_keys, 1)) {
    auto victim = c.rkeys.end();
    for (auto it = c.rkeys.begin(); it != c.rkeys.end(); ++it) {
      if (it->second.busy == 0 && (victim == c.rkeys.end() || it->second.last_use < victim->second.last_use)) victim = it;
    }
    if (victim == c.rkeys.end()) break;  // all busy: go over for now
    ucp_rkey_destroy(victim->second.rkey);
    c.rkeys.erase(victim);
    --n_remote_keys;
  }
  ++n_remote_keys;
  return &(c.rkeys[remote.region_id] = {rkey, ++rkey_clock, 0, false});
}

void UcxTransport::Impl::release_rkey(uint64_t conn_id, uint64_t region_id) {
  Conn* c = conn_by_id(conn_id);
  if (!c) return;
  auto it = c->rkeys.find(region_id);
  if (it == c->rkeys.end()) return;
  if (--it->second.busy == 0 && it->second.forgotten) {
    ucp_rkey_destroy(it->second.rkey);
    c->rkeys.erase(it);
    --n_remote_keys;
  }
}

void UcxTransport::Impl::drop_rkeys(Conn& c) {
  for (auto& [id, k] : c.rkeys) ucp_rkey_destroy(k.rkey);
  n_remote_keys -= c.rkeys.size();
  c.rkeys.clear();
}

void UcxTransport::Impl::start_rma(bool is_put, const std::string& peer, const RegionKey& remote, std::vector<RmaOp> ops,
                                   Completion done) {
  auto* b = new Batch{this, std::move(done)};
  ++rma_in_flight;
  auto fail = [&](Error e) {
    b->status = std::move(e);
    b->issued = true;
    b->maybe_finish();
  };
  Conn* c = conn_by_name(peer);
  if (!c || c->state != Conn::State::up) return fail(Error(ErrorCode::unavailable, fmt::format("{} is not connected", peer)));
  if (remote.owner != peer) {
    return fail(Error(ErrorCode::invalid_argument, fmt::format("region {} belongs to {}, not {}", remote.region_id,
                                                               remote.owner, peer)));
  }
  if (auto s = check_bounds(remote, ops); !s) return fail(s.error());
  auto key = rkey_for(*c, remote);
  if (!key) return fail(key.error());
  ucp_rkey_h rkey = (*key)->rkey;
  ++(*key)->busy;  // until the batch finishes (maybe_finish)
  b->conn_id = c->id;
  b->region_id = remote.region_id;
  const ucp_request_param_t p = send_param(rma_cb, b);
  auto track = [&](ucs_status_ptr_t req) {
    if (req == nullptr) return;
    if (UCS_PTR_IS_ERR(req)) {
      if (b->status) b->status = Error(ErrorCode::unavailable, fmt::format("put/get failed: {}", ucs_status_string(UCS_PTR_STATUS(req))));
      return;
    }
    ++b->outstanding;
  };
  for (const auto& op : ops) {
    if (op.length == 0) continue;
    uint64_t addr = remote.address + op.remote_offset;
    track(is_put ? ucp_put_nbx(c->tx(), op.local, op.length, addr, rkey, &p)
                 : ucp_get_nbx(c->tx(), op.local, op.length, addr, rkey, &p));
  }
  // Puts complete locally first; the flush makes them remotely visible.
  if (is_put) track(ucp_ep_flush_nbx(c->tx(), &p));
  b->issued = true;
  b->maybe_finish();
}

Expected<LocalRegion> UcxTransport::register_region(void* base, size_t length) {
  auto* impl = impl_.get();
  if (base == nullptr) return Error(ErrorCode::invalid_argument, "cannot register a null region");
  return impl->call<Expected<LocalRegion>>([=] { return impl->map_region(base, length, false); },
                                           Error(ErrorCode::unavailable, "transport is not running"));
}

Expected<LocalRegion> UcxTransport::allocate_region(size_t length) {
  auto* impl = impl_.get();
  return impl->call<Expected<LocalRegion>>([=] { return impl->map_region(nullptr, length, true); },
                                           Error(ErrorCode::unavailable, "transport is not running"));
}

Status UcxTransport::deregister_region(uint64_t region_id) {
  auto* impl = impl_.get();
  return impl->call<Status>([=] { return impl->unmap_region(region_id); },
                            Error(ErrorCode::unavailable, "transport is not running"));
}

void UcxTransport::put(const std::string& peer, const RegionKey& remote, std::vector<RmaOp> ops, Completion done) {
  auto* impl = impl_.get();
  auto d = std::make_shared<Completion>(std::move(done));
  if (!impl->post([impl, peer, remote, ops = std::move(ops), d]() mutable {
        impl->start_rma(true, peer, remote, std::move(ops), std::move(*d));
      })) {
    (*d)(Error(ErrorCode::unavailable, "transport is not running"));
  }
}

void UcxTransport::get(const std::string& peer, const RegionKey& remote, std::vector<RmaOp> ops, Completion done) {
  auto* impl = impl_.get();
  auto d = std::make_shared<Completion>(std::move(done));
  if (!impl->post([impl, peer, remote, ops = std::move(ops), d]() mutable {
        impl->start_rma(false, peer, remote, std::move(ops), std::move(*d));
      })) {
    (*d)(Error(ErrorCode::unavailable, "transport is not running"));
  }
}

void UcxTransport::forget_remote(const std::string& peer, uint64_t region_id) {
  auto* impl = impl_.get();
  impl->post([impl, peer, region_id] {
    Conn* c = impl->conn_by_name(peer);
    if (!c) return;
    if (auto it = c->rkeys.find(region_id); it != c->rkeys.end()) {
      if (it->second.busy > 0) {
        it->second.forgotten = true;  // release_rkey destroys it
        return;
      }
      ucp_rkey_destroy(it->second.rkey);
      c->rkeys.erase(it);
      --impl->n_remote_keys;
    }
  });
}

}  // namespace troupe::transport
