/* The file tier's host work for one lookup (qwen4_exp_hcu/ple/tiers/staging.py), in C: on an accelerator it runs on
   the driver's host thread as a host node, while the engine's thread runs Python, so a host function that needs
   the GIL waits for it (milliseconds a call while serving, against 0.2-0.9 ms of work: docs/PERFORMANCE.md,
   "PLE rows from files"). This one takes the GIL only for a promotion, every `refresh_every` lookups, through
   the `promote` callback. The layout of `Stager` is mirrored by `tiers/stager.py` (`qwen4_ple_stager_bytes` lets
   it check its size). */
#define _GNU_SOURCE /* RUSAGE_THREAD */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    int64_t start, n;          /* owned rows [start, start + n) of the table */
    int64_t shard_rows, first_shard, n_parts;
    int64_t slots;             /* resident buffer rows [0, slots); staging follows */
    int32_t *slot_of;          /* [n] owned row -> resident slot, -1: in the files */
    const uint8_t **src;       /* [shards * n_parts] the mapped files: shard first_shard + j, part p's rows */
    uint8_t **dst;             /* [n_parts] the buffers' rows */
    int64_t *row_bytes;        /* [n_parts] */
    int32_t *counts;           /* [n] reads per owned row, NULL: resident rows from calibration only */
    int64_t *fresh;            /* rows counted from zero since the last promotion (the promotion's candidates) */
    int64_t fresh_len, fresh_cap, lookups, refresh_every;
    void (*promote)(void);     /* Python (ctypes takes the GIL): the promotion, in the stream's order */
    const int64_t *ids;        /* one lookup: global row ids, hot-row flags, buffer rows out */
    const uint8_t *cached;
    int64_t *slot;
    int64_t *keys;             /* the lookup's distinct misses: open addressing over table_size >= 2 x its ids */
    int64_t *vals;
    int64_t table_size;
    int64_t calls, ns, longest_ns; /* the function's own time */
    int64_t alive;             /* 0 once its owner is gone: a graph replaying it later finds nothing to do */
    int64_t ask_first;         /* ASK_*: when a lookup asks the kernel for its misses' pages (`ask_pages`) */
    int64_t pages_asked;       /* pages those asks covered */
    int64_t in_memory;         /* bit p: part p is held in host memory (`file_map.in_memory_parts`): nothing to ask */
} Stager;

enum { ASK_NEVER, ASK_AFTER_A_FAULT, ASK_ALWAYS }; /* `FileTier.ask_pages_first`'s "never", "after_a_fault", "always" */

typedef struct {
    Stager *stager;
    int64_t n, flagged;        /* ids in the lookup; whether hot-row flags came */
} Call;

static void count(Stager *s, int64_t n, const uint8_t *cached) {
    for (int64_t i = 0; i < n; i++) {
        int64_t local = s->ids[i] - s->start;
        if (local < 0 || local >= s->n || (cached && cached[i]))
            continue;
        if (s->counts[local] == 0 && s->fresh_len == s->fresh_cap) { /* candidates full: promote now */
            s->lookups = 0;
            s->promote();
        }
        if (s->counts[local]++ == 0)
            s->fresh[s->fresh_len++] = local;
    }
    if (++s->lookups >= s->refresh_every) {
        s->lookups = 0;
        s->promote();
    }
}

static const uint8_t **shard_src(const Stager *s, int64_t local, int64_t *row) {
    int64_t global = local + s->start, shard = global / s->shard_rows;
    *row = global - shard * s->shard_rows;
    return s->src + (shard - s->first_shard) * s->n_parts;
}

/* Each id's resident slot, else its staging row: the lookup's distinct misses go into the open-addressing table
   `keys` (owned row) -> `vals` (staging row, in first-seen order) of `size` = 2^bits entries. Returns how many. */
static int64_t find_slots(Stager *s, int64_t n, const uint8_t *cached, int64_t size, int64_t bits) {
    memset(s->keys, 0xff, (size_t)size * sizeof(int64_t)); /* -1: empty */
    int64_t staged = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t local = s->ids[i] - s->start;
        if (local < 0 || local >= s->n) {
            s->slot[i] = -1;
            continue;
        }
        if (cached && cached[i]) {
            s->slot[i] = 0;
            continue;
        }
        if (s->slot_of[local] >= 0) {
            s->slot[i] = s->slot_of[local];
            continue;
        }
        uint64_t h = ((uint64_t)local * 0x9E3779B97F4A7C15ull) >> (64 - bits);
        while (s->keys[h] != -1 && s->keys[h] != local)
            h = (h + 1) & (uint64_t)(size - 1);
        if (s->keys[h] == -1)
            s->keys[h] = local, s->vals[h] = staged++;
        s->slot[i] = s->slots + s->vals[h];
    }
    return staged;
}

static int by_row(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* madvise(MADV_WILLNEED) on the pages of every miss from table entry `from` on, in every part: the kernel queues the
   reads of the pages it does not hold, all at once, so the copies that follow find them read or in flight instead of
   faulting them in one at a time (the drive's one-read-at-a-time rate: docs/PERFORMANCE.md, "PLE rows from files").
   The misses go in file order, so rows that share a page or lie in adjacent pages (a part of 2 bytes a row: hundreds
   of rows a page) make one run and one call, and the drive gets its reads in order. Where every page is cached the
   calls are the whole cost (about 0.6 us each on a 2-core VM). */
static void ask_pages(Stager *s, int64_t from, int64_t size) {
    static uintptr_t page;
    if (!page)
        page = (uintptr_t)sysconf(_SC_PAGESIZE);
    int64_t *rows = malloc((size_t)(size - from) * sizeof(int64_t)), m = 0;
    if (!rows)
        return; /* advice: without memory for the order, only the head start is lost */
    for (int64_t h = from; h < size; h++)
        if (s->keys[h] != -1)
            rows[m++] = s->keys[h];
    qsort(rows, (size_t)m, sizeof(int64_t), by_row);
    for (int64_t p = 0; p < s->n_parts; p++) {
        if (s->in_memory >> p & 1)
            continue;
        uintptr_t lo = 0, hi = 0; /* the run of pages not asked for yet, in one shard's map */
        const uint8_t **run_src = NULL;
        for (int64_t i = 0; i <= m; i++) {
            int64_t row = 0;
            const uint8_t **src = i < m ? shard_src(s, rows[i], &row) : NULL;
            uintptr_t at = src ? (uintptr_t)(src[p] + row * s->row_bytes[p]) : 0;
            uintptr_t first = at & ~(page - 1), end = (at + (uintptr_t)s->row_bytes[p] + page - 1) & ~(page - 1);
            if (src && src == run_src && first <= hi) { /* the same map, overlapping or adjacent: one run */
                if (end > hi)
                    hi = end;
                continue;
            }
            if (run_src) {
                madvise((void *)lo, hi - lo, MADV_WILLNEED); /* advice: a failure only loses the head start */
                s->pages_asked += (int64_t)((hi - lo) / page);
            }
            run_src = src, lo = first, hi = end;
        }
    }
    free(rows);
}

/* The calling thread's major faults so far: touches of pages the page cache did not hold, each read from the drive. */
static long major_faults(void) {
    struct rusage use;
    return getrusage(RUSAGE_THREAD, &use) ? 0 : use.ru_majflt;
}

/* The misses copied into staging, in the table's order. ASK_AFTER_A_FAULT reads the thread's major faults after 1,
   2, 4, ... rows and, once they grew, asks for the rest of the lookup's pages before copying on: a lookup whose
   pages are cached pays about log2(misses) getrusage calls instead of a madvise a row and part, one whose pages are
   not pays the faults of the rows copied before the check that saw them. */
static void copy_rows(Stager *s, int64_t size) {
    int64_t copied = 0, check = s->ask_first == ASK_AFTER_A_FAULT ? 1 : -1; /* -1: no check */
    long faults = check > 0 ? major_faults() : 0;
    for (int64_t h = 0; h < size; h++) {
        if (s->keys[h] == -1)
            continue;
        int64_t row, to = s->slots + s->vals[h];
        const uint8_t **src = shard_src(s, s->keys[h], &row);
        for (int64_t p = 0; p < s->n_parts; p++)
            memcpy(s->dst[p] + to * s->row_bytes[p], src[p] + row * s->row_bytes[p], (size_t)s->row_bytes[p]);
        if (++copied == check) {
            if (major_faults() > faults) {
                ask_pages(s, h + 1, size);
                check = -1;
            } else
                check *= 2;
        }
    }
}

/* `ids[:n]` -> `slot[:n]`: a resident slot, a staging row (the row read from the files, once per lookup), 0 for a
   pair the hot-row cache serves, -1 where the rank owns no row. Counting (and a due promotion) comes first, so a
   promotion that reads through staging is done before this lookup stages its rows; then the slots and the distinct
   misses; their pages asked for (ASK_ALWAYS); then their copies (ASK_AFTER_A_FAULT: asking once one faulted). */
void qwen4_ple_stage(Stager *s, int64_t n, int64_t flagged) {
    if (!s->alive)
        return;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    const uint8_t *cached = flagged ? s->cached : NULL;
    if (s->counts)
        count(s, n, cached);
    int64_t size = 16, bits = 4;
    while (size < 2 * n)
        size <<= 1, bits++;
    if (size > s->table_size) { /* `StagingArea.reserve` sizes it for every lookup: a caller that skipped it */
        fprintf(stderr, "qwen4_ple_stage: a lookup of %lld ids, the table of distinct misses holds %lld\n", (long long)n,
                (long long)s->table_size);
        abort();
    }
    if (find_slots(s, n, cached, size, bits)) {
        if (s->ask_first == ASK_ALWAYS)
            ask_pages(s, 0, size);
        copy_rows(s, size);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    int64_t took = (int64_t)(t1.tv_sec - t0.tv_sec) * 1000000000 + (t1.tv_nsec - t0.tv_nsec);
    s->calls++, s->ns += took;
    if (took > s->longest_ns)
        s->longest_ns = took;
}

/* Bytes of `Stager` as this build lays it out: `tiers/stager.py` mirrors it field for field. */
int64_t qwen4_ple_stager_bytes(void) { return (int64_t)sizeof(Stager); }

/* The host node's function (`cuLaunchHostFunc` / `hipLaunchHostFunc` take a `void (*)(void *)`). */
void qwen4_ple_stage_call(void *arg) {
    const Call *call = (const Call *)arg;
    qwen4_ple_stage(call->stager, call->n, call->flagged);
}
