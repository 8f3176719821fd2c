// Every flag of mrd (docs/CONFIG.md), declared for the wiring that reads
// them (server/main.cc and the rest of this module). Defined in flags.cc,
// one place, so that --help lists them with their file.
#ifndef MRD_SERVER_DAEMON_FLAGS_H_
#define MRD_SERVER_DAEMON_FLAGS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/time/time.h"
#include "mrd/byte_size.h"

ABSL_DECLARE_FLAG(std::string, runtime_dir);
ABSL_DECLARE_FLAG(std::string, grpc_socket);
ABSL_DECLARE_FLAG(std::string, fd_socket);
ABSL_DECLARE_FLAG(std::string, socket_mode);
ABSL_DECLARE_FLAG(std::string, debug_tcp_address);
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(std::string, peer_address);
ABSL_DECLARE_FLAG(std::string, pin_method);
ABSL_DECLARE_FLAG(uint64_t, pin_max_map_splits);
ABSL_DECLARE_FLAG(uint32_t, peer_max_connections);
ABSL_DECLARE_FLAG(uint32_t, peer_max_unauthenticated);
ABSL_DECLARE_FLAG(uint32_t, peer_max_session_connections);
ABSL_DECLARE_FLAG(absl::Duration, peer_hello_timeout);
ABSL_DECLARE_FLAG(absl::Duration, peer_stall_timeout);
ABSL_DECLARE_FLAG(mrd::ByteSize, peer_buffer_bytes);
ABSL_DECLARE_FLAG(uint32_t, peer_workers);
ABSL_DECLARE_FLAG(std::string, verbs_device);
ABSL_DECLARE_FLAG(std::string, metrics_address);
ABSL_DECLARE_FLAG(std::string, shm_dir);
ABSL_DECLARE_FLAG(std::vector<std::string>, allowed_uids);
ABSL_DECLARE_FLAG(std::vector<std::string>, allowed_gids);
ABSL_DECLARE_FLAG(bool, allow_any_peer);
ABSL_DECLARE_FLAG(uint64_t, max_sessions);
ABSL_DECLARE_FLAG(uint64_t, fd_reserve);
ABSL_DECLARE_FLAG(uint64_t, grpc_max_connections);
ABSL_DECLARE_FLAG(uint64_t, grpc_max_connections_per_tenant);
ABSL_DECLARE_FLAG(uint64_t, max_session_fds);
ABSL_DECLARE_FLAG(mrd::ByteSize, max_buffer_size);
ABSL_DECLARE_FLAG(mrd::ByteSize, max_session_pinned_bytes);
ABSL_DECLARE_FLAG(mrd::ByteSize, max_total_pinned_bytes);
ABSL_DECLARE_FLAG(uint64_t, max_session_registrations);
ABSL_DECLARE_FLAG(uint64_t, max_total_registrations);
ABSL_DECLARE_FLAG(uint64_t, max_total_buffers);
ABSL_DECLARE_FLAG(uint64_t, max_total_lams);
ABSL_DECLARE_FLAG(uint64_t, max_total_mrs);
ABSL_DECLARE_FLAG(uint64_t, max_batch_items);
ABSL_DECLARE_FLAG(std::string, tenants_file);
ABSL_DECLARE_FLAG(uint32_t, tenant_default_percent);
ABSL_DECLARE_FLAG(mrd::ByteSize, warm_pin_bytes_per_session);
ABSL_DECLARE_FLAG(mrd::ByteSize, warm_pin_bytes_total);
ABSL_DECLARE_FLAG(absl::Duration, lease_ttl);
ABSL_DECLARE_FLAG(absl::Duration, max_lease_ttl);
ABSL_DECLARE_FLAG(int, worker_threads);
ABSL_DECLARE_FLAG(int, spare_worker_threads);
ABSL_DECLARE_FLAG(bool, fair_scheduling);
ABSL_DECLARE_FLAG(std::string, tenant_key);
ABSL_DECLARE_FLAG(std::string, kubelet_pod_logs_dir);
ABSL_DECLARE_FLAG(std::string, admin_socket);
ABSL_DECLARE_FLAG(uint32_t, prefault_threads);
ABSL_DECLARE_FLAG(absl::Duration, progress_after);
ABSL_DECLARE_FLAG(absl::Duration, progress_interval);
ABSL_DECLARE_FLAG(bool, takeover);
ABSL_DECLARE_FLAG(std::string, handover_socket);
ABSL_DECLARE_FLAG(absl::Duration, handover_drain_timeout);
ABSL_DECLARE_FLAG(absl::Duration, handover_timeout);
ABSL_DECLARE_FLAG(std::string, after_handover);
ABSL_DECLARE_FLAG(std::string, handover_status_file);
ABSL_DECLARE_FLAG(absl::Duration, await_handover);
ABSL_DECLARE_FLAG(std::string, handover_test_fault);
ABSL_DECLARE_FLAG(std::vector<std::string>, etcd_endpoints);
ABSL_DECLARE_FLAG(std::string, directory_root);
ABSL_DECLARE_FLAG(std::string, directory_cluster);
ABSL_DECLARE_FLAG(std::string, node_name);
ABSL_DECLARE_FLAG(std::string, directory_mooncake_prefix);
ABSL_DECLARE_FLAG(absl::Duration, directory_lease_ttl);
ABSL_DECLARE_FLAG(absl::Duration, directory_unpublish_wait);
ABSL_DECLARE_FLAG(uint64_t, directory_max_entries);
ABSL_DECLARE_FLAG(uint64_t, directory_max_watches);
ABSL_DECLARE_FLAG(bool, verbose);

#endif  // MRD_SERVER_DAEMON_FLAGS_H_
