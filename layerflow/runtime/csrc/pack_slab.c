/*
 * The native packer of a bucket's host slab (runtime/native_staging.py): one call writes every per-batch integer of
 * an item-id batch (query offsets, history and appended lengths, the page table, token ids with their range check,
 * positions, candidate rows and ids, 1/N) from the request's own Python lists.
 *
 * Per request the host's caches are cold, and each small Python or numpy step costs a fixed few microseconds there;
 * one call that walks the lists costs less than converting them to arrays first. It is an extension module's
 * METH_FASTCALL function (run with the GIL held): cold, such a call costs a fraction of a ctypes call's libffi and
 * argument conversions (measured ~6 vs ~29 us on the development CPU with its caches flushed).
 *
 * The slab's layout and the packer's memory of the last batch live in a `layerflow_slab` the Python side fills once
 * per slab. A page-table row remembers the tuple it was written from (`held`, a Python list owning those tuples): a
 * page whose int object is the one the row held is already in place, so a returning GPU hit converts only its new
 * pages. On any error the slab stays consistent (what was written is remembered and cleared by the next batch).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* What a failed call returns; the values are native_staging.PackStatus's. */
enum {
    LAYERFLOW_PACK_OK = 0,
    LAYERFLOW_PACK_BAD_ID = 1,        /* an id not an int in [0, vocab): the caller names it */
    LAYERFLOW_PACK_BAD_INPUT = 2,     /* a list or tuple of the wrong type, a bad cached length or page id */
    LAYERFLOW_PACK_TOO_LARGE = 3,     /* more users, tokens or pages than the slab holds */
    LAYERFLOW_PACK_NO_TOKENS = 4,     /* batch rule with N = 0 */
};

typedef struct {
    int32_t *slab;            /* the host slab's first int32 */
    int64_t vocab;            /* ids must lie in [0, vocab) */
    int32_t max_batch, max_tokens, max_pages;
    int32_t batch_n;          /* nonzero: write 1/N (N = longest cached + longest query) as float32 bits */
    /* each field's first int32 in the slab (runtime/staging.py's slab_fields) */
    int32_t q_offsets, history_lens, appended_lens, page_table, ids, positions, candidate_rows, candidate_ids, inv_n;
    int32_t tokens_written, candidates_written;   /* entries the last batch wrote: a smaller next batch clears them */
} layerflow_slab;

static int fail(int status)
{
    if (PyErr_Occurred() != NULL)
        PyErr_Clear();
    return status;
}

/* Append one user's ids from `list` at slab[ids + row...]; their positions are `position` (+ j when `step`). */
static int put_ids(layerflow_slab *s, PyObject *list, Py_ssize_t count, int32_t row, int32_t position, int step)
{
    int32_t *ids = s->slab + s->ids + row, *positions = s->slab + s->positions + row;
    for (Py_ssize_t j = 0; j < count; j++) {
        long long value = PyLong_AsLongLong(PyList_GetItem(list, j));
        if (value < 0 || value >= s->vocab)
            return fail(LAYERFLOW_PACK_BAD_ID);   /* -1 with an error set is refused here too */
        ids[j] = (int32_t)value;
        positions[j] = step ? position + (int32_t)j : position;
    }
    return LAYERFLOW_PACK_OK;
}

/* Row `b` of the page table from the tuple `pages` (NULL: no user), then zeros up to what the row held. */
static int put_pages(layerflow_slab *s, PyObject *held, PyObject *empty, Py_ssize_t b, PyObject *pages)
{
    PyObject *old = PyList_GetItem(held, b), *row = pages != NULL ? pages : empty;
    if (row == old)
        return LAYERFLOW_PACK_OK;
    Py_ssize_t n = pages != NULL ? PyTuple_Size(pages) : 0, k = PyTuple_Size(old);
    int32_t *table = s->slab + s->page_table + b * s->max_pages;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *page = PyTuple_GetItem(row, i);
        if (i < k && page == PyTuple_GetItem(old, i))
            continue;   /* the same int object the row holds: its value is in place */
        long long value = PyLong_AsLongLong(page);
        if (value < 0 || value > INT32_MAX) {
            memset(table, 0, sizeof(int32_t) * (size_t)(n > k ? n : k));
            Py_IncRef(empty);
            PyList_SetItem(held, b, empty);
            return fail(LAYERFLOW_PACK_BAD_INPUT);
        }
        table[i] = (int32_t)value;
    }
    if (k > n)
        memset(table + n, 0, sizeof(int32_t) * (size_t)(k - n));
    Py_IncRef(row);
    PyList_SetItem(held, b, row);   /* steals the new reference, releases the old row */
    return LAYERFLOW_PACK_OK;
}

/* Zero [from, to) of a field. */
static void clear(int32_t *field, int32_t from, int32_t to)
{
    if (to > from)
        memset(field + from, 0, sizeof(int32_t) * (size_t)(to - from));
}

/*
 * Pack a batch: `cached` a list of ints, `appended` and `candidates` lists of lists of ints, `page_rows` a list of
 * tuples of ints, one per user; `held` the list of tuples the table rows were written from (max_batch of them),
 * `empty` the empty tuple. Returns a LAYERFLOW_PACK_* status.
 */
static int pack_slab(layerflow_slab *s, PyObject *cached, PyObject *appended, PyObject *candidates,
                        PyObject *page_rows, PyObject *held, PyObject *empty)
{
    Py_ssize_t users = PyList_Size(cached);
    if (users < 0 || PyList_Size(appended) != users || PyList_Size(candidates) != users ||
        PyList_Size(page_rows) != users)
        return fail(LAYERFLOW_PACK_BAD_INPUT);
    if (users > s->max_batch)
        return LAYERFLOW_PACK_TOO_LARGE;
    int64_t tokens = 0;
    for (Py_ssize_t b = 0; b < users; b++) {
        Py_ssize_t a = PyList_Size(PyList_GetItem(appended, b)), k = PyList_Size(PyList_GetItem(candidates, b));
        Py_ssize_t pages = PyTuple_Size(PyList_GetItem(page_rows, b));
        if (a < 0 || k < 0 || pages < 0)
            return fail(LAYERFLOW_PACK_BAD_INPUT);
        if (pages > s->max_pages)
            return LAYERFLOW_PACK_TOO_LARGE;
        tokens += a + k;
    }
    if (tokens > s->max_tokens)
        return LAYERFLOW_PACK_TOO_LARGE;

    int32_t *slab = s->slab, row = 0, first_candidate = 0, longest_cached = 0, longest_query = 0;
    int status = LAYERFLOW_PACK_OK;
    for (Py_ssize_t b = 0; b < users && status == LAYERFLOW_PACK_OK; b++) {
        PyObject *a_ids = PyList_GetItem(appended, b), *k_ids = PyList_GetItem(candidates, b);
        long long c = PyLong_AsLongLong(PyList_GetItem(cached, b));
        int32_t a = (int32_t)PyList_Size(a_ids), k = (int32_t)PyList_Size(k_ids);
        if (c < 0 || c + a + k > INT32_MAX) {
            status = fail(LAYERFLOW_PACK_BAD_INPUT);
            break;
        }
        status = put_ids(s, a_ids, a, row, (int32_t)c, 1);
        if (status == LAYERFLOW_PACK_OK)
            status = put_ids(s, k_ids, k, row + a, (int32_t)c + a, 0);
        if (status != LAYERFLOW_PACK_OK) {
            row += a + k;   /* what may have been written, so the next batch clears it */
            break;
        }
        for (int32_t j = 0; j < k; j++) {
            slab[s->candidate_rows + first_candidate + j] = row + a + j;
            slab[s->candidate_ids + first_candidate + j] = slab[s->ids + row + a + j];
        }
        slab[s->q_offsets + b] = row;
        slab[s->history_lens + b] = (int32_t)c + a;
        slab[s->appended_lens + b] = a;
        longest_cached = (int32_t)c > longest_cached ? (int32_t)c : longest_cached;
        longest_query = a + k > longest_query ? a + k : longest_query;
        row += a + k;
        first_candidate += k;
    }
    if (status != LAYERFLOW_PACK_OK) {
        s->tokens_written = row > s->tokens_written ? row : s->tokens_written;
        s->candidates_written = first_candidate > s->candidates_written ? first_candidate : s->candidates_written;
        return status;
    }
    if (s->batch_n && longest_cached + longest_query == 0)
        return LAYERFLOW_PACK_NO_TOKENS;
    clear(slab + s->ids, row, s->tokens_written);
    clear(slab + s->positions, row, s->tokens_written);
    clear(slab + s->candidate_rows, first_candidate, s->candidates_written);
    clear(slab + s->candidate_ids, first_candidate, s->candidates_written);
    s->tokens_written = row;
    s->candidates_written = first_candidate;
    for (int32_t b = (int32_t)users; b < s->max_batch; b++) {
        slab[s->q_offsets + b] = row;
        slab[s->history_lens + b] = 0;
        slab[s->appended_lens + b] = 0;
    }
    slab[s->q_offsets + s->max_batch] = row;
    if (s->batch_n) {
        float inv_n = (float)(1.0 / (double)(longest_cached + longest_query));
        memcpy(slab + s->inv_n, &inv_n, sizeof inv_n);
    }
    for (Py_ssize_t b = 0; b < s->max_batch; b++) {
        status = put_pages(s, held, empty, b, b < users ? PyList_GetItem(page_rows, b) : NULL);
        if (status != LAYERFLOW_PACK_OK)
            return status;
    }
    return LAYERFLOW_PACK_OK;
}

/* The lengths of each list in `lists` (users of them), as a new list of ints. */
static PyObject *lengths(PyObject *lists, Py_ssize_t users)
{
    PyObject *out = PyList_New(users);
    for (Py_ssize_t b = 0; out != NULL && b < users; b++) {
        PyObject *n = PyLong_FromSsize_t(PyList_Size(PyList_GetItem(lists, b)));
        if (n == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, b, n);
    }
    return out;
}

static PyObject *empty_tuple;

/*
 * pack(state address, cached, appended, candidates, page rows, held): the batch into the slab; on success the
 * batch's record (a copy of cached, the appended and candidate lengths, query tokens, candidates), else the failed
 * LAYERFLOW_PACK_* status as an int.
 */
static PyObject *pack(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "pack takes 6 arguments, got %zd", nargs);
        return NULL;
    }
    layerflow_slab *s = PyLong_AsVoidPtr(args[0]);
    if (s == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "pack: the slab state's address is 0");
        return NULL;
    }
    int status = pack_slab(s, args[1], args[2], args[3], args[4], args[5], empty_tuple);
    if (status != LAYERFLOW_PACK_OK)
        return PyLong_FromLong(status);
    Py_ssize_t users = PyList_Size(args[1]);
    PyObject *cached = PyList_GetSlice(args[1], 0, users), *appended = lengths(args[2], users);
    PyObject *candidates = lengths(args[3], users), *record = NULL;
    if (cached != NULL && appended != NULL && candidates != NULL)
        record = Py_BuildValue("(OOOii)", cached, appended, candidates, s->tokens_written, s->candidates_written);
    Py_XDECREF(cached);
    Py_XDECREF(appended);
    Py_XDECREF(candidates);
    return record;
}

static PyMethodDef methods[] = {
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL, "Pack an item-id batch into a bucket's host slab."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "layerflow_pack_slab", NULL, -1, methods};

PyMODINIT_FUNC PyInit_layerflow_pack_slab(void)
{
    empty_tuple = PyTuple_New(0);
    return empty_tuple != NULL ? PyModule_Create(&module) : NULL;
}
