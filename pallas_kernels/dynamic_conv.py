import jax.numpy as jnp
IMPLS = ("xla", "pallas")
DEFAULT_IMPL = "xla"
def dynamic_conv(x, dyn, base, which, *, impl="xla", interpret=None):
    n, t, h = x.shape
    k = base.shape[1]
    g = dyn.shape[-1] // (2 * k)
    d = dyn.reshape(n, t, 2, k, g)[:, :, which].astype(jnp.float32)
    d = jnp.repeat(d, h // g, axis=-1)
    xf = x.astype(jnp.float32)
    out = jnp.zeros((n, t, h), jnp.float32)
    for o in range(k):
        shifted = jnp.pad(xf, ((0, 0), (o, 0), (0, 0)))[:, :t]
        out = out + (base[which, o].astype(jnp.float32) + d[:, :, o]) * shifted
    return out.astype(x.dtype)
