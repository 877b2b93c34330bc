"""`python -m lnfast bench --peers`: onnxruntime's and XLA's LayerNorm and
RMSNorm beside lnfast's, where they are installed.

onnxruntime runs the ONNX operators LayerNormalization (opset 17) and
RMSNormalization (opset 23) and its own fused SkipLayerNormalization
(com.microsoft) for the add, forward only (an inference runtime has no
backward), `intra_op_num_threads` set to lnfast's threads.  XLA runs the
functions written in jax.numpy under `jax.jit`, computing in float32 for
the 16-bit types as NumPy's baseline does; its backward is the `jax.vjp`
of the forward, the residuals saved by the forward (timed alone).  A type
a runtime does not implement is left out.
"""
import numpy as np

from lnfast._bench import EPS

ORT = "onnxruntime"
XLA = "xla"


def cases(x, r, w, b, dy, threads):
    """{(function, implementation): zero-argument callable} for both peers."""
    out = {}
    for make in (_ort_cases, _xla_cases):
        try:
            out.update(make(x, r, w, b, dy, threads))
        except ImportError:
            pass
    return out


# --- onnxruntime ---------------------------------------------------------------

def _ort_cases(x, r, w, b, dy, threads):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    elem = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float64): TensorProto.DOUBLE}
    if x.dtype not in elem:         # (its CPU kernels: float32 and float64)
        return {}
    t = elem[x.dtype]
    M, D = x.shape

    def session(op, inputs, outputs, opset, domain=""):
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
        ("layer_norm forward", ORT): session("LayerNormalization", ["x", "w", "b"], ["y"], 17),
        ("add_layer_norm forward", ORT): session(
            "SkipLayerNormalization", ["x", "r", "w", "b"], ["y", "", "", "z"], 17,
            "com.microsoft"),
        ("rms_norm forward", ORT): session("RMSNormalization", ["x", "w"], ["y"], 23),
    }
    return {k: fn for k, fn in made.items() if fn is not None}


# --- XLA (jax.jit) ----------------------------------------------------------------

def _xla_cases(x, r, w, b, dy, threads):
    import jax

    if x.dtype == np.float64:
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    wide = jnp.float64 if x.dtype == np.float64 else jnp.float32

    def ln(x, w, b):
        xf = x.astype(wide)
        mu = xf.mean(-1, keepdims=True)
        var = jnp.square(xf - mu).mean(-1, keepdims=True)
        return ((xf - mu) * jax.lax.rsqrt(var + EPS) * w + b).astype(x.dtype)

    def rms(x, w):
        xf = x.astype(wide)
        return (xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + EPS)
                * w).astype(x.dtype)

    def add_ln(x, r, w, b):
        z = x + r
        return ln(z, w, b), z

    jx, jr, jdy = (jnp.asarray(a) for a in (x, r, dy))
    jw, jb = (jnp.asarray(a, wide) for a in (w, b))
    pull = jax.jit(lambda vjp, ct: vjp(ct))

    def timed(f, *args):
        f = jax.jit(f)
        return lambda: jax.block_until_ready(f(*args))

    def backward(f, args, ct):
        _, vjp = jax.vjp(f, *args)
        jax.block_until_ready(vjp)  # (dispatched asynchronously: done before any timing)
        return lambda: jax.block_until_ready(pull(vjp, ct))

    jax.block_until_ready((jx, jr, jdy, jw, jb))
    return {
        ("layer_norm forward", XLA): timed(ln, jx, jw, jb),
        ("layer_norm backward", XLA): backward(ln, (jx, jw, jb), jdy),
        ("add_layer_norm forward", XLA): timed(add_ln, jx, jr, jw, jb),
        ("add_layer_norm backward", XLA): backward(add_ln, (jx, jr, jw, jb), (jdy, jr)),
        ("rms_norm forward", XLA): timed(rms, jx, jw),
        ("rms_norm backward", XLA): backward(rms, (jx, jw), jdy),
    }
