// Every flag of mrd, with its default and help (docs/CONFIG.md). A default
// that an options struct holds as well (core::CoreOptions,
// device::SoftwareDeviceOptions) is read from it, so that it is written
// once; byte sizes are mrd::ByteSize flags, which take units ("16G").
#include "server/daemon/flags.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/time/time.h"
#include "mrd/byte_size.h"
#include "server/common/prefault.h"
#include "server/core/core.h"
#include "server/device/software/software_device.h"

ABSL_FLAG(std::string, runtime_dir, "",
          "Directory for the sockets. Default: /run/mrd as root, else "
          "$XDG_RUNTIME_DIR/mrd, else /tmp/mrd-<uid>.");
ABSL_FLAG(std::string, grpc_socket, "",
          "gRPC Unix socket path. Default: <runtime_dir>/mrd.sock.");
ABSL_FLAG(std::string, fd_socket, "",
          "fd-passing (SOCK_SEQPACKET) socket path. Default: "
          "<runtime_dir>/fd.sock.");
ABSL_FLAG(std::string, socket_mode, "0660",
          "Permission bits (octal) of both sockets.");
ABSL_FLAG(std::string, debug_tcp_address, "",
          "Also serve gRPC on this TCP address (debugging, e.g. "
          "127.0.0.1:50051). Loopback addresses only. Empty = off.");
ABSL_FLAG(std::string, device, "auto",
          "RDMA device: software, verbs or auto (verbs where a device exists, "
          "else software).");
ABSL_FLAG(uint32_t, software_devices, 1,
          "How many software devices mrd serves (1 to 24), named software, "
          "software1, ...: a node without NICs, or tests, with several "
          "devices. Device i's peers connect to --peer_address's port + i "
          "(any free port when that is 0). Software device only; a live "
          "handover needs 1.");
ABSL_FLAG(std::string, peer_address, "127.0.0.1:7471",
          "Where remote peers connect (numeric host:port; port 0 = any free "
          "port). Software device: the TCP listener. Verbs device: the "
          "rdma_cm listener, an address of the RDMA device's interface "
          "(e.g. 10.77.0.1:0).");
ABSL_FLAG(std::string, pin_method, "auto",
          "Software device: how pages are pinned. io_uring (fixed buffers: no "
          "memory map per pin), mlock (splits a memory map per pinned "
          "range), or auto (io_uring where the kernel allows it, mlock for "
          "read-only buffers and when io_uring is unavailable).");
ABSL_FLAG(uint64_t, pin_max_map_splits, 0,
          "Software device: memory maps (VMAs) mlock pinning may split, "
          "beyond which pins are refused with LIMIT_MEMORY_MAPS. 0 = half of "
          "what vm.max_map_count leaves at start.");
ABSL_FLAG(uint32_t, peer_max_connections,
          mrd::device::SoftwareDeviceOptions{}.max_connections,
          "Software device: peer TCP connections open at once; past it a new "
          "one sheds the oldest connection that has not said hello, or is "
          "refused.");
ABSL_FLAG(uint32_t, peer_max_unauthenticated,
          mrd::device::SoftwareDeviceOptions{}.max_unauthenticated_connections,
          "Software device: peer connections before hello; past it the oldest "
          "such connection is closed to admit the new one.");
ABSL_FLAG(uint32_t, peer_max_session_connections,
          mrd::device::SoftwareDeviceOptions{}.max_session_connections,
          "Software device: peer connections bound to one session; past it "
          "hello gets LIMIT_PEER_CONNECTIONS.");
ABSL_FLAG(absl::Duration, peer_hello_timeout,
          mrd::device::SoftwareDeviceOptions{}.peer_hello_timeout,
          "Software device: a peer connection without a successful hello by "
          "then is closed.");
ABSL_FLAG(absl::Duration, peer_stall_timeout,
          mrd::device::SoftwareDeviceOptions{}.peer_stall_timeout,
          "Software device: a peer connection making no progress inside a "
          "frame (or a response) for this long is closed.");
ABSL_FLAG(mrd::ByteSize, peer_buffer_bytes,
          mrd::ByteSize{mrd::device::SoftwareDeviceOptions{}.peer_buffer_bytes},
          "Software device: memory for peer frames of all connections "
          "together; when reached, frame bodies wait unread.");
ABSL_FLAG(uint32_t, peer_workers,
          mrd::device::SoftwareDeviceOptions{}.peer_workers,
          "Software device: threads handling peer requests (fixed; no thread "
          "per connection).");
ABSL_FLAG(std::string, verbs_device, "",
          "Verbs device: the RDMA device to use (e.g. mlx5_0, rxe0); empty = "
          "the one --peer_address belongs to. When set, --peer_address must "
          "be on it.");
ABSL_FLAG(std::string, verbs_devices, "",
          "Verbs device: more RDMA devices served beside the first "
          "(--verbs_device), as a comma list of names or 'all' (every RDMA "
          "device of the node). Each device's peers connect to the IPv4 "
          "address of its port (from its GID table) at --peer_address's "
          "port (any free port when that is 0); a device without one is "
          "refused. At most 24 devices in all.");
ABSL_FLAG(std::string, metrics_address, "127.0.0.1:9464",
          "Serve Prometheus metrics at http://<address>/metrics. Empty = off.");
ABSL_FLAG(std::string, shm_dir, "/dev/shm/mrd",
          "Shared-memory directory for ImportFile (lease sessions). Empty = "
          "off.");
ABSL_FLAG(std::vector<std::string>, allowed_uids, {},
          "Peer uids allowed on the fd socket and as owners of ImportFile "
          "files. Default: mrd's own effective uid.");
ABSL_FLAG(std::vector<std::string>, allowed_gids, {},
          "Peer gids allowed on the fd socket.");
ABSL_FLAG(bool, allow_any_peer, false,
          "Allow any local uid on the fd socket (the socket mode still "
          "applies).");
ABSL_FLAG(uint64_t, max_sessions, mrd::core::CoreOptions{}.max_sessions,
          "Open sessions at most.");
ABSL_FLAG(uint64_t, fd_reserve, 0,
          "File descriptors no client can make mrd use (kept for gRPC, "
          "peers, metrics, logs, the device). 0 = max(256, limit/8), at most "
          "3/4 of the open-file limit (RLIMIT_NOFILE, raised to the hard "
          "limit at start).");
ABSL_FLAG(uint64_t, grpc_max_connections, 0,
          "gRPC connections (on --grpc_socket) mrd holds at most; more are "
          "refused with an HTTP/2 GOAWAY naming LIMIT_GRPC_CONNECTIONS. 0 = "
          "half the fd reserve.");
ABSL_FLAG(uint64_t, grpc_max_connections_per_tenant, 0,
          "gRPC connections one client tenant (its pod, container or uid, as "
          "--tenant_key says) may hold; more are refused "
          "(LIMIT_TENANT_GRPC_CONNECTIONS). 0 = --tenant_default_percent of "
          "--grpc_max_connections.");
ABSL_FLAG(uint32_t, grpc_max_streams_per_connection, 32,
          "Calls (streams) one gRPC connection may have open at once, "
          "advertised to the client as HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS:"
          " the client holds its further calls until one ends, so a tenant's "
          "calls queued inside mrd's gRPC are at most this times its "
          "connections. Long-lived streams (StreamCompletions, WatchName) "
          "count. 0 = no limit.");
ABSL_FLAG(uint64_t, max_session_fds, 0,
          "File descriptors (imported buffers) one session may make mrd "
          "hold. 0 = min(4096, budget/4), budget = limit - fd_reserve.");
ABSL_FLAG(mrd::ByteSize, max_buffer_size,
          mrd::ByteSize{mrd::core::CoreOptions{}.max_buffer_size},
          "Largest buffer (bytes) a session may import.");
ABSL_FLAG(mrd::ByteSize, max_session_pinned_bytes,
          mrd::ByteSize{mrd::core::CoreOptions{}.max_session_pinned_bytes},
          "Bytes one session may have pinned.");
ABSL_FLAG(mrd::ByteSize, max_total_pinned_bytes,
          mrd::ByteSize{mrd::core::CoreOptions{}.max_total_pinned_bytes},
          "Bytes all sessions together may have pinned.");
ABSL_FLAG(uint64_t, max_session_registrations,
          mrd::core::CoreOptions{}.max_session_registrations,
          "Registrations one session may hold.");
ABSL_FLAG(uint64_t, max_total_registrations,
          mrd::core::CoreOptions{}.max_total_registrations,
          "Registrations all sessions together may hold.");
ABSL_FLAG(uint64_t, max_total_buffers,
          mrd::core::CoreOptions{}.max_total_buffers,
          "Buffers all sessions together may hold (each holds an fd and a "
          "memory map).");
ABSL_FLAG(uint64_t, max_total_lams, mrd::core::CoreOptions{}.max_total_lams,
          "LAMs all sessions together may hold (each holds a device key).");
ABSL_FLAG(uint64_t, max_total_mrs, mrd::core::CoreOptions{}.max_total_mrs,
          "MR objects all sessions together may hold (each holds a device "
          "key).");
ABSL_FLAG(uint64_t, max_batch_items, mrd::core::CoreOptions{}.max_batch_items,
          "Items one RegisterMrBatch or DeregisterMrBatch may carry.");
ABSL_FLAG(std::string, tenants_file, "",
          "Named tenants and their quotas, one per line: tenant <name> "
          "uids=<uid>[,...] [sessions=N] [buffers=N] [registrations=N] "
          "[pinned_bytes=N[K|M|G|T]] [lams=N] [mrs=N] [peer_connections=N]. "
          "Other uids are tenants of their own (uid:<uid>); lease sessions "
          "nobody vouched for are the tenant 'anonymous'. Empty = none named.");
ABSL_FLAG(uint32_t, tenant_default_percent, 25,
          "A tenant's default quota of each resource, in percent of the "
          "server's total of it (1-100).");
ABSL_FLAG(mrd::ByteSize, warm_pin_bytes_per_session,
          mrd::ByteSize{uint64_t{256} << 20},
          "Bytes of released registrations one session may keep pinned "
          "(without any key) so that registering them again is cheap; they "
          "count towards the pinned-bytes limits and give way to new pins. "
          "0 = off.");
ABSL_FLAG(mrd::ByteSize, warm_pin_bytes_total, mrd::ByteSize{uint64_t{1} << 30},
          "Bytes of warm pins all sessions together may keep. 0 = off.");
ABSL_FLAG(absl::Duration, lease_ttl, mrd::core::CoreOptions{}.default_lease_ttl,
          "Default lease TTL of OpenLeaseSession.");
ABSL_FLAG(absl::Duration, max_lease_ttl, mrd::core::CoreOptions{}.max_lease_ttl,
          "Longest lease TTL a client may ask for.");
ABSL_FLAG(int, worker_threads, 4,
          "Threads that run registration work off the gRPC threads, shared "
          "fairly between tenants (each tenant's requests wait in a queue of "
          "its own, served by deficit round robin weighted by the tenant's "
          "weight; a tenant holds at most its share while others wait).");
ABSL_FLAG(int, spare_worker_threads, -1,
          "Threads beyond --worker_threads that start only a request of a "
          "tenant holding less than its share while every worker is busy "
          "with other tenants' work. -1 = as many as --worker_threads.");
ABSL_FLAG(int, nice, -5,
          "The nice value of mrd's threads (-20 to 19), set at start: its "
          "calls' threads then get a CPU ahead of the node's processes at "
          "nice 0 that share mrd's CPU cgroup, so a tenant's busy client "
          "does not delay another tenant's answers; bulk work runs "
          "--bulk_nice below it. Needs CAP_SYS_NICE or RLIMIT_NICE for a "
          "value below the one mrd started with; without them mrd keeps "
          "that one and says so at start.");
ABSL_FLAG(int, bulk_nice, 10,
          "Nice steps below mrd's own priority that bulk work runs at (a "
          "registration, LAM or buffer release of --bulk_work_pages or more, "
          "a batch of that many items), so that on a busy node small "
          "requests get a CPU first; 0 = off, at most 19. Per request where "
          "mrd may raise a thread's priority back (CAP_SYS_NICE or "
          "RLIMIT_NICE), else on --worker_threads threads of their own.");
ABSL_FLAG(int, bulk_workers, -1,
          "At most this many workers start bulk work (see --bulk_work_pages) "
          "at once; other work starts on any worker. -1 = one less than the "
          "CPUs mrd may run on, at least 1; 0 = no limit. With a CPU left "
          "over, a small request's threads get one at once however much "
          "bulk work is queued.");
ABSL_FLAG(uint64_t, bulk_work_pages, 256,
          "4 KiB pages (or batch items) from which a request is bulk work "
          "(see --bulk_nice); at least 1.");
ABSL_FLAG(bool, fair_scheduling, true,
          "Share the workers fairly between tenants. false: one queue, first "
          "come first served, no spare threads (for comparison only).");
ABSL_FLAG(std::string, tenant_key, "pod",
          "What a client's tenant is keyed by: pod (its Kubernetes pod, from "
          "the cgroup of its process; a container outside Kubernetes is its "
          "container, a process in none its uid), container, or uid.");
ABSL_FLAG(std::string, kubelet_pod_logs_dir, "/var/log/pods",
          "The kubelet's pod log directory (<namespace>_<name>_<uid> per "
          "pod), where a client pod's namespace and name are read when the "
          "tenants file names pods as <namespace>/<name>.");
ABSL_FLAG(std::string, admin_socket, "",
          "The administrative gRPC socket (mrd.v1.TenantAdmin), mode 0600, "
          "for root and mrd's own uid only. Default: <runtime_dir>/admin.sock; "
          "'none' = no administrative socket.");
ABSL_FLAG(uint32_t, prefault_threads, mrd::kDefaultPrefaultThreads,
          "Threads (at most the online CPUs) that fill mrd's page tables "
          "before a registration or LAM of 32 MiB or more is pinned; 0 = "
          "off (the pin faults the pages in itself).");
ABSL_FLAG(absl::Duration, progress_after, absl::Seconds(1),
          "A registration of 32 MiB or more still pinning after this long "
          "reports its progress (REGISTRATION_PROGRESS) on its session's "
          "completion stream...");
ABSL_FLAG(absl::Duration, progress_interval, absl::Seconds(1),
          "...and again every this long until it answers (at least 1ms).");
ABSL_FLAG(bool, takeover, false,
          "Take over from the mrd serving this runtime directory (live "
          "handover: every session, buffer and registration goes on with "
          "its keys; docs/ARCHITECTURE.md). When none serves, start fresh. A "
          "takeover that fails leaves the running mrd serving, and this one "
          "exits 1 saying why.");
ABSL_FLAG(std::string, handover_socket, "",
          "Where this mrd listens for a new mrd taking over, and where "
          "--takeover looks for the running one. Default: "
          "<runtime_dir>/handover.sock (mode 0600, own uid only).");
ABSL_FLAG(absl::Duration, handover_drain_timeout, absl::Seconds(10),
          "Handing over: how long requests in flight may take to finish "
          "before the handover is refused (HANDOVER_BUSY) and this mrd "
          "serves on.");
ABSL_FLAG(absl::Duration, handover_timeout, absl::Seconds(60),
          "Handing over: how long each side waits for each answer of the "
          "other, and how long --takeover keeps asking a running mrd that "
          "says it is busy (HANDOVER_BUSY).");
ABSL_FLAG(std::string, after_handover, "exit",
          "What this mrd does once it has handed over: exit (exit 0 at "
          "once; the kernel drops this process's own pins and mappings) "
          "or wait (release everything, hold nothing, NOT_SERVING, until "
          "SIGTERM or SIGINT, then exit 0; for Kubernetes, where an exited "
          "container would be restarted and take over back).");
ABSL_FLAG(std::string, handover_status_file, "",
          "Write this mrd's handover state to this file, one word: "
          "taking-over, serving, handing-over, handed-over, stopping or "
          "stopped (Kubernetes probes and --await_handover read it; a file "
          "of this mrd alone, e.g. in a per-pod emptyDir). Empty = none.");
ABSL_FLAG(absl::Duration, await_handover, absl::ZeroDuration(),
          "Do not serve: wait at most this long until the mrd writing "
          "--handover_status_file is not in the middle of a handover "
          "(neither taking-over nor handing-over), then exit 0; exit 1 "
          "when it still is (a Kubernetes preStop hook). 0 = off.");
ABSL_FLAG(std::string, handover_test_fault, "",
          "Tests only: fail the handover at this step (server/handover/"
          "process_handover.h lists them).");
ABSL_FLAG(std::vector<std::string>, etcd_endpoints, {},
          "The directory (docs/DIRECTORY.md): etcd members, host:port,... "
          "(etcd's v3 gRPC API; TLS with --etcd_ca_file). Sessions publish "
          "registrations "
          "there under names that peers on other nodes resolve; every entry "
          "is bound to mrd's lease. Empty = no directory.");
ABSL_FLAG(std::string, etcd_ca_file, "",
          "The directory over TLS: the PEM bundle of the CA that signed the "
          "etcd members' certificates. Empty = plain text (unless "
          "--etcd_cert_file is set: then the system's CAs).");
ABSL_FLAG(std::string, etcd_cert_file, "",
          "The directory over mutual TLS: mrd's client certificate (PEM), "
          "for etcd members that require one (--client-cert-auth); with "
          "--etcd_key_file.");
ABSL_FLAG(std::string, etcd_key_file, "", "The key (PEM) of --etcd_cert_file.");
ABSL_FLAG(std::string, etcd_user, "",
          "etcd's authentication: the user mrd signs in as; with "
          "--etcd_password_file. Empty = none.");
ABSL_FLAG(std::string, etcd_password_file, "",
          "The file holding --etcd_user's password (its first line). A file, "
          "not a flag: a flag's value shows in ps.");
ABSL_FLAG(std::string, directory_root, "/mrd",
          "The directory's root key on etcd (starts with '/').");
ABSL_FLAG(std::string, directory_cluster, "default",
          "The cluster's name in the directory's keys: "
          "<root>/v1/<cluster>/tenants/<tenant>/names/<name>.");
ABSL_FLAG(std::string, node_name, "",
          "This node's name in the directory's entries. Empty = the host "
          "name (on Kubernetes, pass the node's: spec.nodeName).");
ABSL_FLAG(absl::Duration, directory_lease_ttl, absl::Seconds(10),
          "The TTL of mrd's etcd lease: how long the entries of an mrd "
          "killed outright outlive it (renewed every third of it while mrd "
          "serves; whole seconds).");
ABSL_FLAG(absl::Duration, directory_unpublish_wait, absl::Seconds(2),
          "How long a call that ends a published registration (its last "
          "DeregisterMr, ReleaseBuffer, CloseMr, CloseSession, Unpublish) "
          "waits for etcd to delete the entry before it answers; with etcd "
          "unreachable the delete stays queued and the call does not wait.");
ABSL_FLAG(uint64_t, directory_max_entries, 65536,
          "Entries mrd publishes at most, with the deletes still queued: "
          "past it Publish is refused (DIRECTORY_FULL).");
ABSL_FLAG(uint64_t, directory_max_watches, 256,
          "WatchName streams at once, at most (each one etcd watch); a "
          "tenant may hold a quarter of them (WATCH_LIMIT past that).");
ABSL_FLAG(std::string, directory_mooncake_prefix, "",
          "Also write each published name as a segment of Mooncake's "
          "transfer engine, in its JSON, under <prefix>ram/<name>, e.g. "
          "'mooncake/' (or 'mooncake/<cluster id>/', as its readers' "
          "MC_METADATA_CLUSTER_ID makes it). Must end with '/'. "
          "Empty = off.");
ABSL_FLAG(bool, verbose, false, "Log debug lines.");
