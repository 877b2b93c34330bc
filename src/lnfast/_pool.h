/* A small cache of large output buffers, as a NumPy memory handler (NEP 49).
 *
 * A fresh multi-megabyte array costs the kernel a page fault and a page of
 * zeroing per 4 KiB (or 2 MiB) touched: for LayerNorm that is most of the
 * time of a copy.  lnfast allocates its outputs through this handler; when
 * such an array dies its buffer is kept (up to a byte limit) and handed out
 * again for the next output of exactly the same size, already mapped.
 * Buffers below LNF_POOL_MIN bytes, and everything past the limit, go
 * straight to malloc/free.  lnfast.empty_cache() releases the cache.
 */
#ifndef LNFAST_POOL_H
#define LNFAST_POOL_H

#include <Python.h>
#include <stdlib.h>
#include <string.h>
#include <numpy/arrayobject.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

/* From glibc's default mmap threshold: buffers of this size and up (a
 * channels-first call's mean and rstd) come back to the heap's top or are
 * mapped, and glibc returns them to the system when freed, so that the next
 * call faults their pages in again.  Slots for a few layers' y, mean, rstd
 * and dx; huge pages from 4 MiB, as NumPy's own allocator asks for them. */
#define LNF_POOL_MIN ((size_t)1 << 17)
#define LNF_POOL_SLOTS 64
#define LNF_POOL_HUGE ((size_t)1 << 22)

typedef struct {
    void *ptr;
    size_t size;
} lnf_block;

static struct {
    lnf_block block[LNF_POOL_SLOTS]; /* oldest first */
    int count;
    size_t bytes, limit;
    PyThread_type_lock lock;         /* arrays may die on any thread */
} lnf_pool = {{{0}}, 0, 0, (size_t)1 << 30, NULL};

static void *lnf_pool_malloc(void *ctx, size_t size)
{
    (void)ctx;
    if (size >= LNF_POOL_MIN) {
        void *p = NULL;
        PyThread_acquire_lock(lnf_pool.lock, WAIT_LOCK);
        for (int k = lnf_pool.count - 1; k >= 0; k--)
            if (lnf_pool.block[k].size == size) {
                p = lnf_pool.block[k].ptr;
                lnf_pool.bytes -= size;
                memmove(&lnf_pool.block[k], &lnf_pool.block[k + 1],
                        (size_t)(lnf_pool.count - k - 1) * sizeof(lnf_block));
                lnf_pool.count--;
                break;
            }
        PyThread_release_lock(lnf_pool.lock);
        if (p != NULL)
            return p;
#if defined(_WIN32)
        p = malloc(size);
#else
        /* On a page: the kernels' streaming stores need whole cache lines. */
        if (posix_memalign(&p, 4096, size) != 0)
            p = NULL;
#endif
#if defined(__linux__) && defined(MADV_HUGEPAGE)
        /* As NumPy's own allocator does: fewer faults, each zeroing 2 MiB. */
        if (p != NULL && size >= LNF_POOL_HUGE)
            madvise((void *)(((size_t)p + 4095) & ~(size_t)4095), size - 4096, MADV_HUGEPAGE);
#endif
        return p;
    }
    return malloc(size ? size : 1);
}

static void *lnf_pool_calloc(void *ctx, size_t nelem, size_t elsize)
{
    (void)ctx;
    return calloc(nelem ? nelem : 1, elsize ? elsize : 1);
}

static void *lnf_pool_realloc(void *ctx, void *ptr, size_t new_size)
{
    (void)ctx;
    return realloc(ptr, new_size ? new_size : 1);
}

/* With the lock held: take out the oldest blocks until `bytes` more bytes
 * and `slots` more blocks fit; returns how many were put into evict[]. */
static int lnf_pool_trim_locked(size_t bytes, int slots, void **evict)
{
    int n = 0;
    while (lnf_pool.count > 0 && (lnf_pool.count + slots > LNF_POOL_SLOTS
                                  || lnf_pool.bytes + bytes > lnf_pool.limit)) {
        evict[n++] = lnf_pool.block[0].ptr;
        lnf_pool.bytes -= lnf_pool.block[0].size;
        memmove(&lnf_pool.block[0], &lnf_pool.block[1],
                (size_t)(lnf_pool.count - 1) * sizeof(lnf_block));
        lnf_pool.count--;
    }
    return n;
}

static void lnf_pool_free(void *ctx, void *ptr, size_t size)
{
    (void)ctx;
    if (ptr == NULL)
        return;
    if (size >= LNF_POOL_MIN && size <= lnf_pool.limit) {
        void *evict[LNF_POOL_SLOTS];
        PyThread_acquire_lock(lnf_pool.lock, WAIT_LOCK);
        int n_evict = lnf_pool_trim_locked(size, 1, evict);
        lnf_pool.block[lnf_pool.count].ptr = ptr;
        lnf_pool.block[lnf_pool.count].size = size;
        lnf_pool.count++;
        lnf_pool.bytes += size;
        PyThread_release_lock(lnf_pool.lock);
        for (int k = 0; k < n_evict; k++)
            free(evict[k]);
        return;
    }
    free(ptr);
}

static PyDataMem_Handler lnf_pool_handler = {
    "lnfast_pool",
    1,
    {NULL, lnf_pool_malloc, lnf_pool_calloc, lnf_pool_realloc, lnf_pool_free},
};

/* The handler as the capsule PyDataMem_SetHandler takes (new reference). */
static PyObject *lnf_pool_capsule(void)
{
    if (lnf_pool.lock == NULL && (lnf_pool.lock = PyThread_allocate_lock()) == NULL)
        return PyErr_NoMemory();
    return PyCapsule_New(&lnf_pool_handler, "mem_handler", NULL);
}

/* Set the byte limit and release what no longer fits (all of it for 0). */
static void lnf_pool_set_limit(size_t limit)
{
    void *evict[LNF_POOL_SLOTS];
    PyThread_acquire_lock(lnf_pool.lock, WAIT_LOCK);
    lnf_pool.limit = limit;
    int n_evict = lnf_pool_trim_locked(0, 0, evict);
    PyThread_release_lock(lnf_pool.lock);
    for (int k = 0; k < n_evict; k++)
        free(evict[k]);
}

/* Release every cached block; the limit stays (one step under the lock:
 * two threads emptying the cache at once cannot leave it limited to 0). */
static void lnf_pool_clear(void)
{
    void *evict[LNF_POOL_SLOTS];
    PyThread_acquire_lock(lnf_pool.lock, WAIT_LOCK);
    int n_evict = lnf_pool_trim_locked(0, LNF_POOL_SLOTS, evict);
    PyThread_release_lock(lnf_pool.lock);
    for (int k = 0; k < n_evict; k++)
        free(evict[k]);
}

static size_t lnf_pool_bytes(void) { return lnf_pool.bytes; }
static size_t lnf_pool_limit(void) { return lnf_pool.limit; }

#endif
