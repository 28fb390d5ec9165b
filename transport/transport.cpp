#include "transport/transport.hpp"

#include <fmt/format.h>

#include <future>

namespace troupe::transport {

void to_wire(const RegionKey& key, msg::RemoteRegion::Builder out) {
  out.setOwner(key.owner);
  out.setRegionId(key.region_id);
  out.setAddress(key.address);
  out.setLength(key.length);
  out.setPackedKey(kj::arrayPtr(key.packed_key.data(), key.packed_key.size()));
}

RegionKey from_wire(msg::RemoteRegion::Reader in) {
  RegionKey k;
  k.owner = in.getOwner().cStr();
  k.region_id = in.getRegionId();
  k.address = in.getAddress();
  k.length = in.getLength();
  auto d = in.getPackedKey();
  k.packed_key.assign(d.begin(), d.end());
  return k;
}

Status check_bounds(const RegionKey& remote, const std::vector<RmaOp>& ops) {
  for (const auto& op : ops) {
    if (op.length == 0) continue;
    if (op.local == nullptr) return Error(ErrorCode::invalid_argument, "put/get with a null local buffer");
    if (op.remote_offset > remote.length || op.length > remote.length - op.remote_offset) {
      return Error(ErrorCode::invalid_argument,
                   fmt::format("put/get of {} bytes at offset {} is outside region {} of {} ({} bytes)", op.length,
                               op.remote_offset, remote.region_id, remote.owner, remote.length));
    }
  }
  return Ok{};
}

namespace {
Status wait_for(std::function<void(Completion)> start) {
  auto promise = std::make_shared<std::promise<Status>>();
  auto future = promise->get_future();
  start([promise](Status s) { promise->set_value(std::move(s)); });
  return future.get();
}
}  // namespace

Status put_wait(Transport& t, const std::string& peer, const RegionKey& remote, std::vector<RmaOp> ops) {
  return wait_for([&](Completion done) { t.put(peer, remote, std::move(ops), std::move(done)); });
}

Status get_wait(Transport& t, const std::string& peer, const RegionKey& remote, std::vector<RmaOp> ops) {
  return wait_for([&](Completion done) { t.get(peer, remote, std::move(ops), std::move(done)); });
}

}  // namespace troupe::transport
