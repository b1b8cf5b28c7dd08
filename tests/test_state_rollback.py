"""The Target interface carries state rollback: a third target family, defined only here, whose state
is a running sum rather than a KV cache, decodes speculatively with no change to `decoding/`.

`RunningSumTarget`'s state after a token is the sum of every token id committed so far (integers,
so exact); each position's features read that sum. `extend` returns the sum after every position
of the block as `pending`, and `commit` keeps the one at the last kept position: the only
rollback, as docs/architecture.md describes for recurrent targets. Speculative decoding with
injected proposals, which reach every acceptance length 0..nd, must equal the family's own plain
decoding; a commit that keeps the whole block must not.
"""
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn
from flax import struct

import dflash_jax
from dflash_jax.config import DrafterConfig, RopeConfig
from dflash_jax.io.checkpoints import make_drafter
from dflash_jax.targets.base import Target
from conftest import drafter_param_shapes, inject_reference, random_params

MODULUS = 97  # the running sum is read through an embedding of (sum mod MODULUS)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3], list(range(12, 40))]
MAX_NEW = 24


@dataclasses.dataclass(frozen=True)
class RunningSumConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_layers: int = 3
    max_position_embeddings: int = 1024


@struct.dataclass
class RunningSumState:
    """total: int32[B] sum of the committed token ids; seq_len: int32[B] committed positions."""

    total: jax.Array
    seq_len: jax.Array


class RunningSumLM(nn.Module):
    cfg: RunningSumConfig

    def setup(self):
        c, init = self.cfg, nn.initializers.normal(0.5)
        self.embedding = self.param("embed", init, (c.vocab_size, c.hidden_size))
        self.sum_embedding = self.param("sum_embed", init, (MODULUS, c.hidden_size))
        self.mix = [self.param(f"mix_{i}", init, (c.hidden_size, c.hidden_size)) for i in range(c.num_layers)]
        self.head = self.param("head", init, (c.hidden_size, c.vocab_size))

    def embed(self, tokens):
        return self.embedding[tokens]

    def logits(self, h, head=None):
        return jnp.matmul(h, self.head if head is None else head, preferred_element_type=jnp.float32)

    def extend(self, total, tokens, tap_ids):
        """`(h, taps, sums)`: `sums[b, i]` is the running sum after position i of the block."""
        sums = total[:, None] + jnp.cumsum(tokens, axis=1, dtype=jnp.int32)
        x, outputs = self.embed(tokens) + self.sum_embedding[sums % MODULUS], []
        for w in self.mix:
            x = x + jnp.tanh(x @ w)
            outputs.append(x)
        taps = jnp.concatenate([outputs[i] for i in tap_ids], axis=-1) if tap_ids else None
        return x, taps, sums

    def __call__(self, tokens):
        return self.logits(self.extend(jnp.zeros(tokens.shape[:1], jnp.int32), tokens, ())[0])


class RunningSumTarget(Target):
    """The third family: its state is a running sum, rolled back by `commit` alone."""

    def _apply(self, method, *args):
        return RunningSumLM(self.config).apply({"params": self.params}, *args, method=method)

    def init_state(self, batch, capacity):
        return RunningSumState(jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32))

    def embed(self, tokens):
        return self._apply(RunningSumLM.embed, tokens)

    def extend(self, state, tokens, start, tap_ids=(), impl="xla", valid=None):
        h, taps, sums = self._apply(RunningSumLM.extend, state.total, tokens, tap_ids)
        return h, taps, state, (sums, start)

    def logits(self, hidden, head=None):
        return self._apply(RunningSumLM.logits, hidden, head)

    def commit(self, state, pending, kept):
        sums, start = pending
        last = jnp.take_along_axis(sums, jnp.maximum(kept - 1, 0)[:, None], axis=1)[:, 0]
        return RunningSumState(jnp.where(kept > 0, last, state.total), (start + kept).astype(jnp.int32))

    def forward(self, tokens, tap_ids=()):
        h, taps, _ = self._apply(RunningSumLM.extend, jnp.zeros(tokens.shape[:1], jnp.int32), tokens, tap_ids)
        return h, taps


class WholeBlockCommit(RunningSumTarget):
    """A wrong rollback for the teeth test: keeps the sum of the whole verify block."""

    def commit(self, state, pending, kept):
        sums, start = pending
        return RunningSumState(jnp.where(kept > 0, sums[:, -1], state.total), (start + kept).astype(jnp.int32))


@pytest.fixture(scope="module")
def toy():
    cfg = RunningSumConfig()
    params = RunningSumLM(cfg).init(jax.random.key(3), jnp.zeros((1, 1), jnp.int32))["params"]
    return RunningSumTarget(cfg, params)


@pytest.fixture(scope="module")
def drafter(toy):
    c = toy.config
    cfg = DrafterConfig(family="dflash", hidden_size=c.hidden_size, intermediate_size=2 * c.hidden_size,
                        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                        rope=RopeConfig(10000.0), block_size=6, mask_token_id=c.vocab_size - 1,
                        target_layer_ids=(0, 2), layer_window=(None, None), causal=(False, False),
                        vocab_size=c.vocab_size)
    return make_drafter(cfg, random_params(drafter_param_shapes(cfg), 1))


@pytest.fixture(scope="module")
def plain(toy):
    return dflash_jax.generate(toy, None, PROMPTS, max_new_tokens=MAX_NEW).tokens


def test_plain_decoding_reads_the_running_sum(toy, plain):
    """The family's outputs depend on its state: a different prompt prefix changes the continuation."""
    shifted = dflash_jax.generate(toy, None, [[5, 6, 7, 8, 9, 10, 12]], max_new_tokens=MAX_NEW).tokens
    assert shifted[0] != plain[0], "the continuation must depend on the running sum of the prompt"
    assert all(len(row) == MAX_NEW for row in plain)


def test_speculative_decoding_of_a_running_sum_target_equals_its_plain_decoding(toy, drafter, plain):
    nd = drafter.n_drafts
    out = dflash_jax.Session(toy, drafter, PROMPTS, max_new_tokens=MAX_NEW,
                             inject=inject_reference(plain, MAX_NEW, nd)).run()
    hist = out.stats.accept_hist
    assert out.tokens == plain, "rolling back through commit must leave the running sum of the kept tokens"
    assert len(hist) == nd + 1 and all(h > 0 for h in hist), f"every acceptance length 0..{nd} is reached: {hist}"
    assert dflash_jax.generate(toy, drafter, PROMPTS, max_new_tokens=MAX_NEW).tokens == plain


def test_a_commit_that_keeps_the_whole_block_breaks_speculative_decoding(toy, drafter, plain):
    broken = WholeBlockCommit(toy.config, toy.params)
    assert jax.tree_util.tree_structure(broken) != jax.tree_util.tree_structure(toy), \
        "with the same config, only the class in the tree (Target.node_type) keeps the sound loop's program away"
    nd = drafter.n_drafts
    out = dflash_jax.Session(broken, drafter, PROMPTS, max_new_tokens=MAX_NEW,
                             inject=inject_reference(plain, MAX_NEW, nd)).run()
    assert dflash_jax.generate(broken, None, PROMPTS, max_new_tokens=MAX_NEW).tokens == plain, \
        "plain decoding commits one token at a time, so the wrong commit cannot show there"
    assert out.tokens != plain, "keeping rejected drafts in the state must change the output"


def test_subclasses_with_their_parents_config_keep_their_own_tree_structures(toy, drafter):
    """Target and Drafter hold their class (`node_type`), so JAX's caches never take one for the other."""
    class Twin(type(drafter)):
        pass

    twin = Twin(drafter.config, drafter.params)
    assert twin.node_type is Twin and drafter.node_type is type(drafter)
    assert jax.tree_util.tree_structure(twin) != jax.tree_util.tree_structure(drafter)
    rebuilt = jax.tree_util.tree_map(lambda a: a, WholeBlockCommit(toy.config, toy.params))
    assert type(rebuilt) is rebuilt.node_type is WholeBlockCommit
