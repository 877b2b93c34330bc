"""Dask arrays (SPEC "Frameworks and engines"): every public function on
Dask arrays of NumPy or CuPy blocks, lazily.

lnfast._dispatch sends a call here when x (or z) is a Dask array; each
block then goes back through lnfast's own backends with the call's `axis`,
so a block's rows get the bits the same call on the whole array gives.
The normalized axes must each be one chunk, in x and in every array of
x's shape (residual, dy, dz), and a Dask weight or bias one chunk.  The
rows may be in chunks of unknown size (x[mask]); the normalized axes not.

- Forward: one task per block of rows returns the tuple of its outputs;
  one layer per output picks its item (as dask.array.apply_gufunc does).
- Backward: each block returns dx and its dweight/dbias as float64 sums,
  unrounded; a tree adds those of SPLIT_EVERY neighbouring blocks at a
  time, always in block order, and the top rounds once to the gradients'
  dtype.  For a given chunking the bits are thus those of the graph, not
  of the scheduler or the number of workers.
- Names derive from a token of every input and argument, so calls that
  differ in any (eps, axis, ...) never share a task.
- Threads: a task on a worker thread or in a worker process runs lnfast on
  one thread, unless the user chose a count (lnfast._threads.task_threads).
"""
import operator

import dask.array as da
import numpy as np
from dask.array.utils import meta_from_array
from dask.base import tokenize
from dask.core import flatten
from dask.highlevelgraph import HighLevelGraph

from lnfast import _axes, _checks, _threads
from lnfast._dispatch import backend

# lnfast._axes hands `axis` to this backend rather than moving axes itself.
takes_axis = True

# Blocks' float64 partial sums added per task of the reduction tree.
SPLIT_EVERY = 8


# --- checks ---------------------------------------------------------------------

def _kind(a):
    """What a block of Dask array a, or array a itself, is."""
    block = a._meta if _checks.is_dask(a) else a
    if _checks.is_cupy(block):
        return "cupy.ndarray"
    if isinstance(block, np.ma.MaskedArray):
        return "numpy.ma.MaskedArray"
    return "numpy.ndarray" if isinstance(block, np.ndarray) else type(block).__name__


def _inputs(x_name, x, shaped, stats, params, axis):
    """Checks of what Dask adds (the rest is lnfast._checks'): the arrays
    of x's shape (residual, dy, dz) and of its rows' (mean, rstd) must be
    Dask arrays too, weight and bias Dask arrays or arrays of x's blocks'
    kind, and every block of x's kind.  Chunks of unknown size (x[mask], a
    DataFrame's to_dask_array()) may hold the rows, in every array where
    x's do, but not the normalized axes nor weight and bias.  Returns
    weight and bias, copied where they are arrays (the graph holds them: a
    later change in place must not reach the result)."""
    for name, a in shaped + stats:
        if a is not None and not _checks.is_dask(a):
            raise TypeError(f"{name} is a {type(a).__module__}.{type(a).__name__} but {x_name} "
                            f"is a dask.array.Array: pass both as Dask arrays")
    blocks = _kind(x)
    if blocks not in ("numpy.ndarray", "cupy.ndarray"):
        why = " (their masks would be ignored)" if blocks == "numpy.ma.MaskedArray" else ""
        raise TypeError(f"the blocks of {x_name} must be NumPy or CuPy arrays, got {blocks}s"
                        f"{why}")
    for name, a in [(x_name, x), *shaped, *stats, *params]:
        if a is not None and _kind(a) != blocks:
            what = f"{name}'s blocks are {_kind(a)}s" if _checks.is_dask(a) else \
                f"{name} is a {_kind(a)}"
            raise TypeError(f"{what} but the blocks of {x_name} are {blocks}s: "
                            f"pass arrays of one kind")
    ax, _ = _checks.rows(x_name, x, axis)
    rows = [n for k, n in enumerate(x.shape) if k not in ax]
    for name, a in [(x_name, x), *shaped]:
        if a is not None and a.ndim == x.ndim:
            _known(name, [a.shape[k] for k in ax], " along the normalized axes", a.shape)
            _unknown_alike(name, [n for k, n in enumerate(a.shape) if k not in ax], x_name, rows)
    for name, a in stats:
        if a is not None and a.ndim == len(rows):
            _unknown_alike(name, a.shape, x_name, rows)
    for name, p in params:
        if _checks.is_dask(p):
            _known(name, p.shape, "", p.shape)
    return [p if p is None or _checks.is_dask(p) else p.copy() for _, p in params]


def _known(name, lengths, where, shape):
    if any(_checks.unknown(n) for n in lengths):
        raise ValueError(f"{name} has chunks of unknown size{where} (its shape is {shape}): call "
                         f"{name}.compute_chunk_sizes() first")


def _unknown_alike(name, lengths, x_name, rows):
    """An array's rows of unknown size where x's are, and only there."""
    if [_checks.unknown(n) for n in lengths] != [_checks.unknown(n) for n in rows]:
        raise ValueError(f"{name}'s rows {tuple(lengths)} are of unknown size where {x_name}'s "
                         f"{tuple(rows)} are not, or the reverse, so they cannot be matched: call "
                         f"compute_chunk_sizes() on both first")


def _rechunked(name, a, chunks, x_name):
    """a (None, or of x's shape or its rows') in `chunks` (x's, or its
    rows'); along an axis of unknown size (the same in both: _inputs) the
    chunks must be alike, as many, unknown where x's are and of x's
    lengths elsewhere, since no length is known to rechunk by.  Each
    block's own shape is checked when it runs."""
    if a is None:
        return a
    for k, (p, q) in enumerate(zip(a.chunks, chunks)):
        if not any(_checks.unknown(n) for n in p + q):
            continue
        if len(p) != len(q):
            raise ValueError(f"{name} has {len(p)} chunks along axis {k} where {x_name} has "
                             f"{len(q)}, of unknown size there, so they cannot be matched: "
                             f"call compute_chunk_sizes() on both first")
        if [None if _checks.unknown(n) else n for n in p] != \
                [None if _checks.unknown(n) else n for n in q]:
            raise ValueError(f"{name}'s chunks along axis {k} {p} are not {x_name}'s {q}: where "
                             f"sizes are unknown they cannot be matched, call "
                             f"compute_chunk_sizes() on both first")
    return a if a.chunks == chunks else a.rechunk(chunks)


def _one_chunk(name, x, ax):
    """Each normalized axis (ax, of x's own; None: every axis, as in a
    weight) in one chunk, as dask.array.apply_gufunc asks of every core
    dimension.  Nothing for x None or not a Dask array."""
    if x is None or not _checks.is_dask(x):
        return
    if ax is None:
        if any(len(c) > 1 for c in x.chunks):
            raise ValueError(f"{name} must be a single chunk, got chunks {x.chunks}: rechunk it "
                             f"first, {name}.rechunk(-1)")
        return
    split = [k for k in ax if len(x.chunks[k]) > 1]
    if split:
        spec = ", ".join(f"{k}: -1" for k in split)
        raise ValueError(
            f"{name} must be a single chunk along the normalized axes {ax}, got chunks "
            f"{tuple(x.chunks[k] for k in split)} along axes {tuple(split)}: rechunk it first, "
            f"{name}.rechunk({{{spec}}})")


# --- one block ------------------------------------------------------------------

def _dense(a, axis):
    """A block as the whole array's call sees it.  Rows whose elements are
    adjacent give the same bits wherever they lie; otherwise the layout
    picks the kernel (rows far apart go by tiles), so such a view (a block
    of an array chunked along a middle axis, or a transposed one) is made
    C-ordered, as the computed array is."""
    if a is None or a.flags.c_contiguous:
        return a
    if _checks.axes(axis, a.ndim) == (a.ndim - 1,) and a.strides[-1] == a.itemsize:
        return a
    return (_cupy() if _checks.is_cupy(a) else np).ascontiguousarray(a)


def _forward_block(x, residual, weight, bias, *, eps, centered, stats, axis):
    x, residual = _dense(x, axis), _dense(residual, axis)
    with _threads.task_threads():
        kernels = backend("x residual weight bias", x, residual, weight, bias)
        return _axes.forward(kernels, x, residual, weight, bias, eps, None, centered, stats,
                             axis)


def _backward_block(dy, x, mean, rstd, weight, dz, *, centered, x_name, axis):
    """(dx, the float64 sums [dweight, dbias] of the block's rows)."""
    dy, x, dz = _dense(dy, axis), _dense(x, axis), _dense(dz, axis)
    with _threads.task_threads():
        kernels = backend("x dy mean rstd weight dz", x, dy, mean, rstd, weight, dz)
        dx, dw, db = _axes.backward(kernels, dy, x, mean, rstd, weight, dz, centered, x_name,
                                    axis, partials=True)
    xp = _cupy() if _checks.is_cupy(dx) else np
    return dx, xp.stack((dw, db)) if centered else dw[None]


def _sum_in_order(parts):
    total = parts[0].copy()
    for p in parts[1:]:
        total += p
    return total


def _cupy():
    import cupy

    return cupy


# --- graphs ---------------------------------------------------------------------

def _param(p, ax):
    """A weight or bias as blockwise takes it: a Dask array (one block,
    _one_chunk) indexed by the normalized axes, so that every block of x
    sees all of it, else a constant."""
    return (p, ax) if _checks.is_dask(p) else (p, None)


def _split(tmp, item, label, keep, chunks, meta):
    """Output `item` of the tuples tmp's tasks return, as an array of
    `chunks`, over tmp's axes `keep` (all for y, the rows' axes for mean)."""
    base, token = tmp.name.rsplit("-", 1)
    name = f"{base}-{label}-{token}"
    dsk = {(name, *(key[1 + k] for k in keep)): (operator.getitem, key, item)
           for key in flatten(tmp.__dask_keys__())}
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=[tmp])
    return da.Array(graph, name, chunks=chunks, meta=meta_from_array(meta, len(keep)))


def forward(x, residual, weight, bias, eps, out, centered, stats, z_out=None, axis=-1):
    """(y, z, mean, rstd) as Dask arrays (None where not computed)."""
    if out is not None:
        raise TypeError("out must be None for Dask arrays, which are never written in place; "
                        "use the returned array")
    weight, bias = _inputs("x", x, [("residual", residual)], [],
                           [("weight", weight), ("bias", bias)], axis)
    eps = _checks.forward_args(x, residual, weight, bias, eps, None, centered, axis)
    ax = _checks.axes(axis, x.ndim)
    for name, a, a_ax in (("x", x, ax), ("residual", residual, ax), ("weight", weight, None),
                          ("bias", bias if centered else None, None)):
        _one_chunk(name, a, a_ax)
    ind = tuple(range(x.ndim))
    lead = tuple(k for k in ind if k not in ax)
    residual = _rechunked("residual", residual, x.chunks, "x")      # (the rows' chunks)
    xm = x._meta
    compute = _checks.compute_dtype(x.dtype)
    wanted = (True, residual is not None, stats and centered, stats)
    metas = (meta_from_array(xm, x.ndim, x.dtype), meta_from_array(xm, x.ndim, x.dtype),
             meta_from_array(xm, len(lead), compute), meta_from_array(xm, len(lead), compute))
    token = tokenize(x, residual, weight, bias, eps, centered, stats, axis)
    # (over every axis of x, the normalized ones a single block: no block
    # is concatenated, so none is copied)
    tmp = da.blockwise(
        _forward_block, ind, x, ind, residual, ind if residual is not None else None,
        *_param(weight, ax), *_param(bias if centered else None, ax),
        name=f"lnfast-forward-{token}", meta=metas, eps=eps, centered=centered, stats=stats,
        axis=axis)
    lead_chunks = tuple(tmp.chunks[k] for k in lead)
    outs = []
    for item, (label, meta) in enumerate(zip(("y", "z", "mean", "rstd"), metas)):
        if not wanted[item]:
            outs.append(None)
        elif item < 2:
            outs.append(_split(tmp, item, label, ind, tmp.chunks, meta))
        else:
            outs.append(_split(tmp, item, label, lead, lead_chunks, meta))
    return tuple(outs)


def backward(dy, x, mean, rstd, weight, dz, centered, x_name="x", dx_out=None, axis=-1):
    """(dx, dweight, dbias) as Dask arrays; dbias is zeros for RMSNorm."""
    (weight,) = _inputs(x_name, x, [("dy", dy), ("dz", dz)],
                        [("mean", mean if centered else None), ("rstd", rstd)],
                        [("weight", weight)], axis)
    _checks.backward_args(dy, x, mean, rstd, weight, dz, centered, x_name, axis)
    ax = _checks.axes(axis, x.ndim)
    for name, a, a_ax in ((x_name, x, ax), ("dy", dy, ax), ("dz", dz, ax),
                          ("weight", weight, None)):
        _one_chunk(name, a, a_ax)
    ind = tuple(range(x.ndim))
    lead = tuple(k for k in ind if k not in ax)
    lead_chunks = tuple(x.chunks[k] for k in lead)
    dy = _rechunked("dy", dy, x.chunks, x_name)     # (the rows' chunks, as mean's and rstd's)
    dz = _rechunked("dz", dz, x.chunks, x_name)
    mean = _rechunked("mean", mean, lead_chunks, x_name) if centered else None
    rstd = _rechunked("rstd", rstd, lead_chunks, x_name)
    xm = x._meta
    norm = tuple(x.shape[k] for k in ax)
    grads = np.dtype(_checks.compute_dtype(x.dtype) if weight is None else weight.dtype)
    token = tokenize(dy, x, mean, rstd, weight, dz, centered, x_name, axis)
    tmp = da.blockwise(
        _backward_block, ind, dy, ind, x, ind, mean, lead if mean is not None else None,
        rstd, lead, *_param(weight, ax), dz, ind if dz is not None else None,
        name=f"lnfast-backward-{token}",
        meta=(meta_from_array(xm, x.ndim, x.dtype), meta_from_array(xm, 1 + len(ax), np.float64)),
        centered=centered, x_name=x_name, axis=axis)
    dx = _split(tmp, 0, "dx", ind, tmp.chunks, xm)
    dw, db = _reduced(tmp, token, norm, grads, xm, centered)
    return dx, dw, db


def _reduced(tmp, token, norm, grads, meta, centered):
    """dweight and dbias: the blocks' float64 sums added in block order by a
    tree of SPLIT_EVERY-wide tasks, rounded once to `grads`; the tree is
    one layer, an array of the rounded [dweight, dbias] (one block)."""
    name = f"lnfast-grads-{token}"
    dsk = {}
    level = []
    for j, key in enumerate(flatten(tmp.__dask_keys__())):
        dsk[(f"{name}-tree", 0, j)] = (operator.getitem, key, 1)
        level.append((f"{name}-tree", 0, j))
    depth = 0
    while len(level) > 1:
        depth += 1
        groups = [level[i:i + SPLIT_EVERY] for i in range(0, len(level), SPLIT_EVERY)]
        level = []
        for j, group in enumerate(groups):
            dsk[(f"{name}-tree", depth, j)] = (_sum_in_order, group)
            level.append((f"{name}-tree", depth, j))
    rows = 2 if centered else 1
    dsk[(name,) + (0,) * (1 + len(norm))] = (_axes.rounded, level[0], grads)
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=[tmp])
    both = da.Array(graph, name, chunks=((rows,),) + tuple((n,) for n in norm),
                    meta=meta_from_array(meta, 1 + len(norm), grads))
    if centered:
        return both[0], both[1]
    # (RMSNorm's backends return zeros there, unused)
    return both[0], da.zeros(norm, dtype=grads, meta=meta_from_array(meta, len(norm), grads))
