// Checks, on a real verbs device (rxe0 in the test VM), the path mrd relies
// on: a memfd mapping, mlocked, registered with ibv_reg_mr, is the target and
// source of RDMA WRITE and READ between two RC QPs; the data lands in the
// memfd's own pages (read back with pread). Also reports what the device
// offers for on-demand paging and memory windows.
//
// Usage: verbs_probe [device]   (default: $MRD_VERBS_DEVICE, else rxe0)
// Exit status 0 only when every required check passed.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define BUF_SIZE (1u << 20)
#define XFER_SIZE (256u << 10)

#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                        \
      fprintf(stderr, "\n");                               \
      exit(1);                                             \
    }                                                      \
  } while (0)

struct region {
  int fd;
  uint8_t* addr;
  struct ibv_mr* mr;
};

static void make_region(struct ibv_pd* pd, const char* name, struct region* r) {
  r->fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  CHECK(r->fd >= 0, "memfd_create: %s", strerror(errno));
  CHECK(ftruncate(r->fd, BUF_SIZE) == 0, "ftruncate: %s", strerror(errno));
  CHECK(fcntl(r->fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0, "F_SEAL_SHRINK: %s",
        strerror(errno));
  r->addr = mmap(NULL, BUF_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd, 0);
  CHECK(r->addr != MAP_FAILED, "mmap memfd: %s", strerror(errno));
  CHECK(mlock(r->addr, BUF_SIZE) == 0, "mlock %u bytes: %s", BUF_SIZE,
        strerror(errno));
  r->mr = ibv_reg_mr(pd, r->addr, BUF_SIZE,
                     IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                         IBV_ACCESS_REMOTE_READ);
  CHECK(r->mr != NULL, "ibv_reg_mr on memfd mapping: %s", strerror(errno));
  printf("ok   memfd %s: %u bytes mlocked, registered lkey=0x%x rkey=0x%x\n",
         name, BUF_SIZE, r->mr->lkey, r->mr->rkey);
}

static int find_ipv4_gid(struct ibv_context* ctx, union ibv_gid* gid) {
  struct ibv_port_attr pa;
  CHECK(ibv_query_port(ctx, 1, &pa) == 0, "ibv_query_port");
  for (int i = 0; i < pa.gid_tbl_len; i++) {
    union ibv_gid g;
    if (ibv_query_gid(ctx, 1, i, &g) != 0) continue;
    static const uint8_t v4mapped[12] = {0, 0, 0, 0, 0,    0,
                                         0, 0, 0, 0, 0xff, 0xff};
    if (memcmp(g.raw, v4mapped, sizeof(v4mapped)) == 0) {
      *gid = g;
      return i;
    }
  }
  return -1;
}

static struct ibv_qp* make_qp(struct ibv_pd* pd, struct ibv_cq* cq) {
  struct ibv_qp_init_attr ia = {
      .send_cq = cq,
      .recv_cq = cq,
      .cap = {.max_send_wr = 16,
              .max_recv_wr = 16,
              .max_send_sge = 1,
              .max_recv_sge = 1},
      .qp_type = IBV_QPT_RC,
      .sq_sig_all = 1,
  };
  struct ibv_qp* qp = ibv_create_qp(pd, &ia);
  CHECK(qp != NULL, "ibv_create_qp: %s", strerror(errno));
  struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT,
                          .pkey_index = 0,
                          .port_num = 1,
                          .qp_access_flags = IBV_ACCESS_REMOTE_WRITE |
                                             IBV_ACCESS_REMOTE_READ |
                                             IBV_ACCESS_LOCAL_WRITE};
  CHECK(ibv_modify_qp(qp, &a,
                      IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                          IBV_QP_ACCESS_FLAGS) == 0,
        "QP to INIT: %s", strerror(errno));
  return qp;
}

static void connect_qp(struct ibv_qp* qp, uint32_t remote_qpn, int gid_index,
                       const union ibv_gid* gid) {
  struct ibv_qp_attr a = {
      .qp_state = IBV_QPS_RTR,
      .path_mtu = IBV_MTU_1024,
      .dest_qp_num = remote_qpn,
      .rq_psn = 0,
      .max_dest_rd_atomic = 4,
      .min_rnr_timer = 12,
      .ah_attr = {.is_global = 1,
                  .grh = {.dgid = *gid,
                          .sgid_index = gid_index,
                          .hop_limit = 64},
                  .port_num = 1},
  };
  CHECK(
      ibv_modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                        IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) == 0,
      "QP to RTR: %s", strerror(errno));
  struct ibv_qp_attr s = {.qp_state = IBV_QPS_RTS,
                          .timeout = 14,
                          .retry_cnt = 7,
                          .rnr_retry = 7,
                          .sq_psn = 0,
                          .max_rd_atomic = 4};
  CHECK(ibv_modify_qp(qp, &s,
                      IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                          IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                          IBV_QP_MAX_QP_RD_ATOMIC) == 0,
        "QP to RTS: %s", strerror(errno));
}

static struct ibv_wc wait_one(struct ibv_cq* cq) {
  struct ibv_wc wc;
  struct timespec start, now;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (;;) {
    int n = ibv_poll_cq(cq, 1, &wc);
    CHECK(n >= 0, "ibv_poll_cq failed");
    if (n == 1) return wc;
    clock_gettime(CLOCK_MONOTONIC, &now);
    CHECK(now.tv_sec - start.tv_sec < 30, "no completion within 30 s");
    usleep(100);
  }
}

static void rdma(struct ibv_qp* qp, struct ibv_cq* cq, enum ibv_wr_opcode op,
                 struct region* local, size_t loff, uint64_t raddr,
                 uint32_t rkey, uint32_t len, const char* what) {
  struct ibv_sge sge = {.addr = (uintptr_t)(local->addr + loff),
                        .length = len,
                        .lkey = local->mr->lkey};
  struct ibv_send_wr wr = {
      .wr_id = 1,
      .sg_list = &sge,
      .num_sge = 1,
      .opcode = op,
      .send_flags = IBV_SEND_SIGNALED,
      .wr = {.rdma = {.remote_addr = raddr, .rkey = rkey}}};
  struct ibv_send_wr* bad = NULL;
  CHECK(ibv_post_send(qp, &wr, &bad) == 0, "post %s: %s", what,
        strerror(errno));
  struct ibv_wc wc = wait_one(cq);
  CHECK(wc.status == IBV_WC_SUCCESS, "%s completed with %s", what,
        ibv_wc_status_str(wc.status));
}

static void check_file(int fd, size_t off, uint8_t seed, uint32_t len,
                       const char* what) {
  uint8_t* buf = malloc(len);
  CHECK(buf != NULL, "malloc");
  CHECK(pread(fd, buf, len, (off_t)off) == (ssize_t)len, "pread: %s",
        strerror(errno));
  for (uint32_t i = 0; i < len; i++) {
    CHECK(buf[i] == (uint8_t)(seed + i * 7),
          "%s: byte %u of the memfd is 0x%02x, expected 0x%02x", what, i,
          buf[i], (uint8_t)(seed + i * 7));
  }
  free(buf);
  printf("ok   %s: %u bytes verified in the memfd's pages (pread)\n", what,
         len);
}

int main(int argc, char** argv) {
  const char* want = argc > 1 ? argv[1] : getenv("MRD_VERBS_DEVICE");
  if (!want || !*want) want = "rxe0";
  setvbuf(stdout, NULL, _IOLBF, 0);

  int n = 0;
  struct ibv_device** list = ibv_get_device_list(&n);
  CHECK(list != NULL, "ibv_get_device_list: %s", strerror(errno));
  struct ibv_device* dev = NULL;
  for (int i = 0; i < n; i++)
    if (strcmp(ibv_get_device_name(list[i]), want) == 0) dev = list[i];
  CHECK(dev != NULL, "device %s not found (%d devices)", want, n);
  struct ibv_context* ctx = ibv_open_device(dev);
  CHECK(ctx != NULL, "ibv_open_device %s: %s", want, strerror(errno));

  struct ibv_device_attr_ex ax;
  memset(&ax, 0, sizeof(ax));
  CHECK(ibv_query_device_ex(ctx, NULL, &ax) == 0, "ibv_query_device_ex");
  const struct ibv_device_attr* a = &ax.orig_attr;
  printf(
      "info %s: max_mr_size=0x%llx max_mr=%d max_mw=%d max_qp=%d "
      "max_qp_wr=%d max_sge=%d max_qp_rd_atom=%d page_size_cap=0x%llx\n",
      want, (unsigned long long)a->max_mr_size, a->max_mr, a->max_mw, a->max_qp,
      a->max_qp_wr, a->max_sge, a->max_qp_rd_atom,
      (unsigned long long)a->page_size_cap);
  printf(
      "info %s: MEM_WINDOW=%d MEM_WINDOW_TYPE_2A=%d MEM_WINDOW_TYPE_2B=%d "
      "MEM_MGT_EXTENSIONS=%d odp general_caps=0x%llx rc_odp_caps=0x%x\n",
      want, !!(a->device_cap_flags & IBV_DEVICE_MEM_WINDOW),
      !!(a->device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2A),
      !!(a->device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B),
      !!(a->device_cap_flags & IBV_DEVICE_MEM_MGT_EXTENSIONS),
      (unsigned long long)ax.odp_caps.general_caps,
      ax.odp_caps.per_transport_caps.rc_odp_caps);

  struct ibv_pd* pd = ibv_alloc_pd(ctx);
  CHECK(pd != NULL, "ibv_alloc_pd: %s", strerror(errno));
  struct ibv_cq* cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
  CHECK(cq != NULL, "ibv_create_cq: %s", strerror(errno));

  struct region src, dst;
  make_region(pd, "mrd-probe-src", &src);
  make_region(pd, "mrd-probe-dst", &dst);

  union ibv_gid gid;
  int gid_index = find_ipv4_gid(ctx, &gid);
  CHECK(gid_index >= 0, "no IPv4-mapped GID on %s port 1 (netdev address?)",
        want);
  char gs[INET6_ADDRSTRLEN];
  inet_ntop(AF_INET6, gid.raw, gs, sizeof(gs));
  printf("info using GID[%d] %s\n", gid_index, gs);

  struct ibv_qp* qa = make_qp(pd, cq);
  struct ibv_qp* qb = make_qp(pd, cq);
  connect_qp(qa, qb->qp_num, gid_index, &gid);
  connect_qp(qb, qa->qp_num, gid_index, &gid);
  printf("ok   two RC QPs connected (qpn %u <-> %u)\n", qa->qp_num, qb->qp_num);

  // WRITE: src[0..XFER) -> dst[4096..], through dst's rkey.
  for (uint32_t i = 0; i < XFER_SIZE; i++)
    src.addr[i] = (uint8_t)(0x11 + i * 7);
  rdma(qa, cq, IBV_WR_RDMA_WRITE, &src, 0, (uintptr_t)dst.addr + 4096,
       dst.mr->rkey, XFER_SIZE, "RDMA WRITE");
  check_file(dst.fd, 4096, 0x11, XFER_SIZE, "RDMA WRITE into memfd MR");

  // Change the memfd through the file, READ it back through the MR.
  uint8_t* pattern = malloc(XFER_SIZE);
  CHECK(pattern != NULL, "malloc");
  for (uint32_t i = 0; i < XFER_SIZE; i++) pattern[i] = (uint8_t)(0x5a + i * 7);
  CHECK(pwrite(dst.fd, pattern, XFER_SIZE, 8192) == XFER_SIZE, "pwrite: %s",
        strerror(errno));
  free(pattern);
  rdma(qa, cq, IBV_WR_RDMA_READ, &src, 512 << 10, (uintptr_t)dst.addr + 8192,
       dst.mr->rkey, XFER_SIZE, "RDMA READ");
  check_file(src.fd, 512 << 10, 0x5a, XFER_SIZE, "RDMA READ from memfd MR");

  // A bad rkey must fail the work request, not write anything.
  {
    struct ibv_sge sge = {
        .addr = (uintptr_t)src.addr, .length = 64, .lkey = src.mr->lkey};
    struct ibv_send_wr wr = {.wr_id = 2,
                             .sg_list = &sge,
                             .num_sge = 1,
                             .opcode = IBV_WR_RDMA_WRITE,
                             .send_flags = IBV_SEND_SIGNALED,
                             .wr = {.rdma = {.remote_addr = (uintptr_t)dst.addr,
                                             .rkey = dst.mr->rkey ^ 0xff}}};
    struct ibv_send_wr* bad = NULL;
    CHECK(ibv_post_send(qa, &wr, &bad) == 0, "post bad-rkey write");
    struct ibv_wc wc = wait_one(cq);
    CHECK(wc.status != IBV_WC_SUCCESS,
          "RDMA WRITE with a wrong rkey succeeded");
    printf("ok   RDMA WRITE with a wrong rkey fails: %s\n",
           ibv_wc_status_str(wc.status));
  }

  // Deregistration invalidates the rkey (on a fresh QP pair: the first one
  // is in the error state now).
  {
    struct ibv_qp* qc = make_qp(pd, cq);
    struct ibv_qp* qd = make_qp(pd, cq);
    connect_qp(qc, qd->qp_num, gid_index, &gid);
    connect_qp(qd, qc->qp_num, gid_index, &gid);
    uint32_t old_rkey = dst.mr->rkey;
    CHECK(ibv_dereg_mr(dst.mr) == 0, "ibv_dereg_mr: %s", strerror(errno));
    dst.mr = NULL;
    struct ibv_sge sge = {
        .addr = (uintptr_t)src.addr, .length = 64, .lkey = src.mr->lkey};
    struct ibv_send_wr wr = {
        .wr_id = 3,
        .sg_list = &sge,
        .num_sge = 1,
        .opcode = IBV_WR_RDMA_WRITE,
        .send_flags = IBV_SEND_SIGNALED,
        .wr = {.rdma = {.remote_addr = (uintptr_t)dst.addr, .rkey = old_rkey}}};
    struct ibv_send_wr* bad = NULL;
    CHECK(ibv_post_send(qc, &wr, &bad) == 0, "post write after dereg");
    struct ibv_wc wc = wait_one(cq);
    CHECK(wc.status != IBV_WC_SUCCESS,
          "RDMA WRITE through a deregistered rkey succeeded");
    printf("ok   RDMA WRITE through a deregistered rkey fails: %s\n",
           ibv_wc_status_str(wc.status));
    ibv_destroy_qp(qc);
    ibv_destroy_qp(qd);
  }

  // Informational: access flags and memory windows.
  {
    struct ibv_mr* odp = ibv_reg_mr(
        pd, src.addr, BUF_SIZE, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_ON_DEMAND);
    printf("info ibv_reg_mr with IBV_ACCESS_ON_DEMAND: %s\n",
           odp ? "accepted" : strerror(errno));
    if (odp) ibv_dereg_mr(odp);
    struct ibv_mr* ro =
        ibv_reg_mr(pd, src.addr, BUF_SIZE,
                   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_RELAXED_ORDERING);
    printf("info ibv_reg_mr with IBV_ACCESS_RELAXED_ORDERING: %s\n",
           ro ? "accepted" : strerror(errno));
    if (ro) ibv_dereg_mr(ro);
    struct ibv_mr* bind = ibv_reg_mr(
        pd, src.addr, BUF_SIZE,
        IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_MW_BIND);
    printf("info ibv_reg_mr with IBV_ACCESS_MW_BIND: %s\n",
           bind ? "accepted" : strerror(errno));
    if (bind) ibv_dereg_mr(bind);
    struct ibv_mw* mw1 = ibv_alloc_mw(pd, IBV_MW_TYPE_1);
    printf("info ibv_alloc_mw type 1: %s\n", mw1 ? "ok" : strerror(errno));
    if (mw1) ibv_dealloc_mw(mw1);
    struct ibv_mw* mw2 = ibv_alloc_mw(pd, IBV_MW_TYPE_2);
    printf("info ibv_alloc_mw type 2: %s\n", mw2 ? "ok" : strerror(errno));
    if (mw2) ibv_dealloc_mw(mw2);
  }

  CHECK(ibv_dereg_mr(src.mr) == 0, "ibv_dereg_mr src");
  ibv_destroy_qp(qa);
  ibv_destroy_qp(qb);
  ibv_destroy_cq(cq);
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  ibv_free_device_list(list);
  printf("verbs_probe: all checks passed\n");
  return 0;
}
