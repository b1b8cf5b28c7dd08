"""The cache's row writer: per-row offsets, untouched neighbours, a tail past capacity dropped."""
import jax.numpy as jnp
import numpy as np

from dflash_jax.cache import write_rows


def test_write_rows_puts_each_rows_block_at_its_own_offset_and_drops_what_overhangs():
    buf = np.full((3, 10, 2, 4), -1.0, np.float32)
    new = np.arange(3 * 4 * 2 * 4, dtype=np.float32).reshape(3, 4, 2, 4)
    out = np.asarray(write_rows(jnp.asarray(buf, jnp.bfloat16), jnp.asarray(new), jnp.array([0, 3, 8])))
    expected = buf.copy()
    expected[0, 0:4] = new[0]
    expected[1, 3:7] = new[1]
    expected[2, 8:10] = new[2, :2]  # rows 10 and 11 are past the capacity: dropped, not shifted back
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out.astype(np.float32), expected.astype(jnp.bfloat16).astype(np.float32))
