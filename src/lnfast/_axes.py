"""Normalization over any axes (SPEC "Axes"), for both backends.

The backends normalize rows over a last axis.  Any other `axis` is brought
to that form with views: the normalized axes are moved last (a transposed
view, no copy) and merged into one axis of D elements where their strides
allow, which for one axis, or for neighbouring axes of an array in C or
Fortran order, they always do.  A channels-first (N, C, H, W) array over
C thus reaches the kernels as N*H*W rows of C elements H*W apart, with
neighbouring rows adjacent: the layout the CPU's tile kernels take
(docs/design.md, "Rows far apart").  Normalized axes that do not merge
(say axes 1 and 3 of a C-ordered array) are gathered into scratch a block
of whole leading indices at a time (at most GATHER_BYTES of x, not a copy
of it), each block normalized as rows and its outputs copied into place;
the backward adds the blocks' float64 sums of dweight/dbias in block order
and rounds them once.  Outputs whose normalized axes do not merge (y, z,
dx are C-ordered, so over axes that are not neighbours) are computed in
scratch and copied into place.
"""
import math

import numpy as np

from lnfast import _checks, _cpu

# Bytes of x gathered at a time where its normalized axes do not merge.
GATHER_BYTES = 8 << 20


class _Layout:
    """Where the normalized axes `ax` of arrays of x's shape go."""

    def __init__(self, shape, ax):
        self.ax = ax
        self.others = tuple(k for k in range(len(shape)) if k not in ax)
        self.perm = self.others + ax
        self.lead = tuple(shape[k] for k in self.others)
        self.norm = tuple(shape[k] for k in ax)
        self.D = math.prod(self.norm)

    def moved(self, a):
        """a with the normalized axes last, in increasing order (a view)."""
        return a.transpose(self.perm)

    def merges(self, a):
        """Whether a's normalized axes merge into one strided axis."""
        k = len(self.lead)
        t = [(n, st) for n, st in zip(self.moved(a).shape[k:], self.moved(a).strides[k:])
             if n != 1]
        return all(st == st2 * n2 for (_, st), (n2, st2) in zip(t, t[1:]))

    def rows(self, a):
        """a as rows: shape lead + (D,), a view where the axes merge, else
        a copy."""
        if a is None:
            return None
        return self.moved(a).reshape(self.lead + (self.D,))

    def unrows(self, r, dest):
        """Copy rows `r` into `dest` (of x's shape)."""
        self.moved(dest)[...] = r.reshape(self.lead + self.norm)

    def vector(self, p):
        """weight or bias as the length-D vector the kernels take."""
        return None if p is None else p.reshape(self.D)


def _blocks(L, itemsize):
    """Index tuples over the moved arrays' leading axes, in order, each
    taking whole leading indices of at most GATHER_BYTES (one row where a
    row is longer)."""
    lead = L.lead
    target = max(1, GATHER_BYTES // max(1, L.D * itemsize))
    k, inner = len(lead), 1
    while k > 0 and inner * lead[k - 1] <= target:
        inner *= lead[k - 1]
        k -= 1
    if k == 0:
        yield (Ellipsis,)       # (all of it; a 0-d mean stays an array)
        return
    step = max(1, target // inner)
    for outer in np.ndindex(*lead[:k - 1]):
        for i in range(0, lead[k - 1], step):
            yield outer + (slice(i, min(i + step, lead[k - 1])),)


def _shares(a, others):
    """Whether array a may share memory with any of `others` (None: absent)."""
    if _checks.is_cupy(a):
        import cupy

        share = cupy.may_share_memory
    else:
        share = np.may_share_memory
    return any(o is not None and share(a, o) for o in others)


def _gathered(L, a, idx):
    """Block idx of a's rows (a copy: a's normalized axes do not merge)."""
    if a is None:
        return None
    b = L.moved(a)[idx]
    return b.reshape(b.shape[:b.ndim - len(L.norm)] + (L.D,))


def rounded(total, dtype):
    """float64 sums rounded once to `dtype`, as the kernels round them."""
    gpu = _checks.is_cupy(total)
    host = total.get() if gpu else total
    out = _cpu.round_sums(np.ascontiguousarray(host), dtype)
    if not gpu:
        return out
    import cupy

    with total.device:
        return cupy.asarray(out)


def _forward_blocks(kernels, L, x, residual, weight, bias, eps, y, z, centered, stats):
    """forward where x's normalized axes do not merge: by blocks (_blocks),
    into y and z (x's shape); (mean, rstd) of the leading shape."""
    mean = rstd = None
    for idx in _blocks(L, x.dtype.itemsize):
        yr, zr, m, r = kernels.forward(
            _gathered(L, x, idx), _gathered(L, residual, idx), L.vector(weight),
            L.vector(bias) if centered else None, eps, None, centered, stats, None)
        L.moved(y)[idx] = yr.reshape(yr.shape[:-1] + L.norm)
        if z is not None:
            L.moved(z)[idx] = zr.reshape(zr.shape[:-1] + L.norm)
        if stats:
            if rstd is None:
                rstd = kernels.empty(L.lead, r.dtype)
                mean = kernels.empty(L.lead, m.dtype) if centered else None
            rstd[idx] = r
            if centered:
                mean[idx] = m
    return mean, rstd


def _target(L, dest):
    """Rows to write `dest` through: its own view, or None (then scratch)."""
    return L.rows(dest) if L.merges(dest) else None


def forward(kernels, x, residual, weight, bias, eps, out, centered, stats, axis):
    """kernels.forward over `axis`: (y, z, mean, rstd) as SPEC "Axes" says.
    The kernels write a C-ordered y (out= itself when it is one), and
    their choice follows the inputs' layout alone, so out= never changes a
    result's bits.  (Dask's backend takes `axis`
    itself: each block goes through here.)"""
    if getattr(kernels, "takes_axis", False):
        return kernels.forward(x, residual, weight, bias, eps, out, centered, stats, axis=axis)
    ax, _ = _checks.rows("x", x, axis)
    if ax == (x.ndim - 1,):
        return kernels.forward(x, residual, weight, bias, eps, out, centered, stats)
    eps = _checks.forward_args(x, residual, weight, bias, eps, out, centered, ax)
    L = _Layout(x.shape, ax)
    direct = out is not None and out.flags.c_contiguous
    y = out if direct else kernels.empty(x.shape, x.dtype)
    z = kernels.empty(x.shape, x.dtype) if residual is not None else None
    if not L.merges(x) and x.size > 0:
        # (a block written into out must not change what later blocks read:
        # out may be x itself, whose blocks are each read before written)
        if direct and _shares(out, (residual, weight, bias) + (() if out is x else (x,))):
            y = kernels.empty(x.shape, x.dtype)
            direct = False
        mean, rstd = _forward_blocks(kernels, L, x, residual, weight, bias, eps, y, z,
                                     centered, stats)
        if out is not None and not direct:
            out[...] = y
            y = out
        return y, z, mean, rstd
    y_rows, z_rows = _target(L, y), None if z is None else _target(L, z)
    yr, zr, mean, rstd = kernels.forward(
        L.rows(x), L.rows(residual), L.vector(weight), L.vector(bias) if centered else None,
        eps, y_rows, centered, stats, z_rows)
    if y_rows is None:
        L.unrows(yr, y)
    if z is not None and z_rows is None:
        L.unrows(zr, z)
    if out is not None and not direct:
        out[...] = y
        y = out
    return y, z, mean, rstd


def backward(kernels, dy, x, mean, rstd, weight, dz, centered, x_name, axis, partials=False):
    """kernels.backward over `axis`: (dx, dweight, dbias), the gradients of
    the normalized axes' shape (float64 and unrounded with `partials`)."""
    if getattr(kernels, "takes_axis", False):
        return kernels.backward(dy, x, mean, rstd, weight, dz, centered, x_name, axis=axis)
    ax, _ = _checks.rows(x_name, x, axis)
    if ax == (x.ndim - 1,):
        return kernels.backward(dy, x, mean, rstd, weight, dz, centered, x_name,
                                partials=partials)
    _checks.backward_args(dy, x, mean, rstd, weight, dz, centered, x_name, ax)
    L = _Layout(x.shape, ax)
    if not L.merges(x) and x.size > 0:
        return _backward_blocks(kernels, L, dy, x, mean, rstd, weight, dz, centered, x_name,
                                partials)
    dx = kernels.empty(x.shape, x.dtype)
    dx_rows = _target(L, dx)
    dxr, dw, db = kernels.backward(L.rows(dy), L.rows(x), mean, rstd, L.vector(weight),
                                   L.rows(dz), centered, x_name, dx_rows, partials)
    if dx_rows is None:
        L.unrows(dxr, dx)
    return dx, dw.reshape(L.norm), db.reshape(L.norm)


def _backward_blocks(kernels, L, dy, x, mean, rstd, weight, dz, centered, x_name, partials):
    """backward where x's normalized axes do not merge: by blocks
    (_blocks), each block's dweight/dbias as float64 sums, added in block
    order and rounded once (kept as float64 with `partials`)."""
    dx = kernels.empty(x.shape, x.dtype)
    total = None
    for idx in _blocks(L, x.dtype.itemsize):
        dxr, dw, db = kernels.backward(
            _gathered(L, dy, idx), _gathered(L, x, idx), mean[idx] if centered else None,
            rstd[idx], L.vector(weight), _gathered(L, dz, idx), centered, x_name, None, True)
        L.moved(dx)[idx] = dxr.reshape(dxr.shape[:-1] + L.norm)
        if total is None:
            total = [dw, db]
        else:
            total[0] += dw
            total[1] += db
    if not partials:
        dtype = _checks.compute_dtype(x.dtype) if weight is None else weight.dtype
        total = [rounded(t, dtype) for t in total]
    return dx, total[0].reshape(L.norm), total[1].reshape(L.norm)
