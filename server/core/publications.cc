#include "server/core/publications.h"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "google/protobuf/util/json_util.h"
#include "mrd/status.h"
#include "server/cache/registration_cache.h"
#include "server/common/log.h"
#include "server/core/entry_json.h"
#include "server/core/errors.h"
#include "server/core/flags.h"
#include "server/core/mooncake_layout.h"

namespace mrd::core {
namespace {

constexpr size_t kMaxNameLength = 128;

absl::Status DirectoryOff() {
  return MrdError(absl::StatusCode::kFailedPrecondition, "DIRECTORY_OFF",
                  "this mrd has no directory: start it with --etcd_endpoints "
                  "to publish and resolve names");
}

std::string EscapeTenant(absl::string_view tenant) {
  std::string out;
  out.reserve(tenant.size());
  for (char c : tenant) {
    if (c == '/') {
      out += "%2F";
    } else if (c == '%') {
      out += "%25";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

std::string PublishedKey(const DirectoryOptions& options,
                         absl::string_view tenant, absl::string_view name) {
  return absl::StrCat(options.root, "/v1/", options.cluster, "/tenants/",
                      EscapeTenant(tenant), "/names/", name);
}

std::string NodeKey(const DirectoryOptions& options) {
  return absl::StrCat(options.root, "/v1/", options.cluster, "/nodes/",
                      options.node);
}

absl::Status CheckPublishName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxNameLength) {
    return MrdError(absl::StatusCode::kInvalidArgument, "BAD_PUBLISH_NAME",
                    absl::StrCat("a published name has 1 to ", kMaxNameLength,
                                 " characters; this one has ", name.size()));
  }
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' &&
        c != '_' && c != '-' && c != ':') {
      return MrdError(
          absl::StatusCode::kInvalidArgument, "BAD_PUBLISH_NAME",
          absl::StrCat("a published name is made of A-Z, a-z, 0-9, '.', '_', "
                       "':' and '-'; '",
                       absl::CHexEscape(name), "' is not"));
    }
  }
  return absl::OkStatus();
}

void Publications::Configure(directory::Publisher* publisher,
                             DirectoryOptions options) {
  publisher_ = publisher;
  options_ = std::move(options);
  // Reads and watches go through a client of their own (see reader_);
  // Create only checks the endpoints, which the publisher's passed.
  absl::StatusOr<std::unique_ptr<directory::EtcdClient>> reader =
      directory::EtcdClient::Create(publisher->client().options());
  if (reader.ok()) {
    reader_ = std::move(*reader);
  } else {
    LogError("directory: the client of reads: ", reader.status().ToString());
  }
  // The node entry: which mrd serves this node now, its devices and epoch.
  v1::DirectoryNode node;
  node.set_cluster(options_.cluster);
  node.set_node(options_.node);
  node.set_epoch(options_.epoch);
  for (const device::Device* d : devices_) {
    const device::DeviceAttributes& a = d->Attributes();
    v1::DeviceInfo* device = node.add_devices();
    device->set_name(a.name);
    device->set_kind(a.kind);
    device->set_page_size(a.page_size);
    device->set_max_mr_size(a.max_mr_size);
    device->set_max_page_list_length(a.max_page_list_length);
    device->set_adapter_flags(a.adapter_flags);
    device->set_peer_address(a.peer_address);
    device->set_gid(a.gid);
    device->set_lid(a.lid);
    device->set_numa_node(a.numa_node);
    device->set_pci_address(a.pci_address);
    device->set_link_layer(a.link_layer);
  }
  node.set_started_unix_ms(absl::ToUnixMillis(absl::Now()));
  std::string json;
  absl::Status written =
      google::protobuf::util::MessageToJsonString(node, &json).ok()
          ? publisher_->Publish(NodeKey(options_), std::move(json))
          : absl::InternalError("the node entry could not be written as JSON");
  if (!written.ok()) {
    LogError("directory: the node entry: ", written.ToString());
  }
}

std::string Publications::MooncakeKey(const std::string& name) const {
  if (options_.mooncake_prefix.empty()) return std::string();
  return MooncakeSegmentKey(options_.mooncake_prefix, name);
}

absl::Status Publications::PublishMooncake(const v1::PublishedEntry& entry) {
  if (options_.mooncake_prefix.empty()) return absl::OkStatus();
  std::vector<MooncakeDevice> devices;
  for (const device::Device* d : devices_) {
    const device::DeviceAttributes& a = d->Attributes();
    devices.push_back(MooncakeDevice{a.name, a.gid, a.lid});
  }
  return publisher_->Publish(MooncakeKey(entry.name()),
                             MooncakeSegmentJson(entry, devices, absl::Now()));
}

namespace {

// The entry of one etcd key-value, as a PUBLISHED event.
absl::StatusOr<v1::NameEvent> PublishedEvent(const std::string& key,
                                             const std::string& value) {
  v1::NameEvent event;
  event.set_kind(v1::NameEvent::PUBLISHED);
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  if (!google::protobuf::util::JsonStringToMessage(value, event.mutable_entry(),
                                                   options)
           .ok()) {
    return MrdError(
        absl::StatusCode::kDataLoss, "BAD_DIRECTORY_ENTRY",
        absl::StrCat("the entry under ", key, " is not an entry mrd can read"));
  }
  event.mutable_entry()->set_key(key);
  event.mutable_entry()->set_state("published");
  return event;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Publications::NameWatch>>
Publications::WatchName(const Session& session, const v1::ResolveRequest& req,
                        NameEventCallback on_event) {
  if (!enabled() || reader_ == nullptr) return DirectoryOff();
  MRD_RETURN_IF_ERROR(CheckPublishName(req.name()));
  const std::string& own = session.tenant()->name();
  const std::string tenant = req.tenant().empty() ? own : req.tenant();
  const std::string key = PublishedKey(options_, tenant, req.name());
  {
    absl::MutexLock lock(&mu_);
    const size_t share = std::max<size_t>(1, options_.max_watches / 4);
    size_t& mine = tenant_watches_[own];
    if (watches_ >= options_.max_watches || mine >= share) {
      if (mine == 0) tenant_watches_.erase(own);
      return MrdError(
          absl::StatusCode::kResourceExhausted, "WATCH_LIMIT",
          absl::StrCat("mrd holds ", watches_, " of its ", options_.max_watches,
                       " name watches, tenant ", own, " ", mine, " of its ",
                       share, "; cancel one (--directory_max_watches)"));
    }
    ++watches_;
    ++mine;
  }
  auto watch = std::make_unique<NameWatch>(this, own, reader_);
  // The state now, then every change after that read: nothing missed.
  absl::StatusOr<directory::EtcdRange> range = reader_->Get(key);
  if (!range.ok()) return range.status();  // ~NameWatch frees the slot
  v1::NameEvent first;
  first.set_kind(v1::NameEvent::UNPUBLISHED);
  for (const directory::EtcdKeyValue& kv : range->kvs) {
    if (kv.key != key) continue;
    absl::StatusOr<v1::NameEvent> published = PublishedEvent(key, kv.value);
    if (!published.ok()) return published.status();
    first = std::move(*published);
  }
  on_event(std::move(first));
  absl::StatusOr<std::unique_ptr<directory::EtcdWatch>> etcd_watch =
      reader_->Watch(
          key, range->revision + 1,
          [key, on_event = std::move(on_event)](
              absl::StatusOr<std::vector<directory::EtcdWatchEvent>>
                  events) mutable {
            if (!events.ok()) {
              on_event(events.status());
              return;
            }
            for (const directory::EtcdWatchEvent& e : *events) {
              if (e.key != key) continue;  // a longer name
              if (e.type == directory::EtcdWatchEvent::Type::kDelete) {
                v1::NameEvent gone;
                gone.set_kind(v1::NameEvent::UNPUBLISHED);
                on_event(std::move(gone));
              } else {
                on_event(PublishedEvent(key, e.value));
              }
            }
          });
  if (!etcd_watch.ok()) return etcd_watch.status();
  watch->watch_ = std::move(*etcd_watch);
  return watch;
}

void Publications::EndWatch(const std::string& tenant) {
  absl::MutexLock lock(&mu_);
  --watches_;
  auto it = tenant_watches_.find(tenant);
  if (it != tenant_watches_.end() && --it->second == 0) {
    tenant_watches_.erase(it);
  }
}

absl::Status Publications::Publish(Session& session,
                                   const v1::PublishRequest& req,
                                   v1::PublishedEntry* out) {
  if (!enabled()) return DirectoryOff();
  MRD_RETURN_IF_ERROR(CheckPublishName(req.name()));
  const std::string& tenant = session.tenant()->name();
  const std::string key = PublishedKey(options_, tenant, req.name());
  const std::string segment = MooncakeKey(req.name());
  // Under the session's lock from the check of the registration to the
  // queued write: a deregistration's Sync, which needs that lock, queues
  // the delete after it, never before.
  PublishedTarget target;
  if (req.target_case() == v1::PublishRequest::kMr) {
    target.mr = req.mr();
  } else {
    target.registration = req.registration();
  }
  absl::MutexLock lock(&session.mu);
  MRD_ASSIGN_OR_RETURN(v1::PublishedEntry entry,
                       EntryLocked(session, req.name(), &target));
  std::string json = PublishedEntryJson(entry);
  {
    absl::MutexLock names(&mu_);
    auto [it, inserted] = owners_.try_emplace(key, session.id());
    if (inserted) {
      // A Mooncake segment has no tenant in its key: another tenant's
      // session may hold this name's.
      if (auto held = segments_.find(segment);
          held != segments_.end() && held->second != session.id()) {
        owners_.erase(it);
        return MrdError(
            absl::StatusCode::kAlreadyExists, "SEGMENT_TAKEN",
            absl::StrCat("another tenant has published '", req.name(),
                         "' on this mrd as the Mooncake segment ", segment,
                         "; pick another name"));
      }
      // The tenant's share of --directory_max_entries.
      if (absl::Status s =
              session.tenant()->Reserve(TenantResource::kPublished, 1);
          !s.ok()) {
        owners_.erase(it);
        return s;
      }
      if (!segment.empty()) segments_[segment] = session.id();
    } else {
      auto mine = session.published.find(req.name());
      if (it->second == session.id() && mine != session.published.end() &&
          mine->second == target) {
        // The same publication again: nothing new.
        *out = std::move(entry);
        out->set_key(key);
        out->set_mooncake_key(segment);
        out->set_registration(target.registration);
        out->set_mr(target.mr);
        return absl::OkStatus();
      }
      return MrdError(
          absl::StatusCode::kAlreadyExists, "NAME_TAKEN",
          absl::StrCat("tenant ", tenant, " has published '", req.name(),
                       "' on this mrd already; unpublish it first"));
    }
  }
  absl::Status queued = publisher_->Publish(key, json);
  if (queued.ok()) {
    queued = PublishMooncake(entry);
    if (!queued.ok()) publisher_->Unpublish(key);
  }
  if (!queued.ok()) {
    absl::MutexLock names(&mu_);
    EraseOwnerLocked(key, *session.tenant());
    if (!segment.empty()) segments_.erase(segment);
    return queued;
  }
  session.published.Set(req.name(), target);
  *out = std::move(entry);
  out->set_key(key);
  out->set_mooncake_key(segment);
  out->set_registration(target.registration);
  out->set_mr(target.mr);
  out->set_state("pending");
  return absl::OkStatus();
}

absl::Status Publications::CheckPublishable(Session& session,
                                            const std::string& name) {
  if (!enabled()) return DirectoryOff();
  MRD_RETURN_IF_ERROR(CheckPublishName(name));
  const std::string& tenant = session.tenant()->name();
  const std::string key = PublishedKey(options_, tenant, name);
  const std::string segment = MooncakeKey(name);
  absl::MutexLock names(&mu_);
  auto it = owners_.find(key);
  if (it != owners_.end() && it->second != session.id()) {
    return MrdError(absl::StatusCode::kAlreadyExists, "NAME_TAKEN",
                    absl::StrCat("tenant ", tenant, " has published '", name,
                                 "' on this mrd already; unpublish it first"));
  }
  if (auto held = segments_.find(segment); !segment.empty() &&
                                           held != segments_.end() &&
                                           held->second != session.id()) {
    return MrdError(absl::StatusCode::kAlreadyExists, "SEGMENT_TAKEN",
                    absl::StrCat("another tenant has published '", name,
                                 "' on this mrd as the Mooncake segment ",
                                 segment, "; pick another name"));
  }
  return absl::OkStatus();
}

void Publications::AddTokens(const cache::EntryView& view,
                             v1::PublishedEntry* entry) const {
  for (const DeviceMr& mr : registrations_->MrsOf(view)) {
    const device::DeviceAttributes& a = devices_[mr.device]->Attributes();
    v1::PublishedToken* token = entry->add_tokens();
    token->set_device(a.name);
    token->set_rkey(mr.rkey);
    token->set_peer_address(a.peer_address);
  }
}

absl::StatusOr<v1::PublishedEntry> Publications::EntryLocked(
    const Session& session, const std::string& name,
    PublishedTarget* target) const {
  v1::PublishedEntry entry;
  if (target->registration != 0 || target->mr == 0) {
    auto r = session.registrations.find(target->registration);
    if (r == session.registrations.end()) {
      return UnknownHandle("registration", target->registration);
    }
    std::optional<cache::EntryView> view = registrations_->Describe(r->first);
    if (!view.has_value()) {
      return UnknownHandle("registration", target->registration);
    }
    entry.set_address(view->key.base_address);
    entry.set_length(view->key.length);
    entry.set_flags(r->second.flags);
    AddTokens(*view, &entry);
  } else {
    auto m = session.mrs.find(target->mr);
    if (m == session.mrs.end()) return UnknownHandle("mr", target->mr);
    const MrObject& mr = m->second;
    if (!mr.fast_register || !mr.fast_registered ||
        !mr.pending_invalidate_silent.empty() ||
        (target->rkey != 0 && mr.rkey != target->rkey)) {
      return MrdError(
          absl::StatusCode::kFailedPrecondition, "MR_NOT_MAPPED",
          absl::StrCat("MR ", target->mr,
                       !mr.fast_register
                           ? " is not a fast-register MR object: publish the "
                             "registration it holds"
                           : " is not fast-registered now (its FastRegister "
                             "has not completed, or an InvalidateMr ended "
                             "the mapping): there is no token to publish"));
    }
    target->rkey = mr.rkey;
    const device::DeviceAttributes& a = devices_[mr.device]->Attributes();
    entry.set_address(mr.base_address);
    entry.set_length(mr.length);
    entry.set_flags(FlagsFromAccess(mr.access));
    v1::PublishedToken* token = entry.add_tokens();
    token->set_device(a.name);
    token->set_rkey(mr.rkey);
    token->set_peer_address(a.peer_address);
  }
  entry.set_name(name);
  entry.set_tenant(session.tenant()->name());
  entry.set_cluster(options_.cluster);
  entry.set_node(options_.node);
  entry.set_epoch(options_.epoch);
  entry.set_published_unix_ms(absl::ToUnixMillis(absl::Now()));
  return entry;
}

bool Publications::LiveLocked(const Session& session,
                              const PublishedTarget& target) {
  if (target.registration != 0) {
    return session.registrations.contains(target.registration);
  }
  auto m = session.mrs.find(target.mr);
  return m != session.mrs.end() && m->second.fast_registered &&
         m->second.pending_invalidate_silent.empty() &&
         m->second.rkey == target.rkey;
}

void Publications::RepublishAll(
    const std::vector<std::shared_ptr<Session>>& sessions) {
  if (!enabled()) return;
  size_t written = 0;
  for (const std::shared_ptr<Session>& session : sessions) {
    std::vector<std::string> gone;
    {
      absl::MutexLock lock(&session->mu);
      for (const auto& [name, published] : session->published) {
        const std::string key =
            PublishedKey(options_, session->tenant()->name(), name);
        PublishedTarget target = published;
        absl::StatusOr<v1::PublishedEntry> entry =
            EntryLocked(*session, name, &target);
        if (entry.ok() &&
            publisher_->Publish(key, PublishedEntryJson(*entry)).ok() &&
            PublishMooncake(*entry).ok()) {
          absl::MutexLock names(&mu_);
          // Handed over: held already, whatever the quota says now.
          if (owners_.insert_or_assign(key, session->id()).second) {
            session->tenant()->Force(TenantResource::kPublished, 1);
          }
          if (const std::string segment = MooncakeKey(name); !segment.empty()) {
            segments_[segment] = session->id();
          }
          ++written;
          continue;
        }
        gone.push_back(name);
      }
      for (const std::string& name : gone) session->published.Erase(name);
    }
    if (!gone.empty()) Drop(*session, gone, /*wait=*/false);
  }
  LogInfo("directory: ", written, " published names written again, epoch ",
          options_.epoch);
}

absl::Status Publications::Unpublish(Session& session,
                                     const v1::UnpublishRequest& req,
                                     v1::UnpublishResponse* out) {
  if (!enabled()) return DirectoryOff();
  {
    absl::MutexLock lock(&session.mu);
    if (!session.published.contains(req.name())) {
      return MrdError(absl::StatusCode::kNotFound, "NOT_PUBLISHED",
                      absl::StrCat("this session has not published '",
                                   absl::CHexEscape(req.name()), "'"));
    }
    session.published.Erase(req.name());
  }
  const std::string key =
      PublishedKey(options_, session.tenant()->name(), req.name());
  const std::string segment = MooncakeKey(req.name());
  {
    absl::MutexLock names(&mu_);
    EraseOwnerLocked(key, *session.tenant());
    if (!segment.empty()) segments_.erase(segment);
  }
  std::vector<directory::Publisher::Done> done = {publisher_->Unpublish(key)};
  if (!segment.empty()) done.push_back(publisher_->Unpublish(segment));
  const bool reachable =
      publisher_->Stats().state == directory::DirectoryState::kServing;
  const absl::Time deadline = absl::Now() + options_.unpublish_wait;
  bool deleted = true;
  for (const directory::Publisher::Done& d : done) {
    deleted = deleted && (d->HasBeenNotified() ||
                          (reachable && d->WaitForNotificationWithTimeout(
                                            deadline - absl::Now())));
  }
  out->set_deleted(deleted);
  return absl::OkStatus();
}

absl::Status Publications::List(Session& session,
                                v1::ListPublishedResponse* out) {
  out->set_directory_state(StateName());
  if (!enabled()) return absl::OkStatus();
  const std::string& tenant = session.tenant()->name();
  absl::MutexLock lock(&session.mu);
  for (const auto& [name, target] : session.published) {
    v1::PublishedEntry* entry = out->add_entries();
    entry->set_name(name);
    entry->set_tenant(tenant);
    entry->set_cluster(options_.cluster);
    entry->set_node(options_.node);
    entry->set_epoch(options_.epoch);
    entry->set_registration(target.registration);
    entry->set_mr(target.mr);
    const std::string key = PublishedKey(options_, tenant, name);
    entry->set_key(key);
    // A name is published once all its keys are; in conflict if one is.
    directory::KeyState state = directory::KeyState::kPublished;
    std::vector<std::string> keys = {key};
    if (std::string segment = MooncakeKey(name); !segment.empty()) {
      entry->set_mooncake_key(segment);
      keys.push_back(std::move(segment));
    }
    for (const std::string& k : keys) {
      absl::StatusOr<directory::KeyState> s = publisher_->StateOf(k);
      if (s.ok() && *s == directory::KeyState::kConflict) {
        state = *s;
      } else if (state == directory::KeyState::kPublished &&
                 (!s.ok() || *s == directory::KeyState::kPending)) {
        state = directory::KeyState::kPending;
      }
    }
    entry->set_state(std::string(directory::KeyStateName(state)));
    PublishedTarget now = target;
    if (absl::StatusOr<v1::PublishedEntry> e = EntryLocked(session, name, &now);
        e.ok()) {
      entry->set_address(e->address());
      entry->set_length(e->length());
      entry->set_flags(e->flags());
      *entry->mutable_tokens() = e->tokens();
    }
  }
  return absl::OkStatus();
}

absl::Status Publications::Resolve(const Session& session,
                                   const v1::ResolveRequest& req,
                                   v1::PublishedEntry* out) {
  if (!enabled()) return DirectoryOff();
  MRD_RETURN_IF_ERROR(CheckPublishName(req.name()));
  const std::string tenant =
      req.tenant().empty() ? session.tenant()->name() : req.tenant();
  const std::string key = PublishedKey(options_, tenant, req.name());
  if (reader_ == nullptr) return DirectoryOff();
  MRD_ASSIGN_OR_RETURN(directory::EtcdRange range, reader_->Get(key));
  for (const directory::EtcdKeyValue& kv : range.kvs) {
    if (kv.key != key) continue;  // a longer name with this one as prefix
    google::protobuf::util::JsonParseOptions options;
    options.ignore_unknown_fields = true;
    if (!google::protobuf::util::JsonStringToMessage(kv.value, out, options)
             .ok()) {
      return MrdError(absl::StatusCode::kDataLoss, "BAD_DIRECTORY_ENTRY",
                      absl::StrCat("the entry under ", key,
                                   " is not an entry mrd can read"));
    }
    out->set_key(key);
    out->set_state("published");
    return absl::OkStatus();
  }
  return MrdError(
      absl::StatusCode::kNotFound, "NAME_NOT_PUBLISHED",
      absl::StrCat("tenant ", tenant, " has no name '", req.name(),
                   "' in cluster ", options_.cluster, " of the directory"));
}

void Publications::Sync(Session& session) {
  if (!enabled()) return;
  std::vector<std::string> gone;
  {
    absl::MutexLock lock(&session.mu);
    for (const auto& [name, target] : session.published) {
      if (!LiveLocked(session, target)) gone.push_back(name);
    }
    for (const std::string& name : gone) session.published.Erase(name);
  }
  if (!gone.empty()) Drop(session, gone, /*wait=*/true);
}

void Publications::Sync(Session& session,
                        absl::Span<const uint64_t> registrations) {
  if (!enabled()) return;
  std::vector<std::string> gone;
  {
    absl::MutexLock lock(&session.mu);
    if (session.published.empty()) return;
    for (uint64_t registration : registrations) {
      if (!session.registrations.contains(registration)) {
        session.published.TakeNamesOf(registration, &gone);
      }
    }
  }
  if (!gone.empty()) Drop(session, gone, /*wait=*/true);
}

void Publications::DropMr(Session& session, uint64_t mr) {
  if (!enabled()) return;
  std::vector<std::string> gone;
  {
    absl::MutexLock lock(&session.mu);
    session.published.TakeNamesOfMr(mr, &gone);
  }
  if (!gone.empty()) Drop(session, gone, /*wait=*/true);
}

void Publications::EraseOwnerLocked(const std::string& key, Tenant& tenant) {
  if (owners_.erase(key) > 0) tenant.Release(TenantResource::kPublished, 1);
}

void Publications::DropAll(Session& session, bool wait) {
  if (!enabled()) return;
  std::vector<std::string> gone;
  {
    absl::MutexLock lock(&session.mu);
    for (const auto& [name, target] : session.published) {
      gone.push_back(name);
    }
    session.published.clear();
  }
  if (!gone.empty()) Drop(session, gone, wait);
}

void Publications::Drop(const Session& session,
                        const std::vector<std::string>& names, bool wait) {
  std::vector<directory::Publisher::Done> done;
  done.reserve(names.size());
  for (const std::string& name : names) {
    const std::string key =
        PublishedKey(options_, session.tenant()->name(), name);
    const std::string segment = MooncakeKey(name);
    {
      absl::MutexLock lock(&mu_);
      EraseOwnerLocked(key, *session.tenant());
      if (!segment.empty()) segments_.erase(segment);
    }
    done.push_back(publisher_->Unpublish(key));
    if (!segment.empty()) done.push_back(publisher_->Unpublish(segment));
  }
  if (!wait || publisher_->State() != directory::DirectoryState::kServing) {
    return;
  }
  const absl::Time deadline = absl::Now() + options_.unpublish_wait;
  for (const directory::Publisher::Done& d : done) {
    if (!d->WaitForNotificationWithTimeout(deadline - absl::Now())) {
      LogWarning("directory: ", names.size(),
                 " entries not yet deleted on etcd after ",
                 absl::FormatDuration(options_.unpublish_wait),
                 "; the deletes stay queued");
      return;
    }
  }
}

std::optional<directory::PublisherStats> Publications::Stats() const {
  if (!enabled()) return std::nullopt;
  return publisher_->Stats();
}

std::string Publications::StateName() const {
  if (!enabled()) return "off";
  return std::string(directory::DirectoryStateName(publisher_->State()));
}

}  // namespace mrd::core
