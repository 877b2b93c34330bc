"""Normalization over any axes (SPEC "Axes"), for both backends.

The backends normalize rows over a last axis.  Any other `axis` is brought
to that form with views: the normalized axes are moved last (a transposed
view, no copy) and merged into one axis of D elements where their strides
allow, which for one axis, or for neighbouring axes of an array in C or
Fortran order, they always do.  A channels-first (N, C, H, W) array over
C thus reaches the kernels as N*H*W rows of C elements H*W apart, with
neighbouring rows adjacent: the layout the CPU's tile kernels take
(docs/design.md, "Rows far apart").  Normalized axes that do not merge
(say axes 1 and 3 of a C-ordered array) are gathered into a copy; outputs
whose normalized axes do not merge (y, z, dx are C-ordered, so over axes
that are not neighbours) are computed in scratch and copied into place.
"""
import math

from lnfast import _checks


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
    dx = kernels.empty(x.shape, x.dtype)
    dx_rows = _target(L, dx)
    dxr, dw, db = kernels.backward(L.rows(dy), L.rows(x), mean, rstd, L.vector(weight),
                                   L.rows(dz), centered, x_name, dx_rows, partials)
    if dx_rows is None:
        L.unrows(dxr, dx)
    return dx, dw.reshape(L.norm), db.reshape(L.norm)
