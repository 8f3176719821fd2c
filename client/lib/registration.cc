#include "client/lib/registration.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "client/lib/session_core.h"
#include "mrd/status.h"
#include "mrd/status_proto.h"

namespace mrd::client {

v1::RegisterMrRequest ToRequest(const std::string& session,
                                const RegisterOptions& options) {
  v1::RegisterMrRequest request;
  request.set_session(session);
  request.set_buffer(options.buffer);
  request.set_offset(options.offset);
  request.set_length(options.length);
  request.set_flags(options.flags);
  request.set_mem_flags(options.mem_flags);
  if (options.base_address.has_value()) {
    request.set_base_address(*options.base_address);
  }
  request.set_mr(options.mr);
  request.set_descriptor_capacity(options.descriptor_capacity);
  request.set_request_id(options.request_id);
  if (options.all_devices) {
    request.mutable_devices()->set_all(true);
  } else if (options.nearest_devices) {
    request.mutable_devices()->set_nearest(true);
  } else {
    for (const std::string& device : options.devices) {
      request.mutable_devices()->add_names(device);
    }
  }
  return request;
}

Registration::Registration(std::shared_ptr<internal::SessionCore> core,
                           v1::RegisterMrResponse response, uint64_t mr_object)
    : core_(std::move(core)),
      response_(std::move(response)),
      mr_object_(mr_object) {}

absl::StatusOr<Registration> Registration::Register(
    const Session& session, const RegisterOptions& options) {
  if (session.core() == nullptr) {
    return absl::FailedPreconditionError("use of a moved-from Session");
  }
  MRD_ASSIGN_OR_RETURN(
      v1::RegisterMrResponse response,
      session.client().RegisterMr(ToRequest(session.token(), options)));
  return Registration(session.core(), std::move(response), options.mr);
}

void Registration::RegisterAsync(const Session& session,
                                 RegisterOptions options,
                                 RegistrationCallback done) {
  std::shared_ptr<internal::SessionCore> core = session.core();
  if (core == nullptr) {
    std::move(done)(
        absl::FailedPreconditionError("use of a moved-from Session"));
    return;
  }
  const uint64_t mr_object = options.mr;
  v1::RegisterMrRequest request = ToRequest(core->token, options);
  core->client.RegisterMrAsync(
      std::move(request),
      [core, mr_object, done = std::move(done)](
          absl::StatusOr<v1::RegisterMrResponse> response) mutable {
        if (!response.ok()) {
          std::move(done)(response.status());
          return;
        }
        std::move(done)(
            Registration(std::move(core), *std::move(response), mr_object));
      });
}

std::future<absl::StatusOr<Registration>> Registration::RegisterFuture(
    const Session& session, RegisterOptions options) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<Registration>>>();
  std::future<absl::StatusOr<Registration>> future = promise->get_future();
  RegisterAsync(session, std::move(options),
                [promise](absl::StatusOr<Registration> result) {
                  promise->set_value(std::move(result));
                });
  return future;
}

Registration Registration::Adopt(const Session& session,
                                 const v1::RegisterMrResponse& response,
                                 bool via_mr) {
  return Registration(session.core(), response, via_mr ? response.mr() : 0);
}

Registration::Registration(Registration&& other) noexcept
    : core_(std::move(other.core_)),
      response_(std::move(other.response_)),
      mr_object_(other.mr_object_) {
  other.response_.Clear();
}

Registration& Registration::operator=(Registration&& other) noexcept {
  if (this != &other) {
    if (valid()) {
      if (auto left = Deregister(); !left.ok()) {
        internal::LogReleaseError("registration", id(), left.status());
      }
    }
    core_ = std::move(other.core_);
    response_ = std::move(other.response_);
    other.response_.Clear();
    mr_object_ = other.mr_object_;
  }
  return *this;
}

Registration::~Registration() {
  if (!valid()) return;
  if (auto left = Deregister(); !left.ok()) {
    internal::LogReleaseError("registration", id(), left.status());
  }
}

absl::StatusOr<uint32_t> Registration::Deregister() {
  if (!valid()) {
    return absl::FailedPreconditionError("registration already deregistered");
  }
  std::shared_ptr<internal::SessionCore> core = std::move(core_);
  core_.reset();
  if (core->Ended()) return 0u;
  v1::DeregisterMrRequest request;
  request.set_session(core->token);
  if (mr_object_ != 0) {
    request.set_mr(mr_object_);
  } else {
    request.set_registration(response_.registration());
  }
  absl::StatusOr<v1::DeregisterMrResponse> response =
      core->client.DeregisterMr(request);
  if (!response.ok()) {
    if (internal::EndedElsewhere(*core, response.status())) return 0u;
    return response.status();
  }
  return response->references();
}

absl::StatusOr<std::vector<absl::StatusOr<Registration>>>
Registration::RegisterBatch(const Session& session,
                            const std::vector<RegisterOptions>& options) {
  if (session.core() == nullptr) {
    return absl::FailedPreconditionError("use of a moved-from Session");
  }
  v1::RegisterMrBatchRequest request;
  request.set_session(session.token());
  for (const RegisterOptions& o : options) {
    *request.add_items() = ToRequest(/*session=*/"", o);
  }
  MRD_ASSIGN_OR_RETURN(v1::RegisterMrBatchResponse response,
                       session.client().RegisterMrBatch(request));
  if (response.items_size() != static_cast<int>(options.size())) {
    return absl::InternalError(absl::StrCat("RegisterMrBatch answered ",
                                            response.items_size(),
                                            " items for ", options.size()));
  }
  std::vector<absl::StatusOr<Registration>> results;
  results.reserve(options.size());
  for (int i = 0; i < response.items_size(); ++i) {
    v1::RegisterMrBatchResult* item = response.mutable_items(i);
    absl::Status status = ItemStatusFromProto(item->status());
    if (!status.ok()) {
      results.push_back(std::move(status));
      continue;
    }
    results.push_back(Registration(session.core(),
                                   std::move(*item->mutable_registration()),
                                   options[i].mr));
  }
  return results;
}

absl::StatusOr<std::vector<absl::StatusOr<uint32_t>>>
Registration::DeregisterBatch(std::vector<Registration>& registrations) {
  std::shared_ptr<internal::SessionCore> core;
  for (const Registration& r : registrations) {
    if (!r.valid()) continue;
    if (core == nullptr) core = r.core_;
    if (r.core_ != core) {
      return absl::InvalidArgumentError(
          "DeregisterBatch: the registrations belong to different sessions");
    }
  }
  std::vector<absl::StatusOr<uint32_t>> results(
      registrations.size(),
      absl::FailedPreconditionError("registration already deregistered"));
  if (core == nullptr) return results;
  v1::DeregisterMrBatchRequest request;
  request.set_session(core->token);
  std::vector<size_t> sent;  // index in `registrations` of each item
  for (size_t i = 0; i < registrations.size(); ++i) {
    Registration& r = registrations[i];
    if (!r.valid()) continue;
    v1::DeregisterMrRequest* item = request.add_items();
    if (r.mr_object_ != 0) {
      item->set_mr(r.mr_object_);
    } else {
      item->set_registration(r.response_.registration());
    }
    r.core_.reset();
    sent.push_back(i);
  }
  if (core->Ended()) {
    for (size_t i : sent) results[i] = 0u;
    return results;
  }
  absl::StatusOr<v1::DeregisterMrBatchResponse> response =
      core->client.DeregisterMrBatch(request);
  if (!response.ok()) {
    if (!internal::EndedElsewhere(*core, response.status())) {
      return response.status();
    }
    for (size_t i : sent) results[i] = 0u;
    return results;
  }
  if (response->items_size() != static_cast<int>(sent.size())) {
    return absl::InternalError(absl::StrCat("DeregisterMrBatch answered ",
                                            response->items_size(),
                                            " items for ", sent.size()));
  }
  for (size_t k = 0; k < sent.size(); ++k) {
    const v1::DeregisterMrBatchResult& item = response->items(k);
    absl::Status status = ItemStatusFromProto(item.status());
    if (status.ok()) {
      results[sent[k]] = item.references();
    } else {
      results[sent[k]] = std::move(status);
    }
  }
  return results;
}

v1::RegisterMrResponse Registration::Detach() {
  core_.reset();
  return response_;
}

}  // namespace mrd::client
