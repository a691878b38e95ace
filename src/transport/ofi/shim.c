/* A flat C API over the few libfabric calls the ofi transport uses (src/transport/ofi).
 *
 * libfabric's data path (fi_domain, fi_endpoint, fi_tsend, fi_cq_read, fi_close, ...) is static
 * inline functions of its headers that call through the objects' operation tables; only a few
 * functions are exported by libfabric.so.1 (fi_getinfo, fi_freeinfo, fi_dupinfo, fi_fabric,
 * fi_strerror, fi_version). Those are renamed below before the headers are included and
 * resolved at run time with dlopen("libfabric.so.1"), so liboxccl.so has no link-time
 * dependency on libfabric: a machine without it loads the library and reports the ofi
 * transport unavailable. Compiled by build.rs only where the libfabric headers are found. */

#define fi_getinfo oxccl_dl_fi_getinfo
#define fi_freeinfo oxccl_dl_fi_freeinfo
#define fi_dupinfo oxccl_dl_fi_dupinfo
#define fi_fabric oxccl_dl_fi_fabric
#define fi_strerror oxccl_dl_fi_strerror
#define fi_version oxccl_dl_fi_version

#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define API FI_VERSION(1, 9)

static int (*p_getinfo)(uint32_t, const char *, const char *, uint64_t, const struct fi_info *, struct fi_info **);
static void (*p_freeinfo)(struct fi_info *);
static struct fi_info *(*p_dupinfo)(const struct fi_info *);
static int (*p_fabric)(struct fi_fabric_attr *, struct fid_fabric **, void *);
static const char *(*p_strerror)(int);
static uint32_t (*p_version)(void);
static char load_error[512];
static pthread_once_t load_once = PTHREAD_ONCE_INIT;

/* The signal dispositions of the process, kept across whatever may load a provider.
 * libinfinipath (linked by libfabric's psm provider) installs handlers for SIGSEGV, SIGBUS,
 * SIGILL, SIGABRT, SIGINT and SIGTERM from its constructor, which write a backtrace file
 * (`*.btr`) into the working directory; the application's own dispositions are put back after
 * dlopen of libfabric and after every fi_getinfo (which loads provider modules on first use).
 * No environment variable is read or set for this. */
struct dispositions {
    struct sigaction a[NSIG];
};

static void save_signals(struct dispositions *d) {
    for (int s = 1; s < NSIG; s++)
        if (sigaction(s, NULL, &d->a[s])) d->a[s].sa_handler = SIG_ERR;
}

static void restore_signals(const struct dispositions *d) {
    for (int s = 1; s < NSIG; s++) {
        struct sigaction now;
        if (s == SIGKILL || s == SIGSTOP || d->a[s].sa_handler == SIG_ERR) continue;
        if (!sigaction(s, NULL, &now) && now.sa_handler != d->a[s].sa_handler) sigaction(s, &d->a[s], NULL);
    }
}

static void load(void) {
    struct dispositions before;
    save_signals(&before);
    void *h = dlopen("libfabric.so.1", RTLD_NOW | RTLD_LOCAL);
    restore_signals(&before);
    if (!h) {
        const char *e = dlerror();
        snprintf(load_error, sizeof load_error, "%s", e ? e : "dlopen(libfabric.so.1) failed");
        return;
    }
#define SYM(p, name)                                                                          \
    do {                                                                                      \
        *(void **)(&p) = dlsym(h, name);                                                      \
        if (!p) {                                                                             \
            snprintf(load_error, sizeof load_error, "libfabric.so.1 lacks %s", name);         \
            return;                                                                           \
        }                                                                                     \
    } while (0)
    SYM(p_getinfo, "fi_getinfo");
    SYM(p_freeinfo, "fi_freeinfo");
    SYM(p_dupinfo, "fi_dupinfo");
    SYM(p_fabric, "fi_fabric");
    SYM(p_strerror, "fi_strerror");
    SYM(p_version, "fi_version");
#undef SYM
    if (FI_MAJOR(p_version()) != 1 || FI_MINOR(p_version()) < 9) {
        snprintf(load_error, sizeof load_error, "libfabric.so.1 is version %u.%u, 1.9 or newer is needed",
                 FI_MAJOR(p_version()), FI_MINOR(p_version()));
        return;
    }
    load_error[0] = 0;
}

int oxccl_dl_fi_getinfo(uint32_t v, const char *node, const char *service, uint64_t flags,
                        const struct fi_info *hints, struct fi_info **info) {
    struct dispositions before;
    save_signals(&before);
    int rc = p_getinfo(v, node, service, flags, hints, info);
    restore_signals(&before);
    return rc;
}
void oxccl_dl_fi_freeinfo(struct fi_info *info) { p_freeinfo(info); }
struct fi_info *oxccl_dl_fi_dupinfo(const struct fi_info *info) { return p_dupinfo(info); }
int oxccl_dl_fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context) {
    return p_fabric(attr, fabric, context);
}
const char *oxccl_dl_fi_strerror(int errnum) { return p_strerror(errnum); }
uint32_t oxccl_dl_fi_version(void) { return p_version(); }

/* Loads libfabric once; 0 when it is usable, else -1 with the reason in `err`. */
int oxccl_ofi_load(char *err, size_t errlen) {
    load_error[0] = 1;
    pthread_once(&load_once, load);
    if (load_error[0]) {
        snprintf(err, errlen, "%s", load_error);
        return -1;
    }
    return 0;
}

/* One endpoint of a NIC, shared by every peer: fabric, domain, completion queue, address
 * vector, endpoint. */
struct oxccl_ofi {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_cq *cq;
    struct fid_av *av;
    struct fid_ep *ep;
    int wait_fd;
    int directed; /* FI_DIRECTED_RECV granted: receives name their source */
};

static void fail(char *err, size_t errlen, const char *what, int rc) {
    snprintf(err, errlen, "%s: %s (%d)", what, fi_strerror(rc < 0 ? -rc : rc), rc);
}

static struct fi_info *hints_for(const char *prov, int directed) {
    struct fi_info *h = fi_allocinfo();
    if (!h) return NULL;
    h->ep_attr->type = FI_EP_RDM;
    h->caps = FI_TAGGED | (directed ? FI_DIRECTED_RECV : 0);
    h->mode = FI_CONTEXT | FI_CONTEXT2;
    h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    h->domain_attr->threading = FI_THREAD_DOMAIN;
    if (prov && *prov) h->fabric_attr->prov_name = strdup(prov);
    return h;
}

/* Providers that work only inside one host, or are hooks: never chosen without being named. */
static int host_local(const char *prov) {
    return !strncmp(prov, "shm", 3) || strstr(prov, "ofi_hook") != NULL;
}

/* Every provider offering tagged reliable datagrams (`prov`: only that one), names separated
 * by '\n' into `out` without duplicates; 0, or a negative libfabric code. */
int oxccl_ofi_providers(const char *prov, char *out, size_t outlen) {
    struct fi_info *h = hints_for(prov, 0), *info = NULL;
    if (!h) return -FI_ENOMEM;
    int rc = fi_getinfo(API, NULL, NULL, 0, h, &info);
    fi_freeinfo(h);
    out[0] = 0;
    if (rc) return rc;
    size_t used = 0;
    for (struct fi_info *i = info; i; i = i->next) {
        const char *n = i->fabric_attr->prov_name;
        size_t l = strlen(n);
        char needle[128];
        snprintf(needle, sizeof needle, "%s\n", n);
        if (strstr(out, needle) || used + l + 2 > outlen) continue;
        memcpy(out + used, n, l);
        out[used + l] = '\n';
        used += l + 1;
        out[used] = 0;
    }
    fi_freeinfo(info);
    return 0;
}

void oxccl_ofi_close(struct oxccl_ofi *o) {
    if (!o) return;
    if (o->ep) fi_close(&o->ep->fid);
    if (o->av) fi_close(&o->av->fid);
    if (o->cq) fi_close(&o->cq->fid);
    if (o->domain) fi_close(&o->domain->fid);
    if (o->fabric) fi_close(&o->fabric->fid);
    if (o->info) fi_freeinfo(o->info);
    free(o);
}

/* Opens an endpoint of provider `prov` (NULL or "": the first that is not host-local), bound
 * to the address `node` when given (an IP address: the interface the bootstrap chose; NULL for
 * providers not addressed by IP). NULL with the reason in `err` on failure. */
struct oxccl_ofi *oxccl_ofi_open(const char *prov, const char *node, char *err, size_t errlen) {
    struct fi_info *info = NULL, *pick = NULL;
    int rc = -FI_ENOMEM;
    /* Receives directed to the peer's address where the provider can; else tags alone. */
    for (int directed = 1; directed >= 0; directed--) {
        struct fi_info *h = hints_for(prov, directed);
        if (!h) {
            snprintf(err, errlen, "out of memory");
            return NULL;
        }
        rc = fi_getinfo(API, node, NULL, node ? FI_SOURCE : 0, h, &info);
        fi_freeinfo(h);
        if (!rc) break;
    }
    if (rc) {
        fail(err, errlen, node ? "fi_getinfo (bound to the bootstrap's address)" : "fi_getinfo", rc);
        return NULL;
    }
    for (struct fi_info *i = info; i && !pick; i = i->next)
        if ((prov && *prov) || !host_local(i->fabric_attr->prov_name)) pick = i;
    if (!pick) {
        fi_freeinfo(info);
        snprintf(err, errlen, "fi_getinfo offered only host-local providers");
        return NULL;
    }
    struct oxccl_ofi *o = calloc(1, sizeof *o);
    if (!o) {
        fi_freeinfo(info);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    o->wait_fd = -1;
    o->directed = (pick->caps & FI_DIRECTED_RECV) != 0;
    o->info = fi_dupinfo(pick);
    fi_freeinfo(info);
    if (!o->info) {
        free(o);
        snprintf(err, errlen, "fi_dupinfo failed");
        return NULL;
    }
    if ((rc = fi_fabric(o->info->fabric_attr, &o->fabric, NULL))) {
        fail(err, errlen, "fi_fabric", rc);
        goto out;
    }
    if ((rc = fi_domain(o->fabric, o->info, &o->domain, NULL))) {
        fail(err, errlen, "fi_domain", rc);
        goto out;
    }
    struct fi_cq_attr cq = {0};
    cq.format = FI_CQ_FORMAT_TAGGED;
    cq.size = 1024;
    cq.wait_obj = FI_WAIT_FD;
    if (fi_cq_open(o->domain, &cq, &o->cq, NULL)) {
        cq.wait_obj = FI_WAIT_NONE;
        if ((rc = fi_cq_open(o->domain, &cq, &o->cq, NULL))) {
            fail(err, errlen, "fi_cq_open", rc);
            goto out;
        }
    } else if (fi_control(&o->cq->fid, FI_GETWAIT, &o->wait_fd)) {
        o->wait_fd = -1;
    }
    struct fi_av_attr av = {0};
    av.type = FI_AV_TABLE;
    if ((rc = fi_av_open(o->domain, &av, &o->av, NULL))) {
        fail(err, errlen, "fi_av_open", rc);
        goto out;
    }
    if ((rc = fi_endpoint(o->domain, o->info, &o->ep, NULL))) {
        fail(err, errlen, "fi_endpoint", rc);
        goto out;
    }
    if ((rc = fi_ep_bind(o->ep, &o->cq->fid, FI_TRANSMIT | FI_RECV))) {
        fail(err, errlen, "fi_ep_bind (completion queue)", rc);
        goto out;
    }
    if ((rc = fi_ep_bind(o->ep, &o->av->fid, 0))) {
        fail(err, errlen, "fi_ep_bind (address vector)", rc);
        goto out;
    }
    if ((rc = fi_enable(o->ep))) {
        fail(err, errlen, "fi_enable", rc);
        goto out;
    }
    return o;
out:
    oxccl_ofi_close(o);
    return NULL;
}

/* The provider's name ("tcp;ofi_rxm"), and facts the Rust side needs. */
const char *oxccl_ofi_provider(const struct oxccl_ofi *o) { return o->info->fabric_attr->prov_name; }
int oxccl_ofi_wait_fd(const struct oxccl_ofi *o) { return o->wait_fd; }
int oxccl_ofi_mr_local(const struct oxccl_ofi *o) { return (o->info->domain_attr->mr_mode & FI_MR_LOCAL) != 0; }
int oxccl_ofi_directed(const struct oxccl_ofi *o) { return o->directed; }

/* Whether closing this endpoint may crash: libfabric before 1.18 with `tcp;ofi_rxm` (rxm
 * writes an error entry with a NULL context while flushing a disconnected endpoint in
 * fi_close, about one close in 150). */
int oxccl_ofi_close_unsafe(const struct oxccl_ofi *o) {
    uint32_t v = fi_version();
    return (FI_MAJOR(v) == 1 && FI_MINOR(v) < 18) && !strcmp(o->info->fabric_attr->prov_name, "tcp;ofi_rxm");
}
size_t oxccl_ofi_max_msg(const struct oxccl_ofi *o) { return o->info->ep_attr->max_msg_size; }

/* This endpoint's address into `buf` (`*len`: its size in, the address's length out). */
int oxccl_ofi_name(struct oxccl_ofi *o, void *buf, size_t *len) { return fi_getname(&o->ep->fid, buf, len); }

/* Inserts a peer's address (as long as this endpoint's own: the caller checks) into the
 * address vector; its handle goes to `*peer`. */
int oxccl_ofi_insert(struct oxccl_ofi *o, const void *addr, uint64_t *peer) {
    fi_addr_t a = FI_ADDR_NOTAVAIL;
    int n = fi_av_insert(o->av, addr, 1, &a, 0, NULL);
    *peer = a;
    return n == 1 ? 0 : (n < 0 ? n : -FI_EINVAL);
}

/* Registers `len` bytes at `buf` (a link's staging memory) for local sends and receives;
 * the descriptor to pass with them goes to `*desc`, the registration to `*mr` (closed with
 * oxccl_ofi_mr_close before the memory is freed). */
int oxccl_ofi_mr_reg(struct oxccl_ofi *o, void *buf, size_t len, void **desc, void **mr) {
    struct fid_mr *m = NULL;
    int rc = fi_mr_reg(o->domain, buf, len, FI_SEND | FI_RECV, 0, 0, 0, &m, NULL);
    if (rc) return rc;
    *desc = fi_mr_desc(m);
    *mr = m;
    return 0;
}
void oxccl_ofi_mr_close(void *mr) {
    if (mr) fi_close(&((struct fid_mr *)mr)->fid);
}

/* Posts a tagged send to `peer` or a receive (from `peer` where receives are directed, else
 * from anyone; `peer` = ~0: from anyone, matching tags under `ignore` too); 0, -FI_EAGAIN
 * (try again after reading completions), or an error. `ctx` must stay valid (and hold an
 * fi_context2) until the completion is read. */
int oxccl_ofi_tsend(struct oxccl_ofi *o, const void *buf, size_t len, void *desc, uint64_t peer, uint64_t tag,
                    void *ctx) {
    return (int)fi_tsend(o->ep, buf, len, desc, peer, tag, ctx);
}
int oxccl_ofi_trecv(struct oxccl_ofi *o, void *buf, size_t len, void *desc, uint64_t peer, uint64_t tag,
                    uint64_t ignore, void *ctx) {
    return (int)fi_trecv(o->ep, buf, len, desc, o->directed ? peer : FI_ADDR_UNSPEC, tag, ignore, ctx);
}

/* Withdraws a posted receive; its completion (an FI_ECANCELED error, or its data if it
 * matched first) is still read from the queue. */
int oxccl_ofi_cancel(struct oxccl_ofi *o, void *ctx) { return (int)fi_cancel(&o->ep->fid, ctx); }

/* Reads up to `max` completions: their contexts, lengths and tags. Returns how many (0:
 * none), or for an error entry a negative code with its context in `*errctx` (NULL when the
 * provider gave none) and the error's text in `err`. */
int oxccl_ofi_poll(struct oxccl_ofi *o, void **ctx, size_t *len, uint64_t *tag, int max, void **errctx, char *err,
                   size_t errlen) {
    struct fi_cq_tagged_entry e[16];
    if (max > 16) max = 16;
    ssize_t n = fi_cq_read(o->cq, e, max);
    if (n == -FI_EAGAIN) return 0;
    if (n == -FI_EAVAIL) {
        struct fi_cq_err_entry ee = {0};
        char buf[256];
        *errctx = NULL;
        if (fi_cq_readerr(o->cq, &ee, 0) < 0) {
            snprintf(err, errlen, "fi_cq_readerr failed");
            return -FI_EOTHER;
        }
        *errctx = ee.op_context;
        const char *p = fi_cq_strerror(o->cq, ee.prov_errno, ee.err_data, buf, sizeof buf);
        snprintf(err, errlen, "%s failed: %s (provider: %s)", (ee.flags & FI_RECV) ? "a receive" : "a send",
                 fi_strerror(ee.err), p ? p : "?");
        return -(ee.err ? ee.err : FI_EOTHER);
    }
    if (n < 0) {
        fail(err, errlen, "fi_cq_read", (int)n);
        return (int)n;
    }
    for (ssize_t i = 0; i < n; i++) {
        ctx[i] = e[i].op_context;
        len[i] = e[i].len;
        tag[i] = e[i].tag;
    }
    return (int)n;
}

/* Before sleeping on the wait descriptor: 0 when sleeping is safe, 1 when completions may be
 * ready (read them first), or a negative code. */
int oxccl_ofi_trywait(struct oxccl_ofi *o) {
    struct fid *f = &o->cq->fid;
    int rc = fi_trywait(o->fabric, &f, 1);
    if (rc == -FI_EAGAIN) return 1;
    return rc;
}

const char *oxccl_ofi_strerror(int rc) { return fi_strerror(rc < 0 ? -rc : rc); }
