/*
 * kvxfer.transport._rma — one-sided RMA over libucp for the kvxfer transfer engine.
 *
 * UCXX (the Python UCX binding we use for context, worker, listener, endpoints and
 * messages) exposes no RMA; this module adds it on UCXX's raw handles
 * (ucp_context_h / ucp_worker_h / ucp_ep_h passed as Python ints). `import ucxx` must
 * happen first so that the libucp already loaded by the libucx wheel is the one we link.
 *
 * Contents
 *   mem_map / mem_unmap       ucp_mem_map + ucp_mem_query (memory type: host, cuda, ...)
 *   rkey_pack / rkey_unpack / rkey_destroy
 *   put_batch                 one C loop of ucp_put_nbx over arrays; every op is bounds-checked
 *                             against its remote region BEFORE any is posted; GIL released
 *                             while posting; on an owned endpoint a PUT's failure is kept
 *                             and fails the endpoint's later flush chains
 *   CompletionQueue           ep/worker flush whose completion (token, status, time) is queued
 *                             and signalled on an eventfd that asyncio watches (loop.add_reader).
 *                             Callbacks run on the thread that progresses the endpoint's
 *                             worker (UCXX's progress thread for UCXX's worker; the queue's
 *                             own-worker thread or a chain's starter for the own worker);
 *                             they never touch Python.
 *   own_context / own worker  kvxfer's own UCP context (process-wide, thread-shared) and a
 *                             worker per queue made with context=: bulk endpoints live there
 *                             and only kvxfer's threads progress it (nothing of UCXX runs
 *                             there); the queue's thread sleeps on its event fd when idle.
 *                             With set_deliver(fn), that thread calls fn (taking the GIL)
 *                             between progress calls after one queued something, and
 *                             signals the eventfd only for what fn left (cq_own_deliver).
 *   poller                    while a flush started with spin=True is in flight, a native
 *                             thread of the queue wakes UCXX's progress thread every
 *                             signal_us (ucp_worker_signal), then sleeps on a condition
 *                             variable. UCXX's progress thread sleeps on the worker's event fd
 *                             with a 1 ms epoll timeout, and cuda_ipc completions (CUDA events)
 *                             never signal that fd: without the poller every CUDA flush
 *                             completed on the next 1 ms tick.
 *   ep_info                   ucp_ep_print_info captured as a string (lanes / transports)
 *   plan_items                the engine planner's happy path for writes of ItemWrites
 *                             (kvxfer.engine.writeplan): one call instead of tens of Python
 *                             and numpy calls; anything unusual or bad is left to Python
 *   gather                    memcpy of a list of local runs into one buffer (the host lane's
 *                             packing of short strided runs; no UCX involved)
 *   CompletionQueue.ep_create bulk endpoint (error mode NONE + error handler, see there)
 *
 * Invariants
 *   - Every call into libucp releases the GIL: UCXX's progress thread holds the worker lock
 *     while it runs Python callbacks (which need the GIL), so holding the GIL while waiting
 *     for the worker lock would deadlock.
 *   - A CompletionQueue's shared core lives until the Python object is gone AND every flush
 *     it started has called back (reference count), so a callback arriving after close()
 *     or after a Python-side timeout is harmless.
 *   - No thread of ours calls ucp_worker_progress on UCXX's worker (the own worker is ours
 *     to progress). Whatever progresses UCXX's worker runs
 *     UCXX's listener callback, whose ucp_ep_create is handed to UCXX's progress thread and
 *     waited for (3 x 3 s); that thread needs the worker lock the progressing thread holds,
 *     so every accept stalled until UCXX gave up. Our threads signal the worker instead.
 *   - The poller thread is joined by close() (GIL released) before the eventfd closes, so it
 *     never signals a worker after the queue was closed; the owner closes the queue
 *     before UCXX tears its worker down. A spinning poller backs off to 10 us sleeps after
 *     2 ms in which nothing completed, and to 200 us sleeps after 100 ms (a stuck flush
 *     costs little CPU; the Python side times it out). Any completion resets the clock,
 *     so a steady stream of completions is never slowed.
 *   - put_batch either rejects the whole batch before posting anything (bad bounds) or
 *     raises UcxError(status, message, posted) after `posted` ops went out.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <poll.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

static PyObject *UcxError; /* args: (status:int, message:str, posted:int) */

static PyObject *raise_ucx(ucs_status_t st, const char *what, Py_ssize_t posted)
{
    PyObject *args = Py_BuildValue("(iNn)", (int)st,
                                   PyUnicode_FromFormat("%s: %s", what, ucs_status_string(st)),
                                   posted);
    if (args != NULL) {
        PyErr_SetObject(UcxError, args);
        Py_DECREF(args);
    }
    return NULL;
}

/* ------------------------------------------------------------------ handles */

static int get_handle(PyObject *o, void **out, const char *what)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (v == 0) {
        PyErr_Format(PyExc_ValueError, "%s handle is NULL", what);
        return -1;
    }
    *out = (void *)(uintptr_t)v;
    return 0;
}

static PyObject *py_mem_map(PyObject *self, PyObject *args)
{
    PyObject *ctx_o;
    unsigned long long addr, length;
    ucp_context_h ctx;
    ucp_mem_map_params_t p;
    ucp_mem_attr_t attr;
    ucp_mem_h memh;
    ucs_status_t st;

    if (!PyArg_ParseTuple(args, "OKK", &ctx_o, &addr, &length))
        return NULL;
    if (get_handle(ctx_o, (void **)&ctx, "context") < 0)
        return NULL;
    if (length == 0) {
        PyErr_SetString(PyExc_ValueError, "cannot register a zero-length region");
        return NULL;
    }
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    p.address    = (void *)(uintptr_t)addr;
    p.length     = (size_t)length;
    Py_BEGIN_ALLOW_THREADS
    st = ucp_mem_map(ctx, &p, &memh);
    Py_END_ALLOW_THREADS
    if (st != UCS_OK)
        return raise_ucx(st, "ucp_mem_map", 0);
    attr.field_mask = UCP_MEM_ATTR_FIELD_MEM_TYPE;
    Py_BEGIN_ALLOW_THREADS
    st = ucp_mem_query(memh, &attr);
    Py_END_ALLOW_THREADS
    if (st != UCS_OK) {
        ucp_mem_unmap(ctx, memh);
        return raise_ucx(st, "ucp_mem_query", 0);
    }
    return Py_BuildValue("(Ks)", (unsigned long long)(uintptr_t)memh,
                         attr.mem_type < UCS_MEMORY_TYPE_LAST
                             ? ucs_memory_type_names[attr.mem_type]
                             : "unknown");
}

static PyObject *py_mem_unmap(PyObject *self, PyObject *args)
{
    PyObject *ctx_o, *memh_o;
    ucp_context_h ctx;
    ucp_mem_h memh;
    ucs_status_t st;
    if (!PyArg_ParseTuple(args, "OO", &ctx_o, &memh_o))
        return NULL;
    if (get_handle(ctx_o, (void **)&ctx, "context") < 0 ||
        get_handle(memh_o, (void **)&memh, "memory") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    st = ucp_mem_unmap(ctx, memh);
    Py_END_ALLOW_THREADS
    if (st != UCS_OK)
        return raise_ucx(st, "ucp_mem_unmap", 0);
    Py_RETURN_NONE;
}

static PyObject *py_rkey_pack(PyObject *self, PyObject *args)
{
    PyObject *ctx_o, *memh_o, *out;
    ucp_context_h ctx;
    ucp_mem_h memh;
    void *buf;
    size_t len;
    ucs_status_t st;
    if (!PyArg_ParseTuple(args, "OO", &ctx_o, &memh_o))
        return NULL;
    if (get_handle(ctx_o, (void **)&ctx, "context") < 0 ||
        get_handle(memh_o, (void **)&memh, "memory") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    st = ucp_rkey_pack(ctx, memh, &buf, &len);
    Py_END_ALLOW_THREADS
    if (st != UCS_OK)
        return raise_ucx(st, "ucp_rkey_pack", 0);
    out = PyBytes_FromStringAndSize((const char *)buf, (Py_ssize_t)len);
    ucp_rkey_buffer_release(buf);
    return out;
}

static PyObject *py_rkey_unpack(PyObject *self, PyObject *args)
{
    PyObject *ep_o;
    Py_buffer packed;
    ucp_ep_h ep;
    ucp_rkey_h rkey;
    ucs_status_t st;
    if (!PyArg_ParseTuple(args, "Oy*", &ep_o, &packed))
        return NULL;
    if (get_handle(ep_o, (void **)&ep, "endpoint") < 0) {
        PyBuffer_Release(&packed);
        return NULL;
    }
    if (packed.len == 0) {
        PyBuffer_Release(&packed);
        PyErr_SetString(PyExc_ValueError, "empty packed rkey");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    st = ucp_ep_rkey_unpack(ep, packed.buf, &rkey);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&packed);
    if (st != UCS_OK)
        return raise_ucx(st, "ucp_ep_rkey_unpack", 0);
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)rkey);
}

static PyObject *py_rkey_destroy(PyObject *self, PyObject *args)
{
    PyObject *rkey_o;
    ucp_rkey_h rkey;
    if (!PyArg_ParseTuple(args, "O", &rkey_o))
        return NULL;
    if (get_handle(rkey_o, (void **)&rkey, "rkey") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    ucp_rkey_destroy(rkey);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- put_batch */

static int get_u64_array(PyObject *o, Py_buffer *b, const char *name)
{
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (b->itemsize != 8 || b->ndim > 1 || b->format == NULL ||
        strchr("QLKqlk", b->format[strlen(b->format) - 1]) == NULL) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D array of 64-bit integers (format %s)",
                     name, b->format ? b->format : "?");
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/*
 * put_batch(ep, laddr, raddr, nbytes, lmemh, ridx, rbase, rlen, rkeys, keep_gil=False, ctx=0)
 * -> ops posted
 *
 * Per op i: PUT nbytes[i] bytes from local laddr[i] (registration lmemh[i], 0 = let UCX
 * find it) to remote raddr[i] inside remote region ridx[i], whose extent is
 * [rbase[r], rbase[r] + rlen[r]) and key rkeys[r]. All ops are checked first.
 * keep_gil: post without releasing the GIL. Only for an endpoint of kvxfer's own worker
 * (ep_create on a queue with an own worker): no thread that holds that worker's lock ever
 * waits for the GIL (its callbacks are native), while UCXX's progress thread holds its
 * worker's lock when it runs Python callbacks. The caller keeps such batches short.
 * ctx: the endpoint's error-handler context (ep_create), or 0. With one, every PUT that
 * does not complete at once gets a callback that records a failure in the context; a
 * later flush + notify chain on the endpoint then fails instead of succeeding (see
 * put_cb). The batch holds one context reference until its last such callback ran.
 * Without one a pending PUT's request is freed at once and its status is never seen.
 */
struct ep_ctx;
typedef struct {
    struct ep_ctx *x;
    long left; /* pending PUTs + the poster's own hold (atomic) */
} put_batch_t;
static void put_cb(void *request, ucs_status_t status, void *user);
static void put_batch_drop(put_batch_t *pb, long n);
static void ep_ctx_add(struct ep_ctx *x, int n);

static PyObject *py_put_batch(PyObject *self, PyObject *args)
{
    PyObject *ep_o, *objs[8];
    const char *names[8] = {"laddr", "raddr", "nbytes", "lmemh", "ridx", "rbase", "rlen", "rkeys"};
    Py_buffer b[8];
    int nb = 0, i;
    ucp_ep_h ep;
    Py_ssize_t n, m, k, posted = 0;
    ucs_status_t st = UCS_OK;
    PyObject *result = NULL;
    int keep = 0;
    unsigned long long ctx = 0;
    put_batch_t *pb = NULL;
    Py_ssize_t pending = 0;
    PyThreadState *ts;

    if (!PyArg_ParseTuple(args, "OOOOOOOOO|pK", &ep_o, &objs[0], &objs[1], &objs[2], &objs[3],
                          &objs[4], &objs[5], &objs[6], &objs[7], &keep, &ctx))
        return NULL;
    if (get_handle(ep_o, (void **)&ep, "endpoint") < 0)
        return NULL;
    for (i = 0; i < 8; i++, nb++)
        if (get_u64_array(objs[i], &b[i], names[i]) < 0)
            goto out;
    n = b[0].len / 8;
    m = b[5].len / 8;
    for (i = 1; i < 5; i++)
        if (b[i].len / 8 != n) {
            PyErr_Format(PyExc_ValueError, "%s has %zd entries, laddr has %zd", names[i],
                         b[i].len / 8, n);
            goto out;
        }
    if (b[6].len / 8 != m || b[7].len / 8 != m) {
        PyErr_SetString(PyExc_ValueError, "rbase, rlen and rkeys differ in length");
        goto out;
    }
    {
        const uint64_t *laddr = b[0].buf, *raddr = b[1].buf, *len = b[2].buf;
        const uint64_t *lmemh = b[3].buf, *ridx = b[4].buf;
        const uint64_t *rbase = b[5].buf, *rlen = b[6].buf, *rkeys = b[7].buf;

        /* second, cheap bounds check: nothing is posted unless every op fits */
        for (k = 0; k < n; k++) {
            uint64_t r = ridx[k];
            if (r >= (uint64_t)m || rkeys[r] == 0) {
                PyErr_Format(PyExc_IndexError, "op %zd: remote region %llu of %zd", k,
                             (unsigned long long)r, m);
                goto out;
            }
            if (len[k] == 0 || raddr[k] < rbase[r] || raddr[k] - rbase[r] > rlen[r] ||
                len[k] > rlen[r] - (raddr[k] - rbase[r]) || laddr[k] + len[k] < laddr[k]) {
                PyErr_Format(PyExc_IndexError,
                             "op %zd: remote [%p, +%llu) outside region %llu [%p, +%llu)", k,
                             (void *)(uintptr_t)raddr[k], (unsigned long long)len[k],
                             (unsigned long long)r, (void *)(uintptr_t)rbase[r],
                             (unsigned long long)rlen[r]);
                goto out;
            }
        }
        if (ctx != 0) {
            pb = malloc(sizeof(*pb));
            if (pb == NULL) {
                PyErr_NoMemory();
                goto out;
            }
            pb->x    = (struct ep_ctx *)(uintptr_t)ctx;
            pb->left = (long)n + 1; /* every op may pend; the unused ones dropped below */
            ep_ctx_add(pb->x, 1);
        }
        ts = keep ? NULL : PyEval_SaveThread();
        for (k = 0; k < n; k++) {
            ucp_request_param_t p;
            ucs_status_ptr_t sp;
            p.op_attr_mask = lmemh[k] ? UCP_OP_ATTR_FIELD_MEMH : 0;
            p.memh         = (ucp_mem_h)(uintptr_t)lmemh[k];
            if (pb != NULL) {
                p.op_attr_mask |= UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
                p.cb.send   = put_cb;
                p.user_data = pb;
            }
            sp = ucp_put_nbx(ep, (void *)(uintptr_t)laddr[k], (size_t)len[k], raddr[k],
                             (ucp_rkey_h)(uintptr_t)rkeys[ridx[k]], &p);
            if (UCS_PTR_IS_ERR(sp)) {
                st = UCS_PTR_STATUS(sp);
                break;
            }
            if (sp != NULL && pb != NULL)
                pending++; /* put_cb frees it */
            else if (sp != NULL)
                ucp_request_free(sp); /* completes in the background; tracked by flush */
            posted++;
        }
        if (ts != NULL)
            PyEval_RestoreThread(ts);
        if (pb != NULL)
            put_batch_drop(pb, (long)(n - pending) + 1);
    }
    if (st != UCS_OK) {
        raise_ucx(st, "ucp_put_nbx", posted);
        goto out;
    }
    result = PyLong_FromSsize_t(posted);
out:
    for (i = 0; i < nb; i++)
        PyBuffer_Release(&b[i]);
    return result;
}

/* ---------------------------------------------------------------- gather */

/*
 * gather(dst, capacity, laddr, nbytes) -> bytes copied
 *
 * Copies the runs laddr[i] of nbytes[i] bytes of this process, in order and back to back,
 * to dst (this process's memory, at least `capacity` bytes): the host lane packs short
 * strided runs this way before handing them to process_vm_writev as one local iovec
 * (kvxfer.engine.hostcopy). Nothing is copied (ValueError) when the runs add up to more
 * than capacity. The caller vouches for every source address (runs the engine's planner
 * checked inside this process's registrations). The GIL is released while a copy above
 * 64 KiB runs.
 */
static PyObject *py_gather(PyObject *self, PyObject *args)
{
    unsigned long long dst, cap;
    PyObject *lo, *no;
    Py_buffer lb, nbuf;
    Py_ssize_t n, k;
    uint64_t total = 0;
    PyObject *result = NULL;

    if (!PyArg_ParseTuple(args, "KKOO", &dst, &cap, &lo, &no))
        return NULL;
    if (get_u64_array(lo, &lb, "laddr") < 0)
        return NULL;
    if (get_u64_array(no, &nbuf, "nbytes") < 0) {
        PyBuffer_Release(&lb);
        return NULL;
    }
    n = lb.len / 8;
    if (nbuf.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "nbytes has %zd entries, laddr has %zd", nbuf.len / 8, n);
        goto out;
    }
    {
        const uint64_t *laddr = lb.buf, *len = nbuf.buf;
        char *d = (char *)(uintptr_t)dst;
        for (k = 0; k < n; k++) {
            if (len[k] > cap - total) {
                PyErr_Format(PyExc_ValueError, "runs exceed the %llu-byte buffer at run %zd", cap,
                             k);
                goto out;
            }
            total += len[k];
        }
        if (total > (64u << 10)) {
            Py_BEGIN_ALLOW_THREADS
            for (k = 0; k < n; k++) {
                memcpy(d, (const void *)(uintptr_t)laddr[k], (size_t)len[k]);
                d += len[k];
            }
            Py_END_ALLOW_THREADS
        } else {
            for (k = 0; k < n; k++) {
                memcpy(d, (const void *)(uintptr_t)laddr[k], (size_t)len[k]);
                d += len[k];
            }
        }
    }
    result = PyLong_FromUnsignedLongLong((unsigned long long)total);
out:
    PyBuffer_Release(&lb);
    PyBuffer_Release(&nbuf);
    return result;
}

/* ------------------------------------------------------------- plan_items */

/*
 * plan_items(item_write_type, ndarray_type, pairs, max_ids, small_ops, writes)
 *     -> (columns: bytearray, total_bytes) or None
 *
 * kvxfer.engine.writeplan.WritePlanner.plan for a write made only of ItemWrites (a
 * request's pages, state slots, aux row), in one call instead of tens of Python and numpy
 * calls. `pairs` maps a group name to (descs, local_items, remote_items), descs a tuple of
 * (lptr, rptr, item_len, memh, ridx) (fastplan.GroupPair.descs). Returns the five op
 * columns (laddr, raddr, nbytes, memh, ridx; uint64, row after row, n ops each) and the
 * bytes they move, in exactly the Python planner's order: every part's ops descriptor-major,
 * runs maximal (consecutive on both sides) and ordered by (source, destination) id; the
 * parts of at most `small_ops` ops first, in write order, then the others in write order.
 *
 * Returns None, having planned nothing, for anything it does not take: `writes` not a list
 * or tuple; a part not exactly of item_write_type; a group missing from `pairs`; ids that
 * are not an int, a list/tuple of exact ints, or a 1-D int64/int32 ndarray (exactly
 * ndarray_type); more than max_ids ids in a part; ids out of range, counts that differ,
 * duplicate destinations. The caller then plans the write in Python, which raises the
 * precise error where the input is bad: this function never raises for bad input (only
 * MemoryError).
 */
typedef struct {
    long long s, d, n; /* a run: n items from source s to destination d */
} plan_run_t;

typedef struct {
    PyObject *descs; /* borrowed from the pairs dict (alive for the call) */
    Py_ssize_t first, runs, ops;
} plan_part_t;

typedef struct {
    long long *src, *dst;
    uint64_t *keys;
    unsigned char *seen;
    Py_ssize_t cap, seen_cap;
    plan_run_t *run; /* every part's runs, part after part */
    Py_ssize_t n_run, run_cap;
    plan_part_t *part;
    Py_ssize_t n_part, part_cap;
} plan_buf_t;

static void plan_buf_free(plan_buf_t *b)
{
    PyMem_Free(b->src);
    PyMem_Free(b->dst);
    PyMem_Free(b->keys);
    PyMem_Free(b->seen);
    PyMem_Free(b->run);
    PyMem_Free(b->part);
}

static int plan_ids_reserve(plan_buf_t *b, Py_ssize_t k)
{
    if (k <= b->cap)
        return 0;
    PyMem_Free(b->src);
    PyMem_Free(b->dst);
    PyMem_Free(b->keys);
    b->src = PyMem_Malloc((size_t)k * sizeof(long long));
    b->dst = PyMem_Malloc((size_t)k * sizeof(long long));
    b->keys = PyMem_Malloc((size_t)k * sizeof(uint64_t));
    if (!b->src || !b->dst || !b->keys) {
        b->cap = 0;
        PyErr_NoMemory();
        return -1;
    }
    b->cap = k;
    return 0;
}

static int plan_grow(void **v, Py_ssize_t *cap, Py_ssize_t need, size_t size)
{
    if (need > *cap) {
        Py_ssize_t want = need * 2 + 16;
        void *grown = PyMem_Realloc(*v, (size_t)want * size);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        *v = grown;
        *cap = want;
    }
    return 0;
}

/* How many ids `o` holds (-1: not taken), without reading them. For an ndarray, `b` is
 * filled (the caller releases it) and *is32 says its width. */
static Py_ssize_t plan_count(PyObject *o, PyTypeObject *nd, Py_buffer *b, int *is32)
{
    b->obj = NULL;
    if (PyLong_CheckExact(o))
        return 1;
    if (PyList_CheckExact(o) || PyTuple_CheckExact(o))
        return PySequence_Fast_GET_SIZE(o);
    if (Py_TYPE(o) == nd) {
        const char *f;
        if (PyObject_GetBuffer(o, b, PyBUF_RECORDS_RO) < 0) {
            PyErr_Clear();
            b->obj = NULL;
            return -1;
        }
        f = b->format == NULL ? "" : b->format;
        if (f[0] == '<' || f[0] == '=')
            f++;
        if (b->ndim == 1 && b->itemsize == 8 && (strcmp(f, "l") == 0 || strcmp(f, "q") == 0)) {
            *is32 = 0;
            return b->shape[0];
        }
        if (b->ndim == 1 && b->itemsize == 4 && strcmp(f, "i") == 0) {
            *is32 = 1;
            return b->shape[0];
        }
        PyBuffer_Release(b);
        b->obj = NULL;
    }
    return -1;
}

/* The k ids of `o` (counted by plan_count) into out; 0, or -1: not taken (not exact ints,
 * out of [0, limit)); *up: strictly increasing. */
static int plan_read(PyObject *o, Py_buffer *b, int is32, Py_ssize_t k, long long limit,
                     long long *out, int *up)
{
    Py_ssize_t i;
    *up = 1;
    if (b->obj != NULL) {
        const char *base = b->buf;
        Py_ssize_t st = b->strides[0];
        for (i = 0; i < k; i++)
            out[i] = is32 ? (long long)*(const int32_t *)(base + i * st)
                          : *(const long long *)(base + i * st);
    } else if (PyLong_CheckExact(o)) {
        int overflow = 0;
        out[0] = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow || (out[0] == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return -1;
        }
    } else {
        for (i = 0; i < k; i++) {
            PyObject *v = PySequence_Fast_GET_ITEM(o, i);
            int overflow = 0;
            if (!PyLong_CheckExact(v))
                return -1;
            out[i] = PyLong_AsLongLongAndOverflow(v, &overflow);
            if (overflow || (out[i] == -1 && PyErr_Occurred())) {
                PyErr_Clear();
                return -1;
            }
        }
    }
    for (i = 0; i < k; i++) {
        if (out[i] < 0 || out[i] >= limit)
            return -1;
        if (i && out[i] <= out[i - 1])
            *up = 0;
    }
    return 0;
}

/* ascending uint64 keys: quicksort (median of three) down to insertion sort, no callback */
static void plan_sort(uint64_t *a, Py_ssize_t n)
{
    while (n > 16) {
        uint64_t x = a[0], y = a[n / 2], z = a[n - 1], piv, t;
        Py_ssize_t i = 0, j = n - 1;
        piv = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        for (;;) {
            while (a[i] < piv)
                i++;
            while (a[j] > piv)
                j--;
            if (i >= j)
                break;
            t = a[i];
            a[i] = a[j];
            a[j] = t;
            i++;
            j--;
        }
        /* [0, j] <= piv <= [j + 1, n): recurse into the smaller side */
        if (j + 1 < n - j - 1) {
            plan_sort(a, j + 1);
            a += j + 1;
            n -= j + 1;
        } else {
            plan_sort(a + j + 1, n - j - 1);
            n = j + 1;
        }
    }
    for (Py_ssize_t i = 1; i < n; i++) {
        uint64_t v = a[i];
        Py_ssize_t j = i;
        while (j > 0 && a[j - 1] > v) {
            a[j] = a[j - 1];
            j--;
        }
        a[j] = v;
    }
}

/* Whether the k destinations (in [0, limit)) are distinct; -1: no memory (error set) */
static int plan_distinct(plan_buf_t *b, Py_ssize_t k, long long limit)
{
    Py_ssize_t i, bytes = (Py_ssize_t)((limit + 7) / 8);
    if (bytes <= 4096 || bytes <= 16 * k) { /* a bitmap of the destination items */
        if (plan_grow((void **)&b->seen, &b->seen_cap, bytes, 1) < 0)
            return -1;
        memset(b->seen, 0, (size_t)bytes);
        for (i = 0; i < k; i++) {
            long long d = b->dst[i];
            unsigned char bit = (unsigned char)(1u << (d & 7));
            if (b->seen[d >> 3] & bit)
                return 0;
            b->seen[d >> 3] |= bit;
        }
        return 1;
    }
    for (i = 0; i < k; i++)
        b->keys[i] = (uint64_t)b->dst[i];
    plan_sort(b->keys, k);
    for (i = 1; i < k; i++)
        if (b->keys[i] == b->keys[i - 1])
            return 0;
    return 1;
}

/* Append one part's maximal runs, ordered by (source, destination), to b->run: 0, -1 not
 * taken (ids too large to sort as one key), -2 error set */
static int plan_runs(plan_buf_t *b, Py_ssize_t k, int s_up)
{
    Py_ssize_t i, first = b->n_run;
    plan_run_t *r;
    if (plan_grow((void **)&b->run, &b->run_cap, b->n_run + k, sizeof(plan_run_t)) < 0)
        return -2;
    if (!s_up && k > 1) { /* sort (s, d) as one key: both below 2^31 */
        for (i = 0; i < k; i++) {
            if (b->src[i] >= (1LL << 31) || b->dst[i] >= (1LL << 31))
                return -1;
            b->keys[i] = ((uint64_t)b->src[i] << 32) | (uint64_t)b->dst[i];
        }
        plan_sort(b->keys, k);
        for (i = 0; i < k; i++) {
            b->src[i] = (long long)(b->keys[i] >> 32);
            b->dst[i] = (long long)(b->keys[i] & 0xffffffffu);
        }
    }
    r = b->run + first;
    for (i = 0; i < k; i++) {
        if (r > b->run + first && b->src[i] == r[-1].s + r[-1].n && b->dst[i] == r[-1].d + r[-1].n) {
            r[-1].n++;
        } else {
            r->s = b->src[i];
            r->d = b->dst[i];
            r->n = 1;
            r++;
        }
    }
    b->n_run = r - b->run;
    return 0;
}

/* Write the ops of `p` into the five columns (n rows each) at row `at`; -1: a descriptor
 * that is not five ints (not taken) */
static int plan_emit(const plan_buf_t *b, const plan_part_t *p, uint64_t *col, Py_ssize_t n,
                     Py_ssize_t at, uint64_t *total)
{
    Py_ssize_t j, r, nd = PyTuple_GET_SIZE(p->descs);
    const plan_run_t *run = b->run + p->first;
    for (j = 0; j < nd; j++) {
        PyObject *dsc = PyTuple_GET_ITEM(p->descs, j);
        unsigned long long v[5];
        int i;
        if (!PyTuple_CheckExact(dsc) || PyTuple_GET_SIZE(dsc) != 5)
            return -1;
        for (i = 0; i < 5; i++) {
            v[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(dsc, i));
            if (v[i] == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                return -1;
            }
        }
        for (r = 0; r < p->runs; r++, at++) {
            uint64_t nb = (uint64_t)run[r].n * v[2];
            col[at] = v[0] + (uint64_t)run[r].s * v[2];
            col[n + at] = v[1] + (uint64_t)run[r].d * v[2];
            col[2 * n + at] = nb;
            col[3 * n + at] = v[3];
            col[4 * n + at] = v[4];
            *total += nb;
        }
    }
    return 0;
}

static PyObject *py_plan_items(PyObject *self, PyObject *args)
{
    PyObject *writes, *iw_type, *nd_type, *pairs, *cols = NULL, *out = NULL;
    Py_ssize_t max_ids, small_ops, n_parts, p, n_small = 0, n_big = 0;
    plan_buf_t b;
    uint64_t total = 0;
    int rc = 0;
    static PyObject *s_group, *s_src, *s_dst;

    if (s_group == NULL) {
        s_group = PyUnicode_InternFromString("group");
        s_src = PyUnicode_InternFromString("src_items");
        s_dst = PyUnicode_InternFromString("dst_items");
        if (s_group == NULL || s_src == NULL || s_dst == NULL)
            return NULL;
    }
    if (!PyArg_ParseTuple(args, "OO!O!nnO", &iw_type, &PyType_Type, &nd_type, &PyDict_Type,
                          &pairs, &max_ids, &small_ops, &writes))
        return NULL;
    if (!PyList_CheckExact(writes) && !PyTuple_CheckExact(writes))
        Py_RETURN_NONE;
    memset(&b, 0, sizeof(b));
    n_parts = PySequence_Fast_GET_SIZE(writes);
    if (plan_grow((void **)&b.part, &b.part_cap, n_parts, sizeof(plan_part_t)) < 0)
        rc = -2;
    for (p = 0; p < n_parts && rc == 0; p++) {
        PyObject *w = PySequence_Fast_GET_ITEM(writes, p);
        PyObject *group, *pair, *descs, *so = NULL, *dobj = NULL;
        Py_buffer sb, db;
        int s32 = 0, d32 = 0, s_up, d_up;
        Py_ssize_t k, kd;
        long long n_local, n_remote;

        sb.obj = db.obj = NULL;
        if ((PyObject *)Py_TYPE(w) != iw_type) {
            rc = -1;
            break;
        }
        group = PyObject_GetAttr(w, s_group);
        pair = group == NULL ? NULL : PyDict_GetItemWithError(pairs, group); /* borrowed */
        Py_XDECREF(group);
        if (pair == NULL || !PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 3) {
            PyErr_Clear();
            rc = -1;
            break;
        }
        descs = PyTuple_GET_ITEM(pair, 0);
        n_local = PyLong_AsLongLong(PyTuple_GET_ITEM(pair, 1));
        n_remote = PyLong_AsLongLong(PyTuple_GET_ITEM(pair, 2));
        if (!PyTuple_CheckExact(descs) || PyErr_Occurred()) {
            PyErr_Clear();
            rc = -1;
            break;
        }
        so = PyObject_GetAttr(w, s_src);
        dobj = so == NULL ? NULL : PyObject_GetAttr(w, s_dst);
        if (dobj == NULL) {
            PyErr_Clear();
            rc = -1;
        } else {
            k = plan_count(so, (PyTypeObject *)nd_type, &sb, &s32);
            kd = k < 0 ? -1 : plan_count(dobj, (PyTypeObject *)nd_type, &db, &d32);
            if (kd < 0 || kd != k || k > max_ids)
                rc = -1;
            else if (plan_ids_reserve(&b, k) < 0)
                rc = -2;
            else if (plan_read(so, &sb, s32, k, n_local, b.src, &s_up) < 0 ||
                     plan_read(dobj, &db, d32, k, n_remote, b.dst, &d_up) < 0)
                rc = -1;
            else {
                int distinct = d_up || k < 2 ? 1 : plan_distinct(&b, k, n_remote);
                Py_ssize_t first = b.n_run;
                if (distinct < 0)
                    rc = -2;
                else if (!distinct)
                    rc = -1;
                else if ((rc = plan_runs(&b, k, s_up)) == 0) {
                    plan_part_t *pt = &b.part[b.n_part++];
                    pt->descs = descs;
                    pt->first = first;
                    pt->runs = b.n_run - first;
                    pt->ops = pt->runs * PyTuple_GET_SIZE(descs);
                    if (pt->ops <= small_ops)
                        n_small += pt->ops;
                    else
                        n_big += pt->ops;
                }
            }
        }
        if (sb.obj != NULL)
            PyBuffer_Release(&sb);
        if (db.obj != NULL)
            PyBuffer_Release(&db);
        Py_XDECREF(so);
        Py_XDECREF(dobj);
    }
    if (rc == 0) { /* the parts of at most small_ops ops first, then the others */
        Py_ssize_t n = n_small + n_big, at_small = 0, at_big = n_small;
        cols = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(5 * n * sizeof(uint64_t)));
        if (cols == NULL)
            rc = -2;
        for (p = 0; p < b.n_part && rc == 0; p++) {
            plan_part_t *pt = &b.part[p];
            Py_ssize_t *at = pt->ops <= small_ops ? &at_small : &at_big;
            rc = plan_emit(&b, pt, (uint64_t *)PyByteArray_AS_STRING(cols), n, *at, &total);
            *at += pt->ops;
        }
        if (rc == 0)
            out = Py_BuildValue("(NK)", cols, (unsigned long long)total);
        else
            Py_XDECREF(cols);
    }
    plan_buf_free(&b);
    if (rc == -1)
        Py_RETURN_NONE;
    return out; /* NULL with an error set: MemoryError */
}

/* ------------------------------------------------------------ ep_info etc. */

static PyObject *py_ep_info(PyObject *self, PyObject *args)
{
    PyObject *ep_o, *out;
    ucp_ep_h ep;
    char *buf  = NULL;
    size_t len = 0;
    FILE *f;
    if (!PyArg_ParseTuple(args, "O", &ep_o))
        return NULL;
    if (get_handle(ep_o, (void **)&ep, "endpoint") < 0)
        return NULL;
    f = open_memstream(&buf, &len);
    if (f == NULL)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_BEGIN_ALLOW_THREADS
    ucp_ep_print_info(ep, f);
    Py_END_ALLOW_THREADS
    fclose(f);
    out = PyUnicode_DecodeUTF8(buf, (Py_ssize_t)len, "replace");
    free(buf);
    return out;
}

static PyObject *py_status_string(PyObject *self, PyObject *args)
{
    int st;
    if (!PyArg_ParseTuple(args, "i", &st))
        return NULL;
    return PyUnicode_FromString(ucs_status_string((ucs_status_t)st));
}

static PyObject *py_ucx_version(PyObject *self, PyObject *noargs)
{
    unsigned major, minor, release;
    ucp_get_version(&major, &minor, &release);
    return Py_BuildValue("(III)", major, minor, release);
}

/* ----------------------------------------------------------- completions */

typedef struct {
    uint64_t token;
    int status;
    double t; /* CLOCK_MONOTONIC seconds when UCX reported it (= Python's time.monotonic) */
    void *data; /* a received notification's payload (malloc'd), else NULL */
    size_t len;
} cq_item_t;

typedef struct {
    pthread_mutex_t mu;
    int fd;       /* eventfd, -1 once closed */
    int refs;     /* Python object + in-flight requests */
    cq_item_t *items;
    size_t n, cap;
    /* poller: wakes UCXX's progress thread on `worker` while spinning > 0 (spin flushes in
     * flight), every signal_ns; `pushes` counts queued items (its backoff clock) */
    ucp_worker_h worker;
    long spinning;
    long signal_ns;
    unsigned long pushes;
    /* own worker (made when the queue gets a context): bulk endpoints live on it and only
     * kvxfer's threads progress it (the queue's thread, a chain's starter inline) */
    ucp_worker_h own;
    int own_efd;   /* its event fd, -1 without UCP_FEATURE_WAKEUP (then it is polled) */
    long inflight; /* flushes / chains / closes whose callback has not run (timeout tick) */
    int stop, thread_live;
    pthread_t thread;
    pthread_cond_t cv;
    /* deliver (set_deliver): a Python callable the own worker's thread calls, holding the
     * GIL, after its progress queued something (set and cleared holding the GIL); its
     * pushes then signal the eventfd only for what the call left queued (`deferred`: such a
     * push happened since the last call) */
    PyObject *deliver;
    int deferred;
    /* linger (set_linger): how long after its last productive progress call the own
     * worker's thread, with nothing in flight, waits on its armed event fd without sleeping
     * (poll with a zero timeout) before it sleeps on it; 0 = sleep at once. `sleeps` counts
     * its sleeps. */
    long linger_ns;
    int linger_yield; /* sched_yield() between the linger's polls */
    unsigned long sleeps;
} cq_core_t;

/* the queue whose own worker this thread progresses (its thread: cq_own_main), and the
 * Python thread state it keeps for its deliver calls (cq_own_deliver; released when the
 * thread ends: cq_own_exit) */
static __thread cq_core_t *tl_own_core;
static __thread PyThreadState *tl_tstate;
static __thread PyGILState_STATE tl_gstate;

static void cq_own_exit(void)
{
    if (tl_tstate != NULL) {
        PyEval_RestoreThread(tl_tstate);
        PyGILState_Release(tl_gstate); /* deletes the thread state */
        tl_tstate = NULL;
    }
}

typedef struct {
    cq_core_t *core;
    uint64_t token;
    int spin;
} cq_req_t;

static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void cq_core_unref_locked(cq_core_t *c, int *free_it)
{
    *free_it = (--c->refs == 0);
}

/* A request (flush, chain, close) starts / ends; caller holds c->mu. The first one in
 * flight wakes the own worker's thread, which then sleeps with a 1 ms tick (completions
 * over shared memory and CUDA signal nothing) instead of indefinitely. */
static void cq_req_begin_locked(cq_core_t *c)
{
    c->refs++;
    if (__atomic_fetch_add(&c->inflight, 1, __ATOMIC_ACQ_REL) == 0 && c->own != NULL)
        (void)ucp_worker_signal(c->own);
}

static void cq_core_free(cq_core_t *c);

/* cq_req_begin_locked for a request whose starter may end it inline (flush_notify): counts
 * it without waking the own worker's thread; returns whether it took `inflight` from 0, in
 * which case the starter calls cq_req_wake once the call is over. */
static int cq_req_begin_quiet_locked(cq_core_t *c)
{
    c->refs++;
    if (__atomic_fetch_add(&c->inflight, 1, __ATOMIC_ACQ_REL) != 0 || c->own == NULL)
        return 0;
    c->refs++; /* the starter's, until cq_req_wake: the request may end (and a concurrent
                * close drop the Python object's) before the starter looks at the core */
    return 1;
}

/* The deferred half of cq_req_begin_quiet_locked (called without the lock): wake the own
 * worker's thread only if something is in flight now - it may sleep with no timeout, armed
 * while `inflight` was 0, and a request that went pending (ours, or another's that began
 * while ours counted: its starter saw `inflight` > 0 and left the wake to us) needs it. A
 * request that ended within the call leaves it asleep: no thread switch per inline end. */
static void cq_req_wake(cq_core_t *c)
{
    int free_it = 0;
    if (__atomic_load_n(&c->inflight, __ATOMIC_ACQUIRE) > 0)
        (void)ucp_worker_signal(c->own);
    pthread_mutex_lock(&c->mu);
    cq_core_unref_locked(c, &free_it);
    pthread_mutex_unlock(&c->mu);
    if (free_it)
        cq_core_free(c);
}

static void cq_req_end_locked(cq_core_t *c, int *free_it)
{
    __atomic_fetch_sub(&c->inflight, 1, __ATOMIC_ACQ_REL);
    cq_core_unref_locked(c, free_it);
}

static void cq_core_free(cq_core_t *c)
{
    size_t i;
    for (i = 0; i < c->n; i++)
        free(c->items[i].data);
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c->items);
    free(c);
}

/* Signal the eventfd; caller holds c->mu. Not for a push by the queue's own worker thread
 * while a deliver callable is set: that thread calls it first (cq_own_deliver) and
 * signals only what the call left. */
static void cq_signal_locked(cq_core_t *c)
{
    uint64_t one = 1;
    if (tl_own_core == c && __atomic_load_n(&c->deliver, __ATOMIC_ACQUIRE) != NULL) {
        __atomic_store_n(&c->deferred, 1, __ATOMIC_RELEASE); /* cq_own_deliver signals */
        return;
    }
    if (write(c->fd, &one, sizeof(one)) < 0) { /* counter overflow only: ignore */
    }
}

/* Queue (token, status, payload) and signal the eventfd; caller holds c->mu. The queue
 * owns `data` (malloc'd or NULL) from here on: freed if it cannot be queued. */
static void cq_push_data_locked(cq_core_t *c, uint64_t token, int status, void *data, size_t len)
{
    if (c->fd < 0) {
        free(data);
        return;
    }
    if (c->n == c->cap) {
        size_t cap     = c->cap ? 2 * c->cap : 16;
        cq_item_t *tmp = realloc(c->items, cap * sizeof(*tmp));
        if (tmp != NULL) {
            c->items = tmp;
            c->cap   = cap;
        }
    }
    __atomic_fetch_add(&c->pushes, 1, __ATOMIC_RELAXED);
    if (c->n < c->cap) {
        c->items[c->n].token  = token;
        c->items[c->n].status = status;
        c->items[c->n].t      = mono_now();
        c->items[c->n].data   = data;
        c->items[c->n].len    = len;
        c->n++;
    } else {
        free(data);
    }
    cq_signal_locked(c);
}

/* Queue (token, status) and signal the eventfd; caller holds c->mu. */
static void cq_push_locked(cq_core_t *c, uint64_t token, ucs_status_t status)
{
    if (c->fd < 0)
        return;
    if (c->n == c->cap) {
        size_t cap     = c->cap ? 2 * c->cap : 16;
        cq_item_t *tmp = realloc(c->items, cap * sizeof(*tmp));
        if (tmp != NULL) {
            c->items = tmp;
            c->cap   = cap;
        }
    }
    if (c->n < c->cap) {
        c->items[c->n].token  = token;
        c->items[c->n].status = (int)status;
        c->items[c->n].t      = mono_now();
        c->items[c->n].data   = NULL;
        c->items[c->n].len    = 0;
        c->n++;
    }
    cq_signal_locked(c);
}

/* Called by UCX (any thread); never touches Python. */
static void cq_callback(void *request, ucs_status_t status, void *user)
{
    cq_req_t *r   = (cq_req_t *)user;
    cq_core_t *c  = r->core;
    int free_it   = 0;
    pthread_mutex_lock(&c->mu);
    cq_push_locked(c, r->token, status);
    if (r->spin)
        __atomic_fetch_sub(&c->spinning, 1, __ATOMIC_RELEASE);
    cq_req_end_locked(c, &free_it);
    pthread_mutex_unlock(&c->mu);
    if (free_it)
        cq_core_free(c);
    free(r);
    ucp_request_free(request);
}

/* The poller: while spin flushes are in flight, wake UCXX's progress thread every
 * signal_ns (ucp_worker_signal: it then progresses the worker, which polls the CUDA events
 * that cuda_ipc completions never signal); else sleep. It never progresses the worker
 * itself: whatever progresses it runs UCXX's listener callback, whose endpoint creation
 * waits for UCXX's progress thread, which needs the worker lock the caller holds (a 3 x 3 s
 * stall of every accept). */
static void *cq_poller_main(void *arg)
{
    cq_core_t *c = (cq_core_t *)arg;
    (void)prctl(PR_SET_TIMERSLACK, 1000UL); /* short sleeps stay short (ns) */
    pthread_mutex_lock(&c->mu);
    for (;;) {
        ucp_worker_h w;
        double t0;
        unsigned long seen;
        while (!c->stop && c->spinning <= 0)
            pthread_cond_wait(&c->cv, &c->mu);
        if (c->stop)
            break;
        w    = c->worker;
        seen = c->pushes;
        pthread_mutex_unlock(&c->mu);
        t0 = mono_now(); /* last time something completed */
        while (__atomic_load_n(&c->spinning, __ATOMIC_ACQUIRE) > 0 &&
               !__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE)) {
            unsigned long now_seen = __atomic_load_n(&c->pushes, __ATOMIC_RELAXED);
            double idle;
            struct timespec ts = {0, 0};
            (void)ucp_worker_signal(w); /* no wake-up feature (polling mode): it spins anyway */
            if (now_seen != seen) {
                seen = now_seen;
                t0   = mono_now();
            }
            idle       = mono_now() - t0;
            ts.tv_nsec = idle > 0.1 ? 200000 : idle > 2e-3 ? 10000 : c->signal_ns;
            nanosleep(&ts, NULL);
        }
        pthread_mutex_lock(&c->mu);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* What this thread's progress queued with a deliver callable set (`deferred`): call it,
 * holding the GIL (a few passes while the call's own work queues more); then signal the
 * eventfd if anything is still queued (the callable handles nothing when the loop is busy:
 * the loop then takes it, as without one). Called by cq_own_main between progress calls,
 * never inside one, holding no lock. Returns whether the queue is stopping. */
static int cq_own_deliver(cq_core_t *c)
{
    uint64_t one = 1;
    int pass, free_it = 0;
    if (!__atomic_load_n(&c->deferred, __ATOMIC_ACQUIRE))
        return __atomic_load_n(&c->stop, __ATOMIC_ACQUIRE);
    pthread_mutex_lock(&c->mu);
    c->refs++; /* a close from inside the call must not free the core under this thread */
    pthread_mutex_unlock(&c->mu);
    /* this thread's Python thread state, made once and kept (a new one per call cost
     * more than the call itself); taking the GIL ends this thread if the interpreter is
     * finalizing */
    if (tl_tstate == NULL) {
        tl_gstate = PyGILState_Ensure();
        tl_tstate = PyThreadState_Get();
    } else {
        PyEval_RestoreThread(tl_tstate);
    }
    for (pass = 0; pass < 4; pass++) {
        PyObject *h = c->deliver, *r;
        __atomic_store_n(&c->deferred, 0, __ATOMIC_RELEASE);
        if (h == NULL || __atomic_load_n(&c->stop, __ATOMIC_ACQUIRE))
            break;
        Py_INCREF(h);
        r = PyObject_CallNoArgs(h);
        if (r == NULL)
            PyErr_WriteUnraisable(h);
        Py_XDECREF(r);
        Py_DECREF(h);
        if (!__atomic_load_n(&c->deferred, __ATOMIC_ACQUIRE))
            break;
    }
    (void)PyEval_SaveThread();
    pthread_mutex_lock(&c->mu);
    __atomic_store_n(&c->deferred, 0, __ATOMIC_RELEASE);
    if (c->n > 0 && c->fd >= 0 && write(c->fd, &one, sizeof(one)) < 0) { /* overflow only */
    }
    cq_core_unref_locked(c, &free_it);
    pthread_mutex_unlock(&c->mu);
    if (free_it) { /* closed from inside the call (the thread was detached there) */
        cq_core_free(c);
        return 1;
    }
    return __atomic_load_n(&c->stop, __ATOMIC_ACQUIRE);
}

/* The own worker's thread (queues made with a context): the only thread besides a chain's
 * starter that progresses the own worker. While spin flushes are in flight it progresses
 * it back to back (CUDA events signal nothing), backing off like the poller; otherwise it
 * progresses until idle, arms the worker's event fd and sleeps on it: indefinitely when no
 * request is in flight (an idle engine costs no CPU), else for at most 1 ms (completions
 * over shared memory signal nothing either) - with a linger (set_linger) and nothing in
 * flight, it first polls the armed fd without sleeping until the linger has passed since
 * its last productive progress call, so what arrives within it needs no wake-up (no worker
 * lock is taken meanwhile). cq_req_begin_locked and cq_spin_begin_locked
 * wake it (ucp_worker_signal) when that changes; close() sets stop and wakes it. After
 * every progress call that queued something (whatever it returned), a deliver callable
 * (if set) is called (cq_own_deliver) before the next one. */
static void *cq_own_main(void *arg)
{
    cq_core_t *c       = (cq_core_t *)arg;
    ucp_worker_h w     = c->own;
    int active         = 0;   /* progress did something since last_active was set */
    double last_active = 0.0; /* (linger) the last time it did */
    (void)prctl(PR_SET_TIMERSLACK, 1000UL);
    tl_own_core = c;
    while (!__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE)) {
        if (__atomic_load_n(&c->spinning, __ATOMIC_ACQUIRE) > 0) {
            double t0 = mono_now(); /* last time progress did something */
            while (__atomic_load_n(&c->spinning, __ATOMIC_ACQUIRE) > 0 &&
                   !__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE)) {
                double idle;
                unsigned got = ucp_worker_progress(w);
                /* (a callback may queue in a call that reports no progress) */
                if (cq_own_deliver(c)) {
                    cq_own_exit();
                    return NULL;
                }
                if (got != 0) {
                    t0 = mono_now();
                    continue;
                }
                idle = mono_now() - t0;
                if (idle > 2e-3) {
                    struct timespec ts = {0, idle > 0.1 ? 200000 : 10000};
                    nanosleep(&ts, NULL);
                }
            }
            active = 1; /* a spin flush just ended */
            continue;
        }
        for (;;) { /* what each call queued is handed over at once (cq_own_deliver) */
            unsigned got = ucp_worker_progress(w);
            if (cq_own_deliver(c)) {
                cq_own_exit();
                return NULL;
            }
            if (got == 0)
                break;
            active = 1;
        }
        {
            int busy = __atomic_load_n(&c->inflight, __ATOMIC_ACQUIRE) > 0;
            double linger = 1e-9 * (double)__atomic_load_n(&c->linger_ns, __ATOMIC_RELAXED);
            if (active) {
                last_active = mono_now();
                active      = 0;
            }
            if (c->own_efd >= 0) {
                struct pollfd pfd = {c->own_efd, POLLIN, 0};
                ucs_status_t st   = ucp_worker_arm(w);
                if (st == UCS_ERR_BUSY)
                    continue;
                if (__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE) ||
                    __atomic_load_n(&c->spinning, __ATOMIC_ACQUIRE) > 0)
                    continue;
                if (linger > 0.0 && !busy && mono_now() - last_active < linger) {
                    /* the linger: wait on the armed event fd without sleeping and without
                     * the worker's lock (the loop thread posts on this worker meanwhile);
                     * a new request in flight signals it too (cq_req_begin_locked) */
                    int ready = 0;
                    while (!ready &&
                           mono_now() - last_active <
                               1e-9 * (double)__atomic_load_n(&c->linger_ns, __ATOMIC_RELAXED) &&
                           !__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE) &&
                           __atomic_load_n(&c->spinning, __ATOMIC_ACQUIRE) == 0) {
                        ready = poll(&pfd, 1, 0) > 0;
                        if (!ready && __atomic_load_n(&c->linger_yield, __ATOMIC_RELAXED))
                            sched_yield(); /* the core may be needed (small hosts) */
                    }
                    if (ready || __atomic_load_n(&c->stop, __ATOMIC_ACQUIRE) ||
                        __atomic_load_n(&c->spinning, __ATOMIC_ACQUIRE) > 0)
                        continue;
                }
                __atomic_fetch_add(&c->sleeps, 1, __ATOMIC_RELAXED);
                (void)poll(&pfd, 1, busy ? 1 : -1);
            } else {
                struct timespec ts = {0, busy ? 20000 : 1000000};
                __atomic_fetch_add(&c->sleeps, 1, __ATOMIC_RELAXED);
                nanosleep(&ts, NULL);
            }
        }
    }
    cq_own_exit();
    return NULL;
}

/* Count one more spinner, starting the poller thread on first use; caller holds c->mu.
 * Returns 0, or an errno (nothing counted) when the thread cannot start. */
static int cq_spin_begin_locked(cq_core_t *c)
{
    if (c->own != NULL) { /* its thread runs from the start */
        if (__atomic_fetch_add(&c->spinning, 1, __ATOMIC_RELEASE) == 0)
            (void)ucp_worker_signal(c->own);
        return 0;
    }
    if (!c->thread_live) {
        int err = pthread_create(&c->thread, NULL, cq_poller_main, c);
        if (err != 0)
            return err;
        c->thread_live = 1;
    }
    /* before posting: the callback may run at once on another thread */
    __atomic_fetch_add(&c->spinning, 1, __ATOMIC_RELEASE);
    pthread_cond_signal(&c->cv);
    return 0;
}

typedef struct {
    PyObject_HEAD
    cq_core_t *core;
} CompletionQueue;

static ucs_status_t own_am_handler(ucp_worker_h w);

/* Make the queue's own worker on `context` (thread mode MULTI: the loop thread posts while
 * the queue's thread progresses) and start its thread. Returns 0 or -1 (Python error set). */
static int cq_own_start(cq_core_t *c, ucp_context_h context)
{
    ucp_context_attr_t ca;
    ucp_worker_params_t wp;
    ucs_status_t st;
    int err;
    memset(&ca, 0, sizeof(ca));
    ca.field_mask = UCP_ATTR_FIELD_THREAD_MODE;
    Py_BEGIN_ALLOW_THREADS
    st = ucp_context_query(context, &ca);
    Py_END_ALLOW_THREADS
    if (st != UCS_OK) {
        raise_ucx(st, "ucp_context_query", 0);
        return -1;
    }
    if (ca.thread_mode != UCS_THREAD_MODE_MULTI) { /* workers on several threads need it */
        PyErr_SetString(PyExc_RuntimeError,
                        "the UCP context is not thread-shared (mt_workers_shared): no own worker");
        return -1;
    }
    memset(&wp, 0, sizeof(wp));
    wp.field_mask  = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_MULTI;
    Py_BEGIN_ALLOW_THREADS
    st = ucp_worker_create(context, &wp, &c->own);
    Py_END_ALLOW_THREADS
    if (st != UCS_OK) {
        c->own = NULL;
        raise_ucx(st, "ucp_worker_create", 0);
        return -1;
    }
    if (ucp_worker_get_efd(c->own, &c->own_efd) != UCS_OK)
        c->own_efd = -1;
    st = own_am_handler(c->own);
    if (st == UCS_OK) {
        err = pthread_create(&c->thread, NULL, cq_own_main, c);
        if (err == 0) {
            c->thread_live = 1;
            return 0;
        }
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
    } else {
        raise_ucx(st, "ucp_worker_set_am_recv_handler", 0);
    }
    Py_BEGIN_ALLOW_THREADS
    ucp_worker_destroy(c->own);
    Py_END_ALLOW_THREADS
    c->own = NULL;
    return -1;
}

static int cq_init(CompletionQueue *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"worker", "signal_us", "context", NULL};
    unsigned long long worker = 0, context = 0;
    double signal_us          = 5.0;
    cq_core_t *c;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|KdK", kwlist, &worker, &signal_us, &context))
        return -1;
    if (!(signal_us >= 0.0 && signal_us <= 1000.0)) {
        PyErr_SetString(PyExc_ValueError, "signal_us must be within [0, 1000]");
        return -1;
    }
    if (self->core != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "CompletionQueue already initialised");
        return -1;
    }
    c = calloc(1, sizeof(*c));
    if (c == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    c->fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (c->fd < 0) {
        free(c);
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->refs      = 1;
    c->worker    = (ucp_worker_h)(uintptr_t)worker;
    c->signal_ns = (long)(signal_us * 1000.0);
    c->own_efd   = -1;
    if (context != 0 && cq_own_start(c, (ucp_context_h)(uintptr_t)context) < 0) {
        close(c->fd);
        pthread_cond_destroy(&c->cv);
        pthread_mutex_destroy(&c->mu);
        free(c);
        return -1;
    }
    self->core = c;
    return 0;
}

static int note_remove(cq_core_t *c, uint64_t token);

static void cq_release(CompletionQueue *self)
{
    cq_core_t *c = self->core;
    int free_it  = 0;
    if (c == NULL)
        return;
    self->core = NULL;
    {
        int n = note_remove(c, 0); /* no notification is routed here any more */
        pthread_mutex_lock(&c->mu);
        c->refs -= n;
        pthread_mutex_unlock(&c->mu);
    }
    pthread_mutex_lock(&c->mu);
    if (c->thread_live) { /* stop and join the poller before anything else goes */
        pthread_t th = c->thread;
        __atomic_store_n(&c->stop, 1, __ATOMIC_RELEASE);
        c->thread_live = 0;
        pthread_cond_signal(&c->cv);
        if (c->own != NULL)
            (void)ucp_worker_signal(c->own);
        pthread_mutex_unlock(&c->mu);
        if (pthread_equal(th, pthread_self())) {
            /* released inside its own deliver call (the last reference dropped there): not
             * joined (cq_own_deliver holds a core reference; the thread ends when the call
             * returns), and its worker is left to the process's end, as whatever is still
             * in flight on it (destroying a worker from under its own thread's call
             * stack, with requests pending, aborts inside UCX) */
            pthread_detach(th);
            c->own = NULL;
        } else {
            Py_BEGIN_ALLOW_THREADS
            pthread_join(th, NULL);
            Py_END_ALLOW_THREADS
        }
        pthread_mutex_lock(&c->mu);
    }
    {
        PyObject *h = c->deliver; /* (holding the GIL, as set_deliver) */
        __atomic_store_n(&c->deliver, NULL, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&c->mu);
        Py_XDECREF(h);
        pthread_mutex_lock(&c->mu);
    }
    if (c->own != NULL) {
        /* Endpoints still open on it are destroyed with it; callbacks it runs meanwhile
         * (requests failing) take c->mu and push to the still-open eventfd, and cannot
         * free the core: this object's reference is dropped only below. */
        ucp_worker_h own = c->own;
        pthread_mutex_unlock(&c->mu);
        Py_BEGIN_ALLOW_THREADS
        ucp_worker_destroy(own);
        Py_END_ALLOW_THREADS
        pthread_mutex_lock(&c->mu);
        c->own = NULL;
    }
    if (c->fd >= 0) {
        close(c->fd);
        c->fd = -1;
    }
    cq_core_unref_locked(c, &free_it);
    pthread_mutex_unlock(&c->mu);
    if (free_it)
        cq_core_free(c);
}

static void cq_dealloc(CompletionQueue *self)
{
    cq_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static cq_core_t *cq_core(CompletionQueue *self)
{
    if (self->core == NULL)
        PyErr_SetString(PyExc_ValueError, "CompletionQueue is closed");
    return self->core;
}

/*
 * Start a flush; returns None when pending (token will be drained), else the status.
 * spin: the queue's poller progresses the worker until this flush has called back.
 */
static PyObject *cq_flush(CompletionQueue *self, PyObject *args, int worker)
{
    PyObject *h_o;
    unsigned long long token;
    int spin = 0;
    void *h;
    cq_core_t *c = cq_core(self);
    cq_req_t *r;
    ucp_request_param_t p;
    ucs_status_ptr_t sp;
    if (c == NULL || !PyArg_ParseTuple(args, "OK|p", &h_o, &token, &spin))
        return NULL;
    if (get_handle(h_o, &h, worker ? "worker" : "endpoint") < 0)
        return NULL;
    if (spin && c->worker == NULL) {
        PyErr_SetString(PyExc_ValueError, "spin flush on a CompletionQueue made without a worker");
        return NULL;
    }
    r = malloc(sizeof(*r));
    if (r == NULL)
        return PyErr_NoMemory();
    r->core  = c;
    r->token = token;
    r->spin  = spin;
    pthread_mutex_lock(&c->mu);
    cq_req_begin_locked(c); /* a core reference held by the request until its callback */
    if (spin) {
        int err = cq_spin_begin_locked(c);
        if (err != 0) {
            int f = 0;
            cq_req_end_locked(c, &f);
            pthread_mutex_unlock(&c->mu);
            free(r);
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    pthread_mutex_unlock(&c->mu);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send      = cq_callback;
    p.user_data    = r;
    Py_BEGIN_ALLOW_THREADS
    sp = worker ? ucp_worker_flush_nbx((ucp_worker_h)h, &p) : ucp_ep_flush_nbx((ucp_ep_h)h, &p);
    Py_END_ALLOW_THREADS
    if (sp != NULL && !UCS_PTR_IS_ERR(sp))
        Py_RETURN_NONE; /* the callback owns r and one core reference */
    {
        int free_it = 0;
        pthread_mutex_lock(&c->mu);
        if (spin)
            __atomic_fetch_sub(&c->spinning, 1, __ATOMIC_RELEASE);
        cq_req_end_locked(c, &free_it);
        pthread_mutex_unlock(&c->mu);
        assert(!free_it); /* the Python object still holds a reference */
        free(r);
    }
    return PyLong_FromLong(sp == NULL ? UCS_OK : (long)UCS_PTR_STATUS(sp));
}

static PyObject *cq_ep_flush(CompletionQueue *self, PyObject *args) { return cq_flush(self, args, 0); }

static PyObject *cq_worker_flush(CompletionQueue *self, PyObject *args) { return cq_flush(self, args, 1); }

/*
 * Bulk endpoints (error_mode "none"): created here from the peer's worker address with
 * UCP_ERR_HANDLING_MODE_NONE, which keeps shared-memory (cma) lanes, AND an error handler.
 * Measured with libucx 1.21: with a handler installed, a peer that dies mid-PUT is reported
 * (the handler runs with "Connection reset by remote peer") instead of UCX aborting the
 * process, which is what happens to NONE-mode endpoints without a handler (UCXX creates its
 * error-handling-off endpoints without one). The handler queues (err_token, status).
 */
typedef struct ep_ctx {
    cq_core_t *core;
    uint64_t err_token;
    int refs;    /* ep_create's (dropped by ep_ctx_free) + chains and PUT batches in
                  * flight; under core->mu */
    int closing; /* ep_close was called: a chain completing later sends no notification */
    int put_err; /* the first failure a PUT on the endpoint reported (put_cb; atomic) */
} ep_ctx_t;

/* Drop one reference of an endpoint context; caller holds x->core->mu. Returns whether
 * the core lost its last reference (the caller frees it after unlocking). */
static int ep_ctx_unref_locked(ep_ctx_t *x)
{
    int free_core = 0;
    if (--x->refs == 0) {
        cq_core_unref_locked(x->core, &free_core);
        free(x);
    }
    return free_core;
}

/* Take (n = 1) or drop (n = -1) a reference of x; the caller holds no lock. */
static void ep_ctx_add(ep_ctx_t *x, int n)
{
    cq_core_t *c  = x->core;
    int free_core = 0;
    pthread_mutex_lock(&c->mu);
    if (n > 0)
        x->refs++;
    else
        free_core = ep_ctx_unref_locked(x);
    pthread_mutex_unlock(&c->mu);
    if (free_core)
        cq_core_free(c);
}

/* n of a PUT batch's holds are done; the last one drops the batch's context reference. */
static void put_batch_drop(put_batch_t *pb, long n)
{
    if (__atomic_sub_fetch(&pb->left, n, __ATOMIC_ACQ_REL) == 0) {
        ep_ctx_add(pb->x, -1);
        free(pb);
    }
}

/*
 * A pending PUT on an owned endpoint completed (any thread; never touches Python).
 * A failure is recorded, and every later chain on the endpoint fails (chain_post_am):
 * a transport whose flush does not wait for earlier operations' outcome (cma: its flush
 * marker completes OK after a PUT before it failed, ESRCH from a dead peer) would
 * otherwise report a write into a dead peer as done. UCX also fails the endpoint and
 * calls ep_err_cb, but from a deferred callback: after the flush has completed.
 */
static void put_cb(void *request, ucs_status_t status, void *user)
{
    put_batch_t *pb = (put_batch_t *)user;
    ucp_request_free(request);
    if (status != UCS_OK) {
        int expect = UCS_OK;
        __atomic_compare_exchange_n(&pb->x->put_err, &expect, (int)status, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE);
    }
    put_batch_drop(pb, 1);
}

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    ep_ctx_t *x = (ep_ctx_t *)arg;
    pthread_mutex_lock(&x->core->mu);
    cq_push_locked(x->core, x->err_token, status);
    pthread_mutex_unlock(&x->core->mu);
}

/* ep_create(worker, address, err_token, peer=False) -> (ep, ctx); worker 0: the queue's own
 * worker; peer: error mode PEER (else NONE), the handler reports failures either way */
static PyObject *cq_ep_create(CompletionQueue *self, PyObject *args)
{
    PyObject *w_o;
    Py_buffer addr;
    unsigned long long token;
    void *worker;
    ucp_ep_params_t p;
    ucp_ep_h ep;
    ucs_status_t st;
    ep_ctx_t *x;
    cq_core_t *c = cq_core(self);
    int peer = 0;
    if (c == NULL || !PyArg_ParseTuple(args, "Oy*K|p", &w_o, &addr, &token, &peer))
        return NULL;
    if (PyLong_Check(w_o) && PyLong_AsUnsignedLongLong(w_o) == 0 && c->own != NULL) {
        worker = c->own;
    } else if (get_handle(w_o, &worker, "worker") < 0) {
        PyBuffer_Release(&addr);
        return NULL;
    }
    x = malloc(sizeof(*x));
    if (x == NULL) {
        PyBuffer_Release(&addr);
        return PyErr_NoMemory();
    }
    x->core      = c;
    x->err_token = token;
    x->refs      = 1;
    x->closing   = 0;
    x->put_err   = UCS_OK;
    pthread_mutex_lock(&c->mu);
    c->refs++; /* held by the endpoint context until ep_ctx_free */
    pthread_mutex_unlock(&c->mu);
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.address         = (const ucp_address_t *)addr.buf;
    p.err_mode        = peer ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    p.err_handler.cb  = ep_err_cb;
    p.err_handler.arg = x;
    Py_BEGIN_ALLOW_THREADS
    st = ucp_ep_create((ucp_worker_h)worker, &p, &ep);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&addr);
    if (st != UCS_OK) {
        int free_it = 0;
        pthread_mutex_lock(&c->mu);
        cq_core_unref_locked(c, &free_it);
        pthread_mutex_unlock(&c->mu);
        free(x);
        return raise_ucx(st, "ucp_ep_create", 0);
    }
    return Py_BuildValue("(KK)", (unsigned long long)(uintptr_t)ep,
                         (unsigned long long)(uintptr_t)x);
}

/* ep_close(ep, token, force) -> None if pending (token is drained later), else status */
static PyObject *cq_ep_close(CompletionQueue *self, PyObject *args)
{
    PyObject *ep_o;
    unsigned long long token;
    int force;
    void *ep;
    cq_core_t *c = cq_core(self);
    cq_req_t *r;
    ucp_request_param_t p;
    ucs_status_ptr_t sp;
    unsigned long long ctx = 0;
    if (c == NULL || !PyArg_ParseTuple(args, "OKp|K", &ep_o, &token, &force, &ctx))
        return NULL;
    if (get_handle(ep_o, &ep, "endpoint") < 0)
        return NULL;
    if (ctx != 0) { /* from now on no chain sends a notification on this endpoint */
        pthread_mutex_lock(&c->mu);
        ((ep_ctx_t *)(uintptr_t)ctx)->closing = 1;
        pthread_mutex_unlock(&c->mu);
    }
    r = malloc(sizeof(*r));
    if (r == NULL)
        return PyErr_NoMemory();
    r->core  = c;
    r->token = token;
    r->spin  = 0;
    pthread_mutex_lock(&c->mu);
    cq_req_begin_locked(c);
    pthread_mutex_unlock(&c->mu);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send      = cq_callback;
    p.user_data    = r;
    p.flags        = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    Py_BEGIN_ALLOW_THREADS
    sp = ucp_ep_close_nbx((ucp_ep_h)ep, &p);
    Py_END_ALLOW_THREADS
    if (sp != NULL && !UCS_PTR_IS_ERR(sp))
        Py_RETURN_NONE;
    {
        int free_it = 0;
        pthread_mutex_lock(&c->mu);
        cq_req_end_locked(c, &free_it);
        pthread_mutex_unlock(&c->mu);
        free(r);
    }
    return PyLong_FromLong(sp == NULL ? UCS_OK : (long)UCS_PTR_STATUS(sp));
}

/* ep_ctx_free(ctx): only once the endpoint is closed (no more error callbacks) */
static PyObject *py_ep_ctx_free(PyObject *self, PyObject *args)
{
    PyObject *x_o;
    ep_ctx_t *x;
    int free_it = 0;
    if (!PyArg_ParseTuple(args, "O", &x_o))
        return NULL;
    if (get_handle(x_o, (void **)&x, "endpoint context") < 0)
        return NULL;
    {
        cq_core_t *c = x->core;
        pthread_mutex_lock(&c->mu);
        free_it = ep_ctx_unref_locked(x); /* x may be gone now (no chain holds it) */
        pthread_mutex_unlock(&c->mu);
        if (free_it)
            cq_core_free(c);
    }
    Py_RETURN_NONE;
}

/* ----------------------------------------------- chains: put -> flush -> notify */

/*
 * A chain finishes a write without returning to Python between its steps: flush_notify()
 * starts an endpoint flush whose completion callback (on whichever thread progresses the
 * worker: UCXX's progress thread or the queue's poller) itself sends the notification as
 * a UCP active message (our id KVX_AM_ID, eager, header = the receiver's 64-bit note
 * token) on the same endpoint; the AM's local completion queues (token, status) once.
 * A failed flush queues its status and sends nothing: the notification is only ever sent
 * after UCX reported every earlier PUT on the endpoint remotely complete.
 *
 * Receiving: note_listen(token) routes active messages carrying `token` into this queue
 * as (token, KVX_NOTE, t, payload) (a process-wide registry: UCP has one AM handler per id
 * per worker, and all transports of a process share UCXX's worker).
 */
#define KVX_AM_ID 107 /* our active-message id ('k'); UCXX uses its own */
#define KVX_NOTE 1    /* status of a queued received notification (UCS statuses are <= 0) */
#define KVX_NOTE_OVERSIZE 2 /* a notification over its token's max_len: dropped uncopied */

typedef struct {
    uint64_t token;
    cq_core_t *core;
    size_t max_len; /* 0: no limit; longer payloads queue (token, OVERSIZE) without data */
} note_reg_t;

static pthread_mutex_t g_note_mu = PTHREAD_MUTEX_INITIALIZER;
static note_reg_t *g_notes;
static size_t g_nnotes, g_capnotes;
static ucp_worker_h g_note_workers[16];
static int g_nworkers;

static ucs_status_t note_am_cb(void *arg, const void *header, size_t header_length, void *data,
                               size_t length, const ucp_am_recv_param_t *param)
{
    uint64_t token;
    void *copy;
    size_t i;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) { /* senders force eager: drop it */
        ucp_am_data_release((ucp_worker_h)arg, data);
        return UCS_OK;
    }
    if (header_length != sizeof(token))
        return UCS_OK;
    memcpy(&token, header, sizeof(token));
    pthread_mutex_lock(&g_note_mu);
    for (i = 0; i < g_nnotes; i++)
        if (g_notes[i].token == token) {
            cq_core_t *c = g_notes[i].core;
            if (g_notes[i].max_len && length > g_notes[i].max_len) { /* never copied */
                pthread_mutex_lock(&c->mu);
                cq_push_locked(c, token, (ucs_status_t)KVX_NOTE_OVERSIZE);
                pthread_mutex_unlock(&c->mu);
                break;
            }
            copy = malloc(length ? length : 1); /* non-NULL marks a notification */
            if (copy == NULL)
                break;
            if (length)
                memcpy(copy, data, length);
            pthread_mutex_lock(&c->mu);
            cq_push_data_locked(c, token, KVX_NOTE, copy, length);
            pthread_mutex_unlock(&c->mu);
            break;
        }
    pthread_mutex_unlock(&g_note_mu); /* unknown token (a closed peer's late one): dropped */
    return UCS_OK;
}

/* The notification handler on a queue's own worker (set once, when the worker is made). */
static ucs_status_t own_am_handler(ucp_worker_h w)
{
    ucp_am_handler_param_t hp;
    ucs_status_t st;
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id    = KVX_AM_ID;
    hp.cb    = note_am_cb;
    hp.arg   = w;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    Py_BEGIN_ALLOW_THREADS
    st = ucp_worker_set_am_recv_handler(w, &hp);
    Py_END_ALLOW_THREADS
    return st;
}

/* note_listen(token, max_len=0): notifications carrying `token` are queued here */
static PyObject *cq_note_listen(CompletionQueue *self, PyObject *args)
{
    unsigned long long token, max_len = 0;
    cq_core_t *c = cq_core(self);
    ucs_status_t st = UCS_OK;
    int i, have = 0;
    size_t k;
    if (c == NULL || !PyArg_ParseTuple(args, "K|K", &token, &max_len))
        return NULL;
    if (c->worker == NULL) {
        PyErr_SetString(PyExc_ValueError, "note_listen on a CompletionQueue made without a worker");
        return NULL;
    }
    pthread_mutex_lock(&g_note_mu);
    for (k = 0; k < g_nnotes; k++)
        if (g_notes[k].token == token) {
            pthread_mutex_unlock(&g_note_mu);
            PyErr_SetString(PyExc_ValueError, "note token already registered");
            return NULL;
        }
    for (i = 0; i < g_nworkers; i++)
        have |= g_note_workers[i] == c->worker;
    if (!have) {
        /* Never call into libucp holding g_note_mu: the handler takes it under the worker
         * lock. Two first registrations racing set the same handler twice (harmless). */
        ucp_am_handler_param_t hp;
        if (g_nworkers == (int)(sizeof(g_note_workers) / sizeof(g_note_workers[0]))) {
            pthread_mutex_unlock(&g_note_mu);
            PyErr_SetString(PyExc_RuntimeError, "too many UCP workers");
            return NULL;
        }
        pthread_mutex_unlock(&g_note_mu);
        hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                        UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
        hp.id    = KVX_AM_ID;
        hp.cb    = note_am_cb;
        hp.arg   = c->worker;
        hp.flags = UCP_AM_FLAG_WHOLE_MSG;
        Py_BEGIN_ALLOW_THREADS
        st = ucp_worker_set_am_recv_handler(c->worker, &hp);
        Py_END_ALLOW_THREADS
        if (st != UCS_OK)
            return raise_ucx(st, "ucp_worker_set_am_recv_handler", 0);
        pthread_mutex_lock(&g_note_mu);
        have = 0;
        for (i = 0; i < g_nworkers; i++)
            have |= g_note_workers[i] == c->worker;
        if (!have && g_nworkers < (int)(sizeof(g_note_workers) / sizeof(g_note_workers[0])))
            g_note_workers[g_nworkers++] = c->worker;
        for (k = 0; k < g_nnotes; k++) /* re-check: another thread may have taken it */
            if (g_notes[k].token == token) {
                pthread_mutex_unlock(&g_note_mu);
                PyErr_SetString(PyExc_ValueError, "note token already registered");
                return NULL;
            }
    }
    if (g_nnotes == g_capnotes) {
        size_t cap      = g_capnotes ? 2 * g_capnotes : 16;
        note_reg_t *tmp = realloc(g_notes, cap * sizeof(*tmp));
        if (tmp == NULL) {
            pthread_mutex_unlock(&g_note_mu);
            return PyErr_NoMemory();
        }
        g_notes    = tmp;
        g_capnotes = cap;
    }
    g_notes[g_nnotes].token     = token;
    g_notes[g_nnotes].max_len   = (size_t)max_len;
    g_notes[g_nnotes++].core    = c;
    pthread_mutex_lock(&c->mu);
    c->refs++; /* held by the registry entry */
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_unlock(&g_note_mu);
    Py_RETURN_NONE;
}

/* Remove the registry entries of core `c` (token 0: all of them); returns how many. */
static int note_remove(cq_core_t *c, uint64_t token)
{
    size_t i = 0;
    int n = 0;
    pthread_mutex_lock(&g_note_mu);
    while (i < g_nnotes) {
        if (g_notes[i].core == c && (token == 0 || g_notes[i].token == token)) {
            g_notes[i] = g_notes[--g_nnotes];
            n++;
        } else {
            i++;
        }
    }
    pthread_mutex_unlock(&g_note_mu);
    return n;
}

/* note_limit(token, max_len) -> bool: change a registered token's size limit (0: none) */
static PyObject *cq_note_limit(CompletionQueue *self, PyObject *args)
{
    unsigned long long token, max_len;
    cq_core_t *c = cq_core(self);
    size_t i;
    int found = 0;
    if (c == NULL || !PyArg_ParseTuple(args, "KK", &token, &max_len))
        return NULL;
    pthread_mutex_lock(&g_note_mu);
    for (i = 0; i < g_nnotes; i++)
        if (g_notes[i].core == c && g_notes[i].token == token) {
            g_notes[i].max_len = (size_t)max_len;
            found = 1;
            break;
        }
    pthread_mutex_unlock(&g_note_mu);
    return PyBool_FromLong(found);
}

/* note_unlisten(token) -> bool: stop routing `token` here (late ones are dropped) */
static PyObject *cq_note_unlisten(CompletionQueue *self, PyObject *args)
{
    unsigned long long token;
    cq_core_t *c = cq_core(self);
    int n;
    if (c == NULL || !PyArg_ParseTuple(args, "K", &token))
        return NULL;
    if (token == 0)
        return PyBool_FromLong(0);
    n = note_remove(c, token);
    pthread_mutex_lock(&c->mu);
    c->refs -= n; /* the Python object still holds one: never reaches 0 here */
    pthread_mutex_unlock(&c->mu);
    return PyBool_FromLong(n > 0);
}

typedef struct {
    cq_core_t *core;
    ep_ctx_t *x; /* owned endpoint's context (closing flag), or NULL (borrowed endpoint) */
    ucp_ep_h ep;
    uint64_t token;
    int spin;
    uint64_t hdr; /* the receiver's note token: the AM header */
    int state;    /* CH_* (atomic): who ends the chain, the starter or a callback */
    int final;    /* the chain's status, when a callback left it to the starter */
    size_t len;
    char data[];
} chain_t;

/* A chain's starter may wait for it for a bounded time (inline_us): while it does
 * (CH_STARTER), a completing callback leaves the result to it (CH_DONE) instead of
 * queueing it, so a chain that completes meanwhile returns to Python in the same call. */
enum { CH_STARTER = 0, CH_QUEUE = 1, CH_DONE = 2 };

/* Release a chain; push (token, st) unless the starter returns st itself. */
static void chain_release(chain_t *ch, int push, ucs_status_t st)
{
    cq_core_t *c  = ch->core;
    int free_core = 0, free2 = 0;
    pthread_mutex_lock(&c->mu);
    if (push)
        cq_push_locked(c, ch->token, st);
    if (ch->spin)
        __atomic_fetch_sub(&c->spinning, 1, __ATOMIC_RELEASE);
    cq_req_end_locked(c, &free_core); /* the chain's own; x (if any) still holds one */
    if (ch->x != NULL)
        free2 = ep_ctx_unref_locked(ch->x);
    pthread_mutex_unlock(&c->mu);
    if (free_core || free2)
        cq_core_free(c);
    free(ch);
}

/* A callback ends the chain: hand the status to a starter still progressing, else queue. */
static void chain_end(chain_t *ch, ucs_status_t st)
{
    int expect = CH_STARTER;
    ch->final  = (int)st;
    if (__atomic_compare_exchange_n(&ch->state, &expect, CH_DONE, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE))
        return; /* the starter releases it */
    chain_release(ch, 1, st);
}

static void chain_am_cb(void *request, ucs_status_t st, void *user)
{
    ucp_request_free(request);
    chain_end((chain_t *)user, st);
}

/* Post the notification (none for a plain flush). Returns 1 if pending (chain_am_cb
 * releases the chain), else 0 with *st set (the caller releases it): an owned endpoint
 * on which a PUT failed (put_cb) fails the chain, a plain flush included. Runs with the
 * worker lock held (inside a flush callback) or on the thread that started the chain;
 * ep_close runs on that thread too and needs the worker lock, so `closing` cannot change
 * between the check and the post. */
static int chain_post_am(chain_t *ch, ucs_status_t *st)
{
    ucp_request_param_t p;
    ucs_status_ptr_t sp;
    int closing = 0, put_failed = 0;
    if (ch->x != NULL) {
        pthread_mutex_lock(&ch->core->mu);
        closing    = ch->x->closing;
        put_failed = __atomic_load_n(&ch->x->put_err, __ATOMIC_ACQUIRE) != UCS_OK;
        pthread_mutex_unlock(&ch->core->mu);
    }
    if (put_failed) { /* UCX fails the endpoint (and calls its handler, later): so does the chain */
        *st = UCS_ERR_CONNECTION_RESET;
        return 0;
    }
    if (ch->hdr == 0) { /* a plain flush: nothing to send */
        *st = UCS_OK;
        return 0;
    }
    if (closing) {
        *st = UCS_ERR_CANCELED;
        return 0;
    }
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send   = chain_am_cb;
    p.user_data = ch;
    p.flags     = UCP_AM_SEND_FLAG_EAGER;
    sp = ucp_am_send_nbx(ch->ep, KVX_AM_ID, &ch->hdr, sizeof(ch->hdr), ch->data, ch->len, &p);
    if (sp != NULL && !UCS_PTR_IS_ERR(sp))
        return 1;
    *st = sp == NULL ? UCS_OK : UCS_PTR_STATUS(sp);
    return 0;
}

/* The chain's flush completed (any thread): notify, or report the flush's failure. */
static void chain_flush_cb(void *request, ucs_status_t st, void *user)
{
    chain_t *ch = (chain_t *)user;
    ucp_request_free(request);
    if (st == UCS_OK && chain_post_am(ch, &st))
        return;
    chain_end(ch, st);
}

/*
 * flush_notify(ep, token, spin, ctx, note_token, payload, inline_us=0, noflush=0, keep=0,
 *              yield_idle=0) -> None if pending
 * (token appears in drain() once the notification completed locally or the chain failed),
 * else the final ucs status (the chain ended within the call). inline_us: wait on the
 * calling thread (GIL released) for up to that long first, signalling the worker every
 * signal_ns so that UCXX's progress thread progresses it; a flush whose completion signals
 * nothing (shared memory, CUDA events) then ends in microseconds instead of at the progress
 * thread's next wake-up, and the loop sees no completion event at all.
 * note_token 0: a plain flush (nothing is sent), with the same inline wait.
 * noflush: send the notification now, without flushing first (a channel frame: UcxChannel;
 * the AM is still ordered after earlier AMs on the endpoint).
 * yield_idle: while waiting inline on the own worker, sched_yield() after every progress
 * call that did nothing (on a host of few CPUs the threads this one waits for — the own
 * worker's, the peer's — get the CPU instead of a spinning starter).
 */
static PyObject *cq_flush_notify(CompletionQueue *self, PyObject *args)
{
    PyObject *ep_o;
    unsigned long long token, ctx, note;
    int spin;
    Py_buffer pl;
    void *ep;
    chain_t *ch;
    ucp_request_param_t p;
    ucs_status_ptr_t sp;
    ucs_status_t st = UCS_OK;
    int pending     = 0;
    double inline_us = 0.0;
    int noflush      = 0;
    int wake         = 0;
    int keep         = 0;
    int yield_idle   = 0;
    PyThreadState *ts;
    cq_core_t *c    = cq_core(self);
    if (c == NULL || !PyArg_ParseTuple(args, "OKpKKy*|dppp", &ep_o, &token, &spin, &ctx, &note,
                                       &pl, &inline_us, &noflush, &keep, &yield_idle))
        return NULL;
    if (get_handle(ep_o, &ep, "endpoint") < 0) {
        PyBuffer_Release(&pl);
        return NULL;
    }
    if (spin && c->worker == NULL) {
        PyBuffer_Release(&pl);
        PyErr_SetString(PyExc_ValueError, "spin flush on a CompletionQueue made without a worker");
        return NULL;
    }
    ch = malloc(sizeof(*ch) + (size_t)pl.len);
    if (ch == NULL) {
        PyBuffer_Release(&pl);
        return PyErr_NoMemory();
    }
    ch->core  = c;
    ch->x     = (ep_ctx_t *)(uintptr_t)ctx;
    ch->ep    = (ucp_ep_h)ep;
    ch->token = token;
    ch->spin  = spin;
    ch->hdr   = note;
    ch->state = CH_STARTER;
    ch->final = UCS_OK;
    ch->len   = (size_t)pl.len;
    memcpy(ch->data, pl.buf, (size_t)pl.len);
    PyBuffer_Release(&pl);
    pthread_mutex_lock(&c->mu);
    if (ch->x != NULL && ch->x->closing && note != 0) {
        pthread_mutex_unlock(&c->mu);
        free(ch);
        return PyLong_FromLong(UCS_ERR_CANCELED);
    }
    /* a core reference held by the chain until it is released. A chain this call may end
     * itself (a bare notification; or an inline wait, which progresses the worker here)
     * wakes the own worker's thread after the call (cq_req_wake), not now: that thread
     * need not race the inline progress, nor wake at all for a chain that ended inline.
     * Any other wakes it now, to take the completion while this thread goes back to Python
     * (later, its completion wake-up took 3x longer: bench/results/sgl-latency-cpu.md). */
    if (noflush || inline_us > 0)
        wake = cq_req_begin_quiet_locked(c);
    else
        cq_req_begin_locked(c);
    if (ch->x != NULL)
        ch->x->refs++;
    if (spin) {
        int err = cq_spin_begin_locked(c);
        if (err != 0) {
            int f = 0;
            __atomic_fetch_sub(&c->inflight, 1, __ATOMIC_ACQ_REL);
            c->refs--;
            if (ch->x != NULL)
                f = ep_ctx_unref_locked(ch->x);
            pthread_mutex_unlock(&c->mu);
            (void)f; /* the Python object holds a core reference */
            if (wake)
                cq_req_wake(c); /* another request may have begun behind our count */
            free(ch);
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    pthread_mutex_unlock(&c->mu);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send      = chain_flush_cb;
    p.user_data    = ch;
    /* keep: the GIL stays held (as put_batch's keep_gil), honoured only for an endpoint of
     * the own worker, whose lock no thread holds while it waits for the GIL */
    ts = (keep && ch->x != NULL && c->own != NULL) ? NULL : PyEval_SaveThread();
    sp = noflush ? NULL : ucp_ep_flush_nbx((ucp_ep_h)ep, &p);
    if (sp != NULL && !UCS_PTR_IS_ERR(sp))
        pending = 1; /* chain_flush_cb owns the chain */
    else if (sp != NULL)
        st = UCS_PTR_STATUS(sp);
    else
        pending = chain_post_am(ch, &st);
    if (pending && inline_us > 0 && ch->x != NULL && c->own != NULL) {
        /* an endpoint of the own worker (ep_create): progress it here (no UCXX callback
         * can run on it) */
        double until = mono_now() + 1e-6 * inline_us;
        while (__atomic_load_n(&ch->state, __ATOMIC_ACQUIRE) == CH_STARTER &&
               mono_now() < until)
            if (!ucp_worker_progress(c->own) && yield_idle)
                sched_yield();
    } else if (pending && inline_us > 0 && c->worker != NULL) {
        /* UCXX's worker: wait here (never progress it here: see cq_poller_main), waking
         * UCXX's progress thread every signal_ns meanwhile */
        double now = mono_now(), until = now + 1e-6 * inline_us, next = now;
        while (__atomic_load_n(&ch->state, __ATOMIC_ACQUIRE) == CH_STARTER && now < until) {
            if (now >= next) {
                (void)ucp_worker_signal(c->worker);
                next = now + 1e-9 * (double)c->signal_ns;
            }
            sched_yield(); /* the progress thread may need this core (small hosts) */
            now = mono_now();
        }
    }
    if (pending) {
        int expect = CH_STARTER; /* give the chain to the callbacks, unless one ended it */
        if (!__atomic_compare_exchange_n(&ch->state, &expect, CH_QUEUE, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE)) {
            pending = 0;
            st      = (ucs_status_t)ch->final;
        }
    }
    if (!pending)
        chain_release(ch, 0, st);
    if (wake)
        cq_req_wake(c);
    if (ts != NULL)
        PyEval_RestoreThread(ts);
    if (pending)
        Py_RETURN_NONE;
    return PyLong_FromLong((long)st);
}

static PyObject *cq_drain(CompletionQueue *self, PyObject *noargs)
{
    cq_core_t *c = cq_core(self);
    cq_item_t *items;
    size_t n, i;
    uint64_t v;
    PyObject *out;
    if (c == NULL)
        return NULL;
    pthread_mutex_lock(&c->mu);
    if (read(c->fd, &v, sizeof(v)) < 0) { /* EAGAIN: nothing signalled yet */
    }
    items    = c->items;
    n        = c->n;
    c->items = NULL;
    c->n = c->cap = 0;
    pthread_mutex_unlock(&c->mu);
    out = PyList_New((Py_ssize_t)n);
    for (i = 0; out != NULL && i < n; i++) {
        PyObject *t;
        if (items[i].data != NULL)
            t = Py_BuildValue("(Kidy#)", (unsigned long long)items[i].token, items[i].status,
                              items[i].t, (const char *)items[i].data, (Py_ssize_t)items[i].len);
        else
            t = Py_BuildValue("(KidO)", (unsigned long long)items[i].token, items[i].status,
                              items[i].t, Py_None);
        if (t == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, t);
    }
    for (i = 0; i < n; i++)
        free(items[i].data);
    free(items);
    return out;
}

static PyObject *cq_fileno(CompletionQueue *self, PyObject *noargs)
{
    cq_core_t *c = cq_core(self);
    return c == NULL ? NULL : PyLong_FromLong(c->fd);
}

/* set_deliver(fn or None): see cq_core_t.deliver. Only queues made with a context (an
 * own worker) have the thread that calls it. */
static PyObject *cq_set_deliver(CompletionQueue *self, PyObject *fn)
{
    PyObject *old;
    cq_core_t *c = cq_core(self);
    if (c == NULL)
        return NULL;
    if (fn != Py_None && !PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "set_deliver takes a callable or None");
        return NULL;
    }
    if (fn != Py_None && c->own == NULL) {
        PyErr_SetString(PyExc_ValueError, "set_deliver needs a queue with an own worker");
        return NULL;
    }
    old = c->deliver;
    if (fn == Py_None) {
        __atomic_store_n(&c->deliver, NULL, __ATOMIC_RELEASE);
    } else {
        Py_INCREF(fn);
        __atomic_store_n(&c->deliver, fn, __ATOMIC_RELEASE);
    }
    Py_XDECREF(old);
    if (fn == Py_None) { /* what a deferred push left: the loop takes it */
        uint64_t one = 1;
        pthread_mutex_lock(&c->mu);
        if (c->n > 0 && c->fd >= 0 && write(c->fd, &one, sizeof(one)) < 0) {
        }
        pthread_mutex_unlock(&c->mu);
    }
    Py_RETURN_NONE;
}

static PyObject *cq_close(CompletionQueue *self, PyObject *noargs)
{
    cq_release(self);
    Py_RETURN_NONE;
}

static PyObject *cq_pending(CompletionQueue *self, void *closure)
{
    long n = 0;
    if (self->core != NULL) {
        pthread_mutex_lock(&self->core->mu);
        n = self->core->refs - 1;
        pthread_mutex_unlock(&self->core->mu);
    }
    return PyLong_FromLong(n);
}

/* queued: completions waiting for drain() (a cheap check before taking the loop's gate:
 * kvxfer.transport.ucx.UcxTransport.completions_queued) */
static PyObject *cq_queued(CompletionQueue *self, void *closure)
{
    size_t n = 0;
    if (self->core != NULL) {
        pthread_mutex_lock(&self->core->mu);
        n = self->core->n;
        pthread_mutex_unlock(&self->core->mu);
    }
    return PyLong_FromSize_t(n);
}

static PyObject *cq_spinning(CompletionQueue *self, void *closure)
{
    long n = 0;
    if (self->core != NULL) {
        pthread_mutex_lock(&self->core->mu);
        n = self->core->spinning;
        pthread_mutex_unlock(&self->core->mu);
    }
    return PyLong_FromLong(n);
}

static PyObject *cq_sleeps(CompletionQueue *self, void *closure)
{
    unsigned long n = 0;
    if (self->core != NULL)
        n = __atomic_load_n(&self->core->sleeps, __ATOMIC_RELAXED);
    return PyLong_FromUnsignedLong(n);
}

/* set_linger(us, yield_idle=False): how long after its last productive progress call the own
 * worker's thread, with nothing in flight, polls its armed event fd without sleeping before
 * it sleeps on it (0: at once, the default); yield_idle: sched_yield() between those polls.
 * Takes effect at its next idle check; ValueError without an own worker or for a negative /
 * non-finite value. */
static PyObject *cq_set_linger(CompletionQueue *self, PyObject *args)
{
    double us;
    int yield_idle = 0;
    cq_core_t *c   = cq_core(self);
    PyObject *arg;
    if (c == NULL || !PyArg_ParseTuple(args, "O|p", &arg, &yield_idle))
        return NULL;
    us = PyFloat_AsDouble(arg);
    if (us == -1.0 && PyErr_Occurred())
        return NULL;
    if (c->own == NULL) {
        PyErr_SetString(PyExc_ValueError, "set_linger on a CompletionQueue without an own worker");
        return NULL;
    }
    if (!(us >= 0.0 && us <= 1e9)) {
        PyErr_Format(PyExc_ValueError, "set_linger(%R): expected 0 <= us <= 1e9", arg);
        return NULL;
    }
    __atomic_store_n(&c->linger_yield, yield_idle, __ATOMIC_RELAXED);
    __atomic_store_n(&c->linger_ns, (long)(us * 1e3), __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

/* spin_hold(on): a test hook. True counts one spinner with no flush behind it (the poller
 * runs as during a spin flush that never completes); False takes it back. */
static PyObject *cq_spin_hold(CompletionQueue *self, PyObject *args)
{
    int on;
    cq_core_t *c = cq_core(self);
    if (c == NULL || !PyArg_ParseTuple(args, "p", &on))
        return NULL;
    if (c->worker == NULL) {
        PyErr_SetString(PyExc_ValueError, "spin_hold on a CompletionQueue made without a worker");
        return NULL;
    }
    pthread_mutex_lock(&c->mu);
    if (on) {
        int err = cq_spin_begin_locked(c);
        if (err != 0) {
            pthread_mutex_unlock(&c->mu);
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    } else if (c->spinning > 0) {
        __atomic_fetch_sub(&c->spinning, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&c->mu);
    Py_RETURN_NONE;
}

/* address() -> bytes: the own worker's address (for the peer's ep_create); ValueError
 * without an own worker */
static PyObject *cq_address(CompletionQueue *self, PyObject *noargs)
{
    cq_core_t *c = cq_core(self);
    ucp_address_t *a;
    size_t len;
    ucs_status_t st;
    PyObject *out;
    if (c == NULL)
        return NULL;
    if (c->own == NULL) {
        PyErr_SetString(PyExc_ValueError, "CompletionQueue made without a context: no own worker");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    st = ucp_worker_get_address(c->own, &a, &len);
    Py_END_ALLOW_THREADS
    if (st != UCS_OK)
        return raise_ucx(st, "ucp_worker_get_address", 0);
    out = PyBytes_FromStringAndSize((const char *)a, (Py_ssize_t)len);
    ucp_worker_release_address(c->own, a);
    return out;
}

static PyObject *cq_own_worker(CompletionQueue *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(
        (unsigned long long)(uintptr_t)(self->core != NULL ? self->core->own : NULL));
}

static PyObject *cq_inflight(CompletionQueue *self, void *closure)
{
    return PyLong_FromLong(self->core != NULL ? self->core->inflight : 0);
}

static PyObject *cq_poller_live(CompletionQueue *self, void *closure)
{
    return PyBool_FromLong(self->core != NULL && self->core->thread_live);
}

static PyMethodDef cq_methods[] = {
    {"ep_flush", (PyCFunction)cq_ep_flush, METH_VARARGS,
     "ep_flush(ep, token, spin=False) -> None if pending (token appears in drain()), else ucs "
     "status; spin: the queue's poller thread progresses the worker until it completes"},
    {"worker_flush", (PyCFunction)cq_worker_flush, METH_VARARGS,
     "worker_flush(worker, token, spin=False) -> None if pending, else ucs status"},
    {"ep_create", (PyCFunction)cq_ep_create, METH_VARARGS,
     "ep_create(worker, address, err_token, peer=False) -> (ep, ctx): bulk endpoint (worker "
     "0: the own worker), error mode NONE (peer: PEER) with an error handler that queues "
     "(err_token, status)"},
    {"ep_close", (PyCFunction)cq_ep_close, METH_VARARGS,
     "ep_close(ep, token, force, ctx=0) -> None if pending, else ucs status; ctx: the "
     "endpoint's ep_create context (no chain sends a notification on it afterwards)"},
    {"flush_notify", (PyCFunction)cq_flush_notify, METH_VARARGS,
     "flush_notify(ep, token, spin, ctx, note_token, payload, inline_us=0, noflush=0, keep=0, "
     "yield_idle=0) -> None if "
     "pending, else ucs status: flush ep, then (from the flush's completion callback, no "
     "Python) send payload as an active message to the receiver's note_token; ctx: "
     "ep_create's context or 0; inline_us: wait here that long first (signalling the worker); "
     "noflush: send without the flush; yield_idle: yield the CPU after idle progress calls "
     "of an inline wait on the own worker"},
    {"note_listen", (PyCFunction)cq_note_listen, METH_VARARGS,
     "note_listen(token, max_len=0): queue notifications carrying token as (token, NOTE, t, "
     "payload); one longer than max_len (0: no limit) as (token, NOTE_OVERSIZE, t, None), "
     "never copied"},
    {"note_limit", (PyCFunction)cq_note_limit, METH_VARARGS,
     "note_limit(token, max_len) -> bool: change a registered token's max_len"},
    {"note_unlisten", (PyCFunction)cq_note_unlisten, METH_VARARGS,
     "note_unlisten(token) -> bool: stop routing token here"},
    {"drain", (PyCFunction)cq_drain, METH_NOARGS,
     "drain() -> [(token, status, t, payload)] completed since the last drain (t: "
     "time.monotonic() when UCX reported it; payload: bytes of a received notification "
     "(status NOTE), else None); clears the eventfd"},
    {"address", (PyCFunction)cq_address, METH_NOARGS,
     "address() -> bytes: the own worker's address (queues made with context=)"},
    {"set_linger", (PyCFunction)cq_set_linger, METH_VARARGS,
     "set_linger(us, yield_idle=False): the own worker's thread polls its armed event fd "
     "without sleeping for us after its last activity before it sleeps (0: at once); "
     "yield_idle: sched_yield() between those polls"},
    {"spin_hold", (PyCFunction)cq_spin_hold, METH_VARARGS,
     "spin_hold(on): test hook; count (True) or uncount (False) a spinner with no flush"},
    {"set_deliver", (PyCFunction)cq_set_deliver, METH_O,
     "set_deliver(fn or None): the own worker's thread calls fn() (no arguments, holding the "
     "GIL) after its progress queued completions, and signals the eventfd only for what "
     "the call left queued"},
    {"fileno", (PyCFunction)cq_fileno, METH_NOARGS, "the eventfd to watch for readability"},
    {"close", (PyCFunction)cq_close, METH_NOARGS,
     "close the eventfd; late callbacks are dropped safely"},
    {NULL}};

static PyGetSetDef cq_getset[] = {
    {"pending", (getter)cq_pending, NULL,
     "requests whose callback has not fired + endpoints not yet freed", NULL},
    {"spinning", (getter)cq_spinning, NULL,
     "spin flushes in flight (the poller progresses the worker while > 0)", NULL},
    {"poller_live", (getter)cq_poller_live, NULL, "whether the poller thread exists", NULL},
    {"own_worker", (getter)cq_own_worker, NULL,
     "the own worker's handle (context= given), else 0", NULL},
    {"inflight", (getter)cq_inflight, NULL, "flushes / chains / closes in flight", NULL},
    {"sleeps", (getter)cq_sleeps, NULL,
     "how often the own worker's thread went to sleep (armed wait or nap)", NULL},
    {"queued", (getter)cq_queued, NULL, "completions waiting for drain()", NULL},
    {NULL}};

static PyTypeObject CompletionQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvxfer.transport._rma.CompletionQueue",
    .tp_basicsize = sizeof(CompletionQueue),
    .tp_flags     = Py_TPFLAGS_DEFAULT,
    .tp_doc       = "CompletionQueue(worker=0): flush completions delivered through an eventfd; "
                    "with a worker handle, spin flushes are progressed by a native poller "
                    "thread (see module doc).",
    .tp_new       = PyType_GenericNew,
    .tp_init      = (initproc)cq_init,
    .tp_dealloc   = (destructor)cq_dealloc,
    .tp_methods   = cq_methods,
    .tp_getset    = cq_getset,
};

/* ------------------------------------------------------------------ module */

/*
 * own_context(options: dict[str, str]) -> int: the process's own UCP context for RMA
 * (features RMA | AM | WAKEUP, thread-shared: every transport's completion queue makes its
 * own worker on it, each progressed on its own thread). Made on the first call with
 * `options` applied over the UCX_* environment (ucp_config_modify); later calls return the
 * same context. It lives as long as the process (like UCXX's), so registrations and
 * workers never outlive it.
 */
static pthread_mutex_t g_ctx_mu = PTHREAD_MUTEX_INITIALIZER;
static ucp_context_h g_own_ctx;

static PyObject *py_own_context(PyObject *self, PyObject *args)
{
    PyObject *opts, *k, *v;
    Py_ssize_t pos = 0, n, i;
    char **kv;
    ucp_config_t *cfg = NULL;
    ucp_params_t p;
    ucs_status_t st = UCS_OK;
    ucp_context_h ctx;
    const char *what = "ucp_init";
    if (!PyArg_ParseTuple(args, "O!", &PyDict_Type, &opts))
        return NULL;
    n  = PyDict_Size(opts);
    kv = calloc((size_t)(2 * n + 1), sizeof(char *));
    if (kv == NULL)
        return PyErr_NoMemory();
    for (i = 0; PyDict_Next(opts, &pos, &k, &v); i++) { /* copied: the GIL goes below */
        const char *ks = PyUnicode_Check(k) ? PyUnicode_AsUTF8(k) : NULL;
        const char *vs = PyUnicode_Check(v) ? PyUnicode_AsUTF8(v) : NULL;
        if (ks == NULL || vs == NULL) {
            for (pos = 0; pos < 2 * n; pos++)
                free(kv[pos]);
            free(kv);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "own_context: options must be str -> str");
            return NULL;
        }
        kv[2 * i]     = strdup(strncmp(ks, "UCX_", 4) == 0 ? ks + 4 : ks);
        kv[2 * i + 1] = strdup(vs);
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&g_ctx_mu);
    ctx = g_own_ctx;
    if (ctx == NULL) {
        st = ucp_config_read(NULL, NULL, &cfg);
        what = "ucp_config_read";
        for (i = 0; st == UCS_OK && i < n; i++) {
            st   = kv[2 * i] && kv[2 * i + 1] ? ucp_config_modify(cfg, kv[2 * i], kv[2 * i + 1])
                                              : UCS_ERR_NO_MEMORY;
            what = "ucp_config_modify";
        }
        if (st == UCS_OK) {
            memset(&p, 0, sizeof(p));
            p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                           UCP_PARAM_FIELD_NAME;
            p.features          = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
            p.mt_workers_shared = 1;
            p.name              = "kvxfer";
            st                  = ucp_init(&p, cfg, &ctx);
            what                = "ucp_init";
            if (st == UCS_OK)
                g_own_ctx = ctx;
        }
        if (cfg != NULL)
            ucp_config_release(cfg);
    }
    pthread_mutex_unlock(&g_ctx_mu);
    Py_END_ALLOW_THREADS
    for (i = 0; i < 2 * n; i++)
        free(kv[i]);
    free(kv);
    if (st != UCS_OK)
        return raise_ucx(st, what, 0);
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)ctx);
}

static PyMethodDef methods[] = {
    {"own_context", py_own_context, METH_VARARGS,
     "own_context(options) -> context handle: the process's own thread-shared UCP context "
     "for RMA (made once; options: UCX settings applied over the environment)"},
    {"mem_map", py_mem_map, METH_VARARGS,
     "mem_map(context, addr, length) -> (memh, memory_type_name)"},
    {"mem_unmap", py_mem_unmap, METH_VARARGS, "mem_unmap(context, memh)"},
    {"rkey_pack", py_rkey_pack, METH_VARARGS, "rkey_pack(context, memh) -> bytes"},
    {"rkey_unpack", py_rkey_unpack, METH_VARARGS, "rkey_unpack(ep, packed) -> rkey handle"},
    {"rkey_destroy", py_rkey_destroy, METH_VARARGS, "rkey_destroy(rkey)"},
    {"put_batch", py_put_batch, METH_VARARGS,
     "put_batch(ep, laddr, raddr, nbytes, lmemh, ridx, rbase, rlen, rkeys, keep_gil=False, "
     "ctx=0) -> ops posted\n"
     "All arrays are 1-D 64-bit integer buffers; every op is bounds-checked first. ctx: the "
     "endpoint's ep_create context (a failed PUT then fails the endpoint's later chains)."},
    {"gather", py_gather, METH_VARARGS,
     "gather(dst, capacity, laddr, nbytes) -> bytes: copy this process's runs laddr[i] of "
     "nbytes[i] bytes back to back to dst (at most capacity bytes; the caller vouches for the "
     "addresses)"},
    {"plan_items", py_plan_items, METH_VARARGS,
     "plan_items(item_write_type, ndarray_type, pairs, max_ids, small_ops, writes) -> "
     "(columns, total_bytes) or None: a write of ItemWrites planned in one call (None: not "
     "taken, plan it in Python)"},
    {"ep_ctx_free", py_ep_ctx_free, METH_VARARGS,
     "ep_ctx_free(ctx): release an ep_create context after its endpoint closed"},
    {"ep_info", py_ep_info, METH_VARARGS, "ep_info(ep) -> ucp_ep_print_info text"},
    {"status_string", py_status_string, METH_VARARGS, "status_string(code) -> str"},
    {"ucx_version", py_ucx_version, METH_NOARGS, "libucp version (major, minor, release)"},
    {NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_rma",
                                    "One-sided RMA over libucp for kvxfer (see _rma.c).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__rma(void)
{
    PyObject *m;
    if (PyType_Ready(&CompletionQueueType) < 0)
        return NULL;
    m = PyModule_Create(&moddef);
    if (m == NULL)
        return NULL;
    UcxError = PyErr_NewException("kvxfer.transport._rma.UcxError", PyExc_RuntimeError, NULL);
    Py_INCREF(UcxError);
    PyModule_AddObject(m, "UcxError", UcxError);
    Py_INCREF(&CompletionQueueType);
    PyModule_AddObject(m, "CompletionQueue", (PyObject *)&CompletionQueueType);
    PyModule_AddIntConstant(m, "UCS_OK", UCS_OK);
    PyModule_AddIntConstant(m, "NOTE", KVX_NOTE);
    PyModule_AddIntConstant(m, "NOTE_OVERSIZE", KVX_NOTE_OVERSIZE);
    PyModule_AddIntConstant(m, "AM_ID", KVX_AM_ID);
    PyModule_AddIntConstant(m, "UCS_ERR_CANCELED", UCS_ERR_CANCELED);
    PyModule_AddIntConstant(m, "UCS_ERR_CONNECTION_RESET", UCS_ERR_CONNECTION_RESET);
    PyModule_AddIntConstant(m, "UCS_ERR_ENDPOINT_TIMEOUT", UCS_ERR_ENDPOINT_TIMEOUT);
    PyModule_AddIntConstant(m, "UCS_ERR_UNREACHABLE", UCS_ERR_UNREACHABLE);
    PyModule_AddIntConstant(m, "UCS_ERR_NOT_CONNECTED", UCS_ERR_NOT_CONNECTED);
    return m;
}
