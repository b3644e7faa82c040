/* Suffix proposer kernels (dspark/kernels/suffix_native.py): match the longest context suffix of a request
 * in a token text and walk its most frequent continuation. No allocation, no globals: pure functions over
 * caller-owned arrays, so one index is shared read-only by every request of a replica.
 *
 * Texts are int32 token ids; -1 separates documents (a match never crosses one; a walk stops at one).
 *
 * Global index: `sa` lists text positions sorted by the (up to `depth`) tokens that follow them, ties by
 * position. The positions whose suffix starts with a pattern P are one contiguous run of `sa`; those
 * continuing P with token t are a contiguous sub-run, because the sort is lexicographic. So the walk is
 * binary searches over runs, and the most frequent continuation of a large run is found from a strided
 * sample of it (sorted: a token holding a share s of the run holds ~s of the samples) and then counted
 * exactly with two binary searches.
 *
 * Per-request index: the request's own text (prompt + output), scanned: every earlier occurrence of the
 * context suffix, their next tokens counted, the most frequent one taken (ties: the most recent).
 */
#include <stdint.h>

#define WALK_LANES 32 /* walks advanced together (stack: ~1.2 KB each) */

/* compare the pattern p[0..m) with the text at position s: <0, 0 (p is a prefix there), >0 */
static int cmp_at(const int32_t *text, int64_t n_text, int64_t s, const int32_t *p, int64_t m) {
    for (int64_t i = 0; i < m; i++) {
        int64_t j = s + i;
        int32_t t = j < n_text ? text[j] : -1;
        if (t != p[i]) return t < p[i] ? -1 : 1;
    }
    return 0;
}

static int32_t token_at(const int32_t *text, int64_t n_text, int64_t j) { return j < n_text ? text[j] : -1; }

/* The calibrated conditional survival of an emitted token: the cell (f, n, m, k) of a table laid out as
 * spec/source_calibration.py's `SourceTable.freeze` lays it out (f in tenths, n = ceil(log2 count) capped at
 * 6, m in 6 bands of context length, k = position capped at 3), or the raw frequency without a table.
 * Binning is done in double, as Python does it, so both sides pick the same cell. */
static float survival_of(const float *table, float freq, int64_t count, int64_t match, int64_t pos) {
    double fd = (double)freq;
    if (table == 0) return fd < 0.01 ? 0.01f : fd > 0.99 ? 0.99f : (float)fd;
    int64_t f = (int64_t)(fd * 10.0);
    if (f > 9) f = 9;
    if (f < 0) f = 0;
    int64_t n = 0;
    while (n < 6 && ((int64_t)1 << n) < count) n++;
    int64_t m = match <= 1 ? 0 : match == 2 ? 1 : match == 3 ? 2 : match <= 5 ? 3 : match <= 8 ? 4 : 5;
    int64_t k = pos > 3 ? 3 : pos;
    return table[((f * 7 + n) * 6 + m) * 4 + k];
}

/* Step k of a walk: the token, what the calibration reads of it, and its survival. */
static void emit(int64_t k, int32_t token, float freq, int64_t count, int64_t match, const float *table,
                 int32_t *out_tokens, float *out_freq, int32_t *out_count, int32_t *out_match, float *out_conf) {
    out_tokens[k] = token;
    out_freq[k] = freq;
    out_count[k] = (int32_t)(count > 2147483647 ? 2147483647 : count);
    out_match[k] = (int32_t)match;
    out_conf[k] = survival_of(table, freq, out_count[k], match, k);
}

/* Keep the occurrences (positions of next tokens in seq[0..n)) continued by `token`, moved one on. */
static int64_t narrow(int64_t *work, int64_t num, const int32_t *seq, int64_t n, int32_t token) {
    int64_t kept = 0;
    for (int64_t a = 0; a < num; a++)
        if (work[a] < n && seq[work[a]] == token) work[kept++] = work[a] + 1;
    return kept;
}

/* ---- Walks in lockstep --------------------------------------------------------------------------------------
 * On a cold index every probe of a binary search waits for a cache miss or two (sa[mid], then the text there), and
 * one request's probes depend on each other. A round's walks do not: `walk_lockstep` advances the walks of many
 * requests together, phase by phase (the matched length, then each emitted token), and their binary searches probe
 * by probe (`runs_of`), so that each search's next misses are asked for (prefetched) while the others compare. The
 * result is exactly the sequential walk's: the same searches over the same ranges, the same counts. */

typedef struct { /* one binary search for the run of p[0..m) within [lo, hi) of sa */
    const int32_t *text, *sa, *p;
    int64_t n_text, m, lo, hi, above, first;
    int stage; /* 0: first suffix >= p, 1: first suffix > p, 2: done */
    int has_sa; /* sa[mid] was asked for a turn ago: now ask for its text */
} Search;

static void search_next(Search *q) { /* the next probe of q, asked for; or the next stage */
    while (q->stage < 2 && q->lo >= q->hi) {
        if (q->stage == 0) { q->first = q->lo; q->hi = q->above; }
        q->stage++;
    }
    if (q->stage < 2) __builtin_prefetch(q->sa + q->lo + (q->hi - q->lo) / 2, 0, 1);
    q->has_sa = 0;
}

/* Every search's run: out [first, lo) of each; a search takes one probe a turn, its misses asked for a turn ahead. */
static void runs_of(Search *qs, int64_t n) {
    for (int64_t i = 0; i < n; i++) { qs[i].stage = 0; qs[i].above = qs[i].hi; search_next(&qs[i]); }
    for (int64_t busy = n; busy > 0;) {
        busy = 0;
        for (int64_t i = 0; i < n; i++) {
            Search *q = &qs[i];
            if (q->stage == 2) continue;
            busy++;
            int64_t mid = q->lo + (q->hi - q->lo) / 2;
            if (!q->has_sa) { /* its sa entry is (nearly) in: ask for the text it points at, compare next turn */
                __builtin_prefetch(q->text + q->sa[mid], 0, 1);
                q->has_sa = 1;
                continue;
            }
            int c = cmp_at(q->text, q->n_text, q->sa[mid], q->p, q->m);
            if (q->stage == 0) {
                if (c < 0) q->lo = mid + 1; else q->hi = mid;
                if (c > 0) q->above = mid; /* sorted: every suffix from mid on is > p */
            } else {
                if (c <= 0) q->lo = mid + 1; else q->hi = mid;
            }
            search_next(q);
        }
    }
}

typedef struct { /* one walk of the index (text, sa) from the context ctx[0..n_ctx) */
    const int32_t *text, *sa, *ctx;
    int64_t n_text, n_sa, n_ctx;
    int64_t yes, no; /* the match: lengths <= yes have a continuation, >= no do not */
    int64_t lo, hi, m, k, run;
    int64_t a; /* the caller's: where the walk's k goes */
    int32_t best;
    float path;
    int done;
    int32_t *out_tokens, *out_count, *out_match;
    float *out_freq, *out_conf;
    const float *table;
    int32_t pat[256];
} Walker;

static int64_t run_samples(int64_t run, int64_t num_samples) { return run <= num_samples ? run : num_samples; }
static int64_t sample_at(int64_t lo, int64_t run, int64_t num_samples, int64_t s) {
    return run <= num_samples ? lo + s : lo + (run * s + run / 2) / num_samples;
}

/* The matched context of every walk of ws[0..n): the longest suffix of its context (max_ctx..min_ctx tokens, no
 * separator) whose run of `sa` has a continuation, to pat[0..m) and [lo, hi); done where none. Having one is monotone
 * in the length (where the last L tokens occur with a next token, the last L - 1 occur one on, with the same next
 * token; a separator in the last L is in every longer suffix too), so the lengths are binary searched: each length
 * tried is a search of the whole array, and trying them longest first cost 4.9 of them a walk in real decoding (the
 * matched length spreads over 2..8, 11 % none; session 56) against ~3. */
static void match_lockstep(Walker *ws, int64_t n, int64_t min_ctx, int64_t max_ctx) {
    Search qs[WALK_LANES];
    Walker *of[WALK_LANES];
    if (min_ctx < 1) min_ctx = 1;
    for (int64_t i = 0; i < n; i++) {
        Walker *w = &ws[i];
        int64_t top = max_ctx < w->n_ctx ? max_ctx : w->n_ctx;
        if (top > 128) top = 128;
        w->yes = min_ctx - 1, w->no = top + 1, w->k = 0, w->path = 1.0f;
        w->done = w->n_sa == 0 || w->n_ctx <= 0;
    }
    for (;;) {
        int64_t nq = 0;
        for (int64_t i = 0; i < n; i++) {
            Walker *w = &ws[i];
            if (w->done || w->no - w->yes <= 1) continue;
            int64_t len = w->yes + (w->no - w->yes) / 2, sep = 0;
            for (int64_t j = 0; j < len; j++) sep |= w->ctx[w->n_ctx - len + j] < 0;
            if (sep) { w->no = len; i--; continue; } /* no run for it: the next length of the same walk */
            qs[nq] = (Search){w->text, w->sa, w->ctx + w->n_ctx - len, w->n_text, len, 0, w->n_sa, 0, 0, 0, 0};
            of[nq++] = w;
        }
        if (nq == 0) break;
        runs_of(qs, nq);
        for (int64_t j = 0; j < nq; j++) if (qs[j].lo > qs[j].first) __builtin_prefetch(qs[j].sa + qs[j].lo - 1, 0, 1);
        for (int64_t j = 0; j < nq; j++)
            if (qs[j].lo > qs[j].first) __builtin_prefetch(qs[j].text + qs[j].sa[qs[j].lo - 1] + qs[j].m, 0, 1);
        for (int64_t j = 0; j < nq; j++) {
            Walker *w = of[j];
            Search *q = &qs[j];
            /* a run is sorted by next token and the separator sorts first: its last entry has a real next token
             * iff any entry has one */
            if (q->lo > q->first && token_at(q->text, q->n_text, (int64_t)q->sa[q->lo - 1] + q->m) >= 0) {
                w->yes = q->m; w->lo = q->first; w->hi = q->lo;
            } else {
                w->no = q->m;
            }
        }
    }
    for (int64_t i = 0; i < n; i++) {
        Walker *w = &ws[i];
        if (w->done) continue;
        if (w->yes < min_ctx) { w->done = 1; continue; }
        for (int64_t j = 0; j < w->yes; j++) w->pat[j] = w->ctx[w->n_ctx - w->yes + j];
        w->m = w->yes;
    }
}

/* The walks of ws[0..n) (see suffix_walk), together. */
static void walk_lockstep(Walker *ws, int64_t n, int64_t min_ctx, int64_t max_ctx, int64_t depth, int64_t max_tokens,
                          float min_path_prob, int64_t num_samples) {
    Search qs[WALK_LANES];
    Walker *of[WALK_LANES];
    match_lockstep(ws, n, min_ctx, max_ctx);
    for (;;) { /* one emitted token of every walk still going */
        for (int64_t i = 0; i < n; i++) { /* the continuations' sa entries asked for, then their texts */
            Walker *w = &ws[i];
            if (w->done || w->k >= max_tokens || w->m >= depth || w->m >= 255) { w->done = 1; continue; }
            w->run = w->hi - w->lo;
            for (int64_t s = 0; s < run_samples(w->run, num_samples); s++)
                __builtin_prefetch(w->sa + sample_at(w->lo, w->run, num_samples, s), 0, 1);
        }
        for (int64_t i = 0; i < n; i++) {
            Walker *w = &ws[i];
            if (w->done) continue;
            for (int64_t s = 0; s < run_samples(w->run, num_samples); s++)
                __builtin_prefetch(w->text + w->sa[sample_at(w->lo, w->run, num_samples, s)] + w->m, 0, 1);
        }
        int64_t nq = 0;
        for (int64_t i = 0; i < n; i++) { /* the most frequent continuation (exact, or of a strided sample) */
            Walker *w = &ws[i];
            if (w->done) continue;
            int32_t best = -1;
            int64_t best_n = 0;
            if (w->run <= num_samples) { /* exact: the longest group of equal next tokens */
                int64_t j = w->lo;
                while (j < w->hi) {
                    int32_t t = token_at(w->text, w->n_text, (int64_t)w->sa[j] + w->m);
                    int64_t e = j + 1;
                    while (e < w->hi && token_at(w->text, w->n_text, (int64_t)w->sa[e] + w->m) == t) e++;
                    if (t >= 0 && e - j > best_n) { best_n = e - j; best = t; }
                    j = e;
                }
            } else { /* strided sample; the winner is counted exactly below */
                int64_t cur_n = 0;
                int32_t cur = -2;
                for (int64_t s = 0; s < num_samples; s++) {
                    int32_t t = token_at(w->text, w->n_text, (int64_t)w->sa[sample_at(w->lo, w->run, num_samples, s)]
                                                            + w->m);
                    if (t == cur) cur_n++; else { cur = t; cur_n = 1; }
                    if (t >= 0 && cur_n > best_n) { best_n = cur_n; best = t; }
                }
            }
            if (best < 0) { w->done = 1; continue; }
            w->best = best;
            w->pat[w->m] = best;
            qs[nq] = (Search){w->text, w->sa, w->pat, w->n_text, w->m + 1, w->lo, w->hi, 0, 0, 0, 0};
            of[nq++] = w;
        }
        if (nq == 0) break;
        runs_of(qs, nq);
        for (int64_t j = 0; j < nq; j++) {
            Walker *w = of[j];
            float freq = (float)(qs[j].lo - qs[j].first) / (float)w->run;
            w->path *= freq;
            if (w->path < min_path_prob) { w->done = 1; continue; }
            emit(w->k, w->best, freq, w->run, w->m, w->table, w->out_tokens, w->out_freq, w->out_count, w->out_match,
                 w->out_conf);
            w->k++;
            w->lo = qs[j].first; w->hi = qs[j].lo; w->m++;
        }
    }
}

/* [lo, hi) of sa whose suffixes start with p[0..m), searched within [lo0, hi0): one search of `runs_of`. */
static void run_of(const int32_t *text, int64_t n_text, const int32_t *sa, int64_t lo0, int64_t hi0,
                   const int32_t *p, int64_t m, int64_t *lo_out, int64_t *hi_out) {
    Search q = {text, sa, p, n_text, m, lo0, hi0, 0, 0, 0, 0};
    runs_of(&q, 1);
    *lo_out = q.first;
    *hi_out = q.lo;
}

/* One walk's matched context (`match_lockstep`): copied to pat, its run to [*lo, *hi); its length (0: none). */
static int64_t index_match(const int32_t *text, int64_t n_text, const int32_t *sa, int64_t n_sa, const int32_t *ctx,
                           int64_t n_ctx, int64_t min_ctx, int64_t max_ctx, int32_t *pat, int64_t *lo, int64_t *hi) {
    Walker w = {.text = text, .sa = sa, .ctx = ctx, .n_text = n_text, .n_sa = n_sa, .n_ctx = n_ctx};
    match_lockstep(&w, 1, min_ctx, max_ctx);
    if (w.done) return 0;
    for (int64_t i = 0; i < w.m; i++) pat[i] = w.pat[i];
    *lo = w.lo;
    *hi = w.hi;
    return w.m;
}

/* The earlier occurrences in seq[0..n) of its last `len` tokens (len from max_ctx down to min_ctx, the longest
 * that occurs), each as the position of its next token, most recent first, at most max_occurrences, in
 * work; *num of them. Returns len (0: none). Two passes over the text whatever max_ctx is: the first finds the
 * longest match (each candidate end compared backwards against the suffix, stopping at max_ctx), the second
 * keeps the occurrences that match that far (a pass per length tried cost max_ctx passes on a text without
 * long repeats). */
static int64_t request_match(const int32_t *seq, int64_t n, int64_t min_ctx, int64_t max_ctx, int64_t max_occurrences,
                             int64_t *work, int64_t *num) {
    *num = 0;
    if (max_ctx > n - 1) max_ctx = n - 1;
    if (min_ctx < 1) min_ctx = 1;
    if (max_ctx < min_ctx) return 0;
    const int32_t *last = seq + n - 1;
    int64_t len = 0;
    /* an occurrence ends at e (its next token e + 1 < n; e < n - 1 excludes the suffix itself) */
    for (int64_t e = n - 2; e >= 0 && len < max_ctx; e--) {
        int64_t i = 0, lim = e + 1 < max_ctx ? e + 1 : max_ctx;
        while (i < lim && seq[e - i] == last[-i]) i++;
        if (i > len) len = i;
    }
    if (len < min_ctx) return 0;
    for (int64_t e = n - 2; e >= len - 1; e--) {
        int64_t i = 0;
        while (i < len && seq[e - i] == last[-i]) i++;
        if (i == len) {
            work[(*num)++] = e + 1;
            if (*num == max_occurrences) break; /* bounded work: the most recent ones */
        }
    }
    return len;
}

/* Walk the most frequent continuation of the context suffix in the global index.
 * ctx[0..n_ctx): the request's last tokens (oldest first). Finds the longest context suffix (max_ctx..min_ctx tokens)
 * with a continuation (`walk_lockstep` for one walk). Emits up to max_tokens tokens while the path probability (product of
 * conditional frequencies) stays >= min_path_prob. Per emitted token k: out_freq[k] = its count / the
 * count of its context, out_count[k] = the count of its context (support), out_match[k] = that context's
 * length. Returns the number of tokens emitted. */
int64_t suffix_walk(const int32_t *text, int64_t n_text, const int32_t *sa, int64_t n_sa,
                    const int32_t *ctx, int64_t n_ctx, int64_t min_ctx, int64_t max_ctx, int64_t depth,
                    int64_t max_tokens, float min_path_prob, int64_t num_samples,
                    int32_t *out_tokens, float *out_freq, int32_t *out_count, int32_t *out_match,
                    const float *table, float *out_conf) {
    Walker w = {.text = text, .sa = sa, .ctx = ctx, .n_text = n_text, .n_sa = n_sa, .n_ctx = n_ctx,
                .out_tokens = out_tokens, .out_count = out_count, .out_match = out_match, .out_freq = out_freq,
                .out_conf = out_conf, .table = table};
    walk_lockstep(&w, 1, min_ctx, max_ctx, depth, max_tokens, min_path_prob, num_samples);
    return w.k;
}

/* The same walk over one request's own text seq[0..n): occurrences of the context suffix (the last `len`
 * tokens, len from max_ctx down to min_ctx) that have a next token; the most frequent next token (ties: the
 * most recent occurrence's) is emitted and the set narrowed to the occurrences it continues.
 * work: int64 scratch of max_occurrences entries. */
int64_t request_walk(const int32_t *seq, int64_t n, int64_t min_ctx, int64_t max_ctx, int64_t max_tokens,
                     float min_path_prob, int64_t max_occurrences, int64_t *work, int32_t *out_tokens, float *out_freq,
                     int32_t *out_count, int32_t *out_match, const float *table, float *out_conf) {
    if (n < 2) return 0;
    int64_t num = 0;
    int64_t m = request_match(seq, n, min_ctx, max_ctx, max_occurrences, work, &num);
    if (m == 0) return 0;
    int64_t k = 0;
    float path = 1.0f;
    while (k < max_tokens && num > 0) {
        /* most frequent next token; ties go to the most recent (work is most recent first) */
        int32_t best = -1;
        int64_t best_n = 0;
        for (int64_t a = 0; a < num; a++) {
            if (work[a] >= n) continue;
            int32_t t = seq[work[a]];
            int first = 1;
            for (int64_t b = 0; b < a && first; b++) first = !(work[b] < n && seq[work[b]] == t);
            if (!first) continue;
            int64_t c = 0;
            for (int64_t b = a; b < num; b++) c += work[b] < n && seq[work[b]] == t;
            if (c > best_n) { best_n = c; best = t; }
        }
        if (best < 0) break;
        float freq = (float)best_n / (float)num;
        path *= freq;
        if (path < min_path_prob) break;
        emit(k, best, freq, num, m, table, out_tokens, out_freq, out_count, out_match, out_conf);
        k++;
        num = narrow(work, num, seq, n, best);
        m++;
    }
    return k;
}

/* The index source s (1 = the global one, 2 = request r's tenant's served text) reads: 0 where it has none. */
static int index_of(int64_t s, int64_t r, const int32_t *text, int64_t n_text, const int32_t *sa, int64_t n_sa,
                    const int64_t *served, const int32_t **t, int64_t *nt, const int32_t **a, int64_t *na) {
    if (s == 1) { *t = text; *nt = n_text; *a = sa; *na = n_sa; }
    else { *t = (const int32_t *)served[4 * r]; *nt = served[4 * r + 1]; *a = (const int32_t *)served[4 * r + 2];
           *na = served[4 * r + 3]; }
    return *na > 0;
}

/* One proposal round for R requests, every source, in one call (what SuffixDrafter.propose runs).
 * Sources: 0 = the request's own text, 1 = the global index, 2 = the request's tenant's served text.
 * Request r's text is the int32 array at seq_ptrs[r] of length seq_lens[r]; the global index is (text, sa)
 * (n_sa = 0: none); request r's served index is (served[4r] text ptr, served[4r+1] length, served[4r+2] sa
 * ptr, served[4r+3] length; a zero length: none). tables[3r + s] is the calibration table of request r and
 * source s for its regime, or 0 (raw frequency). Outputs, per (r, s): out_k (tokens emitted) and
 * out_expected (sum_k prod_{i<=k} c_i); per (r, s, j < max_tokens): the walk's tokens, freq, count, match,
 * conf; per r: out_chosen, the source with the most expected tokens (ties: the lower source), -1 for none.
 * The index walks of up to WALK_LANES at a time go in lockstep (`walk_lockstep`): session 56, Zen 4, 32 requests
 * of real decoding contexts with the caches cold, the call took 0.418 ms before, 0.353 with the matched length
 * binary searched, 0.258-0.263 with the walks in lockstep too (`docs/results/suffix/s56/propose/`). */
void propose_batch(int64_t R, const int64_t *seq_ptrs, const int64_t *seq_lens,
                   const int32_t *text, int64_t n_text, const int32_t *sa, int64_t n_sa, const int64_t *served,
                   int64_t depth, int64_t min_ctx, int64_t max_ctx, int64_t req_min_ctx, int64_t req_max_ctx,
                   int64_t max_tokens, float min_path_prob, int64_t num_samples, int64_t max_occurrences,
                   int64_t *work, int64_t use_request, int64_t use_corpus, int64_t use_served, const int64_t *tables,
                   int32_t *out_tokens, float *out_freq, int32_t *out_count, int32_t *out_match, float *out_conf,
                   int64_t *out_k, float *out_expected, int64_t *out_chosen) {
    Walker ws[WALK_LANES];
    for (int64_t r0 = 0, r1 = 0; r0 < R; r0 = r1) {
        int64_t nw = 0;
        for (; r1 < R && nw + 2 <= WALK_LANES; r1++) { /* as many requests as a lockstep pass takes (<= 2 walks each) */
            int64_t r = r1;
            const int32_t *seq = (const int32_t *)seq_ptrs[r];
            int64_t n = seq_lens[r];
            int64_t c = n < max_ctx ? n : max_ctx;
            for (int64_t s = 0; s < 3; s++) {
                int64_t o = (r * 3 + s) * max_tokens;
                const float *table = (const float *)tables[r * 3 + s];
                const int32_t *t, *a;
                int64_t nt, na;
                out_k[r * 3 + s] = 0;
                if (s == 0 && use_request)
                    out_k[r * 3] = request_walk(seq, n, req_min_ctx, req_max_ctx, max_tokens, min_path_prob,
                                                max_occurrences, work, out_tokens + o, out_freq + o, out_count + o,
                                                out_match + o, table, out_conf + o);
                else if (s > 0 && (s == 1 ? use_corpus : use_served) && index_of(s, r, text, n_text, sa, n_sa, served,
                                                                                &t, &nt, &a, &na))
                    ws[nw++] = (Walker){.text = t, .sa = a, .ctx = seq + n - c, .n_text = nt, .n_sa = na, .n_ctx = c,
                                        .out_tokens = out_tokens + o, .out_count = out_count + o,
                                        .out_match = out_match + o, .out_freq = out_freq + o, .out_conf = out_conf + o,
                                        .table = table, .a = r * 3 + s};
            }
        }
        walk_lockstep(ws, nw, min_ctx, max_ctx, depth, max_tokens, min_path_prob, num_samples);
        for (int64_t i = 0; i < nw; i++) out_k[ws[i].a] = ws[i].k;
        for (int64_t r = r0; r < r1; r++) {
            int64_t best = -1;
            for (int64_t s = 0; s < 3; s++) {
                int64_t o = (r * 3 + s) * max_tokens, k = out_k[r * 3 + s];
                float expected = 0.0f, path = 1.0f;
                for (int64_t j = 0; j < k; j++) { path *= out_conf[o + j]; expected += path; }
                out_expected[r * 3 + s] = expected;
                if (k > 0 && (best < 0 || expected > out_expected[r * 3 + best])) best = s;
            }
            out_chosen[r] = best;
        }
    }
}

/* ---- Sampled walks (T > 0): draft from the empirical continuation distribution q -------------------------
 * At each step the continuation counts of the current context (its run of `sa`, exact up to num_samples
 * entries, else a strided sample of num_samples of them; or the request's occurrences) are cut to their
 * max_q most frequent tokens (ties: the smaller token) and renormalised: that is q_k, reported in full
 * (out_q_tokens / out_q_probs, max_q slots per step, unused ones -1 / 0) so verification can accept with
 * min(1, p/q) and resample max(0, p - q). x_k is drawn from q_k with the caller's uniform u_k.
 * Lossless use: whether step k is emitted, and its survival, are read from q_k's shape (its largest
 * probability, the support, the context length, k) before x_k is drawn, never from x_k itself. */

typedef struct { int32_t token; int64_t count; } Group;

/* keep the max_q largest groups of g[0..n) (sorted by token on entry) in g[0..), by count descending, ties
 * the smaller token; returns how many were kept and their total count */
static int64_t top_groups(Group *g, int64_t n, int64_t max_q, int64_t *total) {
    int64_t kept = n < max_q ? n : max_q;
    for (int64_t i = 0; i < kept; i++) { /* selection: max_q is small */
        int64_t best = i;
        for (int64_t j = i + 1; j < n; j++)
            if (g[j].count > g[best].count || (g[j].count == g[best].count && g[j].token < g[best].token)) best = j;
        Group t = g[i]; g[i] = g[best]; g[best] = t;
    }
    *total = 0;
    for (int64_t i = 0; i < kept; i++) *total += g[i].count;
    return kept;
}

/* the draw: the first group whose cumulative share exceeds u (u in [0, 1)) */
static int64_t draw_group(const Group *g, int64_t kept, int64_t total, float u) {
    double target = (double)u * (double)total, acc = 0.0;
    for (int64_t i = 0; i < kept; i++) {
        acc += (double)g[i].count;
        if (target < acc) return i;
    }
    return kept - 1;
}

static void write_q(const Group *g, int64_t kept, int64_t total, int64_t max_q, int32_t *q_tok, float *q_p) {
    for (int64_t i = 0; i < max_q; i++) {
        q_tok[i] = i < kept ? g[i].token : -1;
        q_p[i] = i < kept ? (float)((double)g[i].count / (double)total) : 0.0f;
    }
}

#define MAX_Q 64 /* groups a step can hold: num_samples and max_q are capped to it */

/* The sampled walk over a global index (see suffix_walk for the match and the outputs; out_freq[k] is q_k's
 * largest probability). uniforms[0..max_tokens): the draws. */
int64_t suffix_sample_walk(const int32_t *text, int64_t n_text, const int32_t *sa, int64_t n_sa,
                           const int32_t *ctx, int64_t n_ctx, int64_t min_ctx, int64_t max_ctx, int64_t depth,
                           int64_t max_tokens, float min_path_prob, int64_t num_samples, int64_t max_q,
                           const float *uniforms, int32_t *out_tokens, float *out_freq, int32_t *out_count,
                           int32_t *out_match, const float *table, float *out_conf, int32_t *out_q_tokens,
                           float *out_q_probs) {
    if (n_sa == 0 || n_ctx <= 0) return 0;
    if (num_samples > MAX_Q) num_samples = MAX_Q;
    if (max_q > MAX_Q) max_q = MAX_Q;
    int32_t pat[256];
    Group g[MAX_Q];
    int64_t lo = 0, hi = 0;
    int64_t m = index_match(text, n_text, sa, n_sa, ctx, n_ctx, min_ctx, max_ctx, pat, &lo, &hi);
    if (m == 0) return 0;
    int64_t k = 0;
    float path = 1.0f;
    while (k < max_tokens && m < depth && m < 255) {
        int64_t run = hi - lo, n = 0;
        int64_t step = run <= num_samples ? run : num_samples;
        for (int64_t s = 0; s < step; s++) { /* exact entries, or strided samples (sorted: groups stay together) */
            int64_t i = run <= num_samples ? lo + s : lo + (run * s + run / 2) / num_samples;
            int32_t t = token_at(text, n_text, (int64_t)sa[i] + m);
            if (t < 0) continue; /* a document ends here: not a continuation */
            if (n > 0 && g[n - 1].token == t) g[n - 1].count++;
            else { g[n].token = t; g[n].count = 1; n++; }
        }
        if (n == 0) break;
        int64_t total;
        int64_t kept = top_groups(g, n, max_q, &total);
        float qmax = (float)((double)g[0].count / (double)total);
        path *= qmax;
        if (path < min_path_prob) break; /* decided from q's shape, before the draw */
        int64_t c = draw_group(g, kept, total, uniforms[k]);
        pat[m] = g[c].token;
        int64_t a, b;
        run_of(text, n_text, sa, lo, hi, pat, m + 1, &a, &b);
        emit(k, g[c].token, qmax, run, m, table, out_tokens, out_freq, out_count, out_match, out_conf);
        write_q(g, kept, total, max_q, out_q_tokens + k * max_q, out_q_probs + k * max_q);
        k++;
        lo = a; hi = b; m++;
        if (b <= a) break;
    }
    return k;
}

/* The sampled walk over one request's own text (the occurrences of request_walk; all of them counted, up
 * to max_occurrences, the most recent). */
int64_t request_sample_walk(const int32_t *seq, int64_t n, int64_t min_ctx, int64_t max_ctx, int64_t max_tokens,
                            float min_path_prob, int64_t max_occurrences, int64_t *work, int64_t max_q,
                            const float *uniforms, int32_t *out_tokens, float *out_freq, int32_t *out_count,
                            int32_t *out_match, const float *table, float *out_conf, int32_t *out_q_tokens,
                            float *out_q_probs) {
    if (n < 2) return 0;
    if (max_q > MAX_Q) max_q = MAX_Q;
    int64_t num = 0;
    int64_t m = request_match(seq, n, min_ctx, max_ctx, max_occurrences, work, &num);
    if (m == 0) return 0;
    Group g[MAX_Q];
    int64_t k = 0;
    float path = 1.0f;
    while (k < max_tokens && num > 0) {
        /* distinct next tokens with their counts, sorted by token (insertion: at most MAX_Q of them kept, the
         * ones past it are the rarest of a very spread context and only lower q's resolution) */
        int64_t n_g = 0, live = 0;
        for (int64_t a = 0; a < num; a++) {
            if (work[a] >= n) continue;
            live++;
            int32_t t = seq[work[a]];
            int64_t i = 0;
            while (i < n_g && g[i].token < t) i++;
            if (i < n_g && g[i].token == t) { g[i].count++; continue; }
            if (n_g == MAX_Q) continue;
            for (int64_t j = n_g; j > i; j--) g[j] = g[j - 1];
            g[i].token = t; g[i].count = 1; n_g++;
        }
        if (n_g == 0) break;
        int64_t total;
        int64_t kept = top_groups(g, n_g, max_q, &total);
        float qmax = (float)((double)g[0].count / (double)total);
        path *= qmax;
        if (path < min_path_prob) break;
        int64_t c = draw_group(g, kept, total, uniforms[k]);
        emit(k, g[c].token, qmax, live, m, table, out_tokens, out_freq, out_count, out_match, out_conf);
        write_q(g, kept, total, max_q, out_q_tokens + k * max_q, out_q_probs + k * max_q);
        k++;
        num = narrow(work, num, seq, n, g[c].token);
        m++;
    }
    return k;
}

/* Sampled walks for R requests, each from the source chosen for it (sources[r]: 0 request, 1 corpus, 2
 * served, -1 none), with table tables[r] and draws uniforms[r * max_tokens ..]. Outputs per r: out_k[r], and
 * per (r, j < max_tokens) the walk's fields, per (r, j, i < max_q) q. */
void sample_batch(int64_t R, const int64_t *seq_ptrs, const int64_t *seq_lens,
                  const int32_t *text, int64_t n_text, const int32_t *sa, int64_t n_sa, const int64_t *served,
                  int64_t depth, int64_t min_ctx, int64_t max_ctx, int64_t req_min_ctx, int64_t req_max_ctx,
                  int64_t max_tokens, float min_path_prob, int64_t num_samples, int64_t max_occurrences,
                  int64_t *work, int64_t max_q, const int64_t *sources, const int64_t *tables, const float *uniforms,
                  int32_t *out_tokens, float *out_freq, int32_t *out_count, int32_t *out_match, float *out_conf,
                  int64_t *out_k, int32_t *out_q_tokens, float *out_q_probs) {
    for (int64_t r = 0; r < R; r++) {
        const int32_t *seq = (const int32_t *)seq_ptrs[r];
        int64_t n = seq_lens[r];
        int64_t c = n < max_ctx ? n : max_ctx;
        int64_t o = r * max_tokens, oq = r * max_tokens * max_q, k = 0;
        const float *table = (const float *)tables[r];
        const float *u = uniforms + o;
        const int32_t *t, *a;
        int64_t nt, na;
        if (sources[r] == 0)
            k = request_sample_walk(seq, n, req_min_ctx, req_max_ctx, max_tokens, min_path_prob, max_occurrences,
                                    work, max_q, u, out_tokens + o, out_freq + o, out_count + o, out_match + o, table,
                                    out_conf + o, out_q_tokens + oq, out_q_probs + oq);
        else if (sources[r] > 0 && index_of(sources[r], r, text, n_text, sa, n_sa, served, &t, &nt, &a, &na))
            k = suffix_sample_walk(t, nt, a, na, seq + n - c, c, min_ctx, max_ctx, depth, max_tokens, min_path_prob,
                                   num_samples, max_q, u, out_tokens + o, out_freq + o, out_count + o, out_match + o,
                                   table, out_conf + o, out_q_tokens + oq, out_q_probs + oq);
        out_k[r] = k;
    }
}
