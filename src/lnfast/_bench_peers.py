"""`python -m lnfast bench --peers`: onnxruntime's and XLA's LayerNorm and
RMSNorm beside lnfast's, where they are installed.

onnxruntime runs the ONNX operators LayerNormalization (opset 17) and
RMSNormalization (opset 23) and its own fused SkipLayerNormalization
(com.microsoft) for the add, forward only (an inference runtime has no
backward), `intra_op_num_threads` set to lnfast's threads, through
`InferenceSession.run` as its users call it.  XLA compiles, under
`jax.jit`, the very code of the NumPy baseline (lnfast._bench) over
jax.numpy: the forward, and the backward from (dy, x, mean, rstd, weight)
as lnfast's, so that both read and write the same arrays; XLA sizes its
own thread pool (to the machine's CPUs).  A dtype a runtime does not
implement is left out.
"""
import functools

import numpy as np

from lnfast._bench import (EPS, _numpy_backward, _numpy_forward, _numpy_rms_backward,
                           _numpy_rms_forward)

ORT = "onnxruntime"
XLA = "xla"


def cases(x, r, w, b, dy, stats, threads):
    """{(function, implementation): zero-argument callable} for both peers;
    stats: lnfast._bench._statistics' of the same arrays."""
    out = {}
    for make in (_ort_cases, _xla_cases):
        try:
            out.update(make(x, r, w, b, dy, stats, threads))
        except ImportError:
            pass
    return out


# --- onnxruntime ---------------------------------------------------------------

def _ort_cases(x, r, w, b, dy, stats, threads):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    elem = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float64): TensorProto.DOUBLE}
    if x.dtype not in elem:         # (its CPU kernels: float32 and float64)
        return {}
    t = elem[x.dtype]
    M, D = x.shape

    def operator(op, inputs, outputs, opset, domain=""):
        node = helper.make_node(op, inputs, outputs, domain=domain, epsilon=EPS,
                                **({} if domain else {"axis": -1}))
        shape = {"x": [M, D], "r": [M, D], "w": [D], "b": [D], "y": [M, D], "z": [M, D]}
        graph = helper.make_graph([node], op,
                                  [helper.make_tensor_value_info(n, t, shape[n]) for n in inputs],
                                  [helper.make_tensor_value_info(n, t, shape[n])
                                   for n in outputs if n])
        opsets = [helper.make_opsetid("", opset)]
        if domain:
            opsets.append(helper.make_opsetid(domain, 1))
        model = helper.make_model(graph, opset_imports=opsets)
        model.ir_version = 10
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        feed = {n: {"x": x, "r": r, "w": w, "b": b}[n] for n in inputs}
        try:
            s = ort.InferenceSession(model.SerializeToString(), options,
                                     providers=["CPUExecutionProvider"])
            s.run(None, feed)
        except Exception:       # (onnxruntime's own errors: no kernel of this type)
            return None
        return lambda: s.run(None, feed)

    made = {
        ("layer_norm forward", ORT): operator("LayerNormalization", ["x", "w", "b"], ["y"], 17),
        ("add_layer_norm forward", ORT): operator(
            "SkipLayerNormalization", ["x", "r", "w", "b"], ["y", "", "", "z"], 17,
            "com.microsoft"),
        ("rms_norm forward", ORT): operator("RMSNormalization", ["x", "w"], ["y"], 23),
    }
    return {k: fn for k, fn in made.items() if fn is not None}


# --- XLA (jax.jit) ----------------------------------------------------------------

def _xla_cases(x, r, w, b, dy, stats, threads):
    import jax

    if x.dtype == np.float64:
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    j = {n: jnp.asarray(a) for n, a in
         {"x": x, "r": r, "w": w, "b": b, "dy": dy, **stats}.items()}
    jax.block_until_ready(list(j.values()))

    def add_forward(x, r, w, b, xp):
        z = x + r
        return _numpy_forward(z, w, b, xp), z

    def add_backward(dy, z, mean, rstd, w, dz, xp):
        dx, dw, db = _numpy_backward(dy, z, mean, rstd, w, xp)
        return dx + dz, dw, db

    def timed(f, *names):
        f = jax.jit(functools.partial(f, xp=jnp))
        args = [j[n] for n in names]
        return lambda: jax.block_until_ready(f(*args))

    return {
        ("layer_norm forward", XLA): timed(_numpy_forward, "x", "w", "b"),
        ("layer_norm backward", XLA): timed(_numpy_backward, "dy", "x", "mean", "rstd", "w"),
        ("add_layer_norm forward", XLA): timed(add_forward, "x", "r", "w", "b"),
        ("add_layer_norm backward", XLA): timed(add_backward, "dy", "z", "zmean", "zrstd", "w",
                                                "r"),
        ("rms_norm forward", XLA): timed(_numpy_rms_forward, "x", "w"),
        ("rms_norm backward", XLA): timed(_numpy_rms_backward, "dy", "x", "rms_rstd", "w"),
    }
