"""The decode step's copy plan (`sparda_jax.ops.copy_plan`): slot assignment against a plain
loop, the task lists, the Triton kernel against the jnp reference (interpreted on the CPU,
compiled on a GPU), plus paged attention."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import has_gpu
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import selection_ref as ref
from kernel_base import gpu, padded_block_accesses
from sparda_jax.attention import paged_sparse_attention_reference, sparse_attention_reference
from sparda_jax.ops.copy_plan import assign_slots, empty_table, plan_copies, plan_copies_reference
from sparda_jax.ops.copy_plan.triton import plan_copies_triton


def _loop(table, wanted):
    table = list(table)
    slots, copy = [], []
    keep = {b for b in table if b >= 0 and b in wanted}
    free = [s for s, b in enumerate(table) if not (b >= 0 and b in keep)]
    free = [s for s in free if table[s] < 0] + [s for s in free if table[s] >= 0]  # empty slots first
    for w in wanted:
        if w < 0:
            slots.append(-1)
            copy.append(False)
        elif w in table:
            slots.append(table.index(w))
            copy.append(False)
        else:
            s = free.pop(0)
            table[s] = w
            slots.append(s)
            copy.append(True)
    return table, slots, copy


def test_assign_slots_matches_loop_over_many_steps():
    rng = np.random.default_rng(0)
    rows, n_slots, n, nb = 6, 10, 6, 16
    table = np.asarray(empty_table((rows,), n_slots))
    copies = wanted_total = 0
    for step in range(25):
        wanted = np.full((rows, n), -1, np.int32)
        for r in range(rows):
            k = rng.integers(1, n + 1)
            wanted[r, :k] = np.sort(rng.choice(nb, k, replace=False))
        a = assign_slots(jnp.asarray(table), jnp.asarray(wanted))
        for r in range(rows):
            t, s, c = _loop(table[r], list(wanted[r]))
            np.testing.assert_array_equal(a.table[r], t)
            np.testing.assert_array_equal(a.slots[r], s)
            np.testing.assert_array_equal(a.copy[r], c)
            # every wanted block sits in its slot afterwards, no slot is used twice
            got = np.asarray(a.slots[r])[wanted[r] >= 0]
            assert len(set(got)) == len(got)
            np.testing.assert_array_equal(np.asarray(a.table[r])[got], wanted[r][wanted[r] >= 0])
        copies += int(a.n_copies)
        wanted_total += int((wanted >= 0).sum())
        table = np.asarray(a.table)
    nofree = assign_slots(jnp.asarray(table), jnp.asarray(wanted), reuse=False)
    assert int(nofree.n_copies) == int((wanted >= 0).sum())  # reuse off copies everything
    assert copies < wanted_total  # reuse saved copies over the run


def test_assign_slots_rejects_small_cache():
    with pytest.raises(ValueError, match="at least as many slots"):
        assign_slots(empty_table((1,), 3), jnp.zeros((1, 4), jnp.int32))


def _random_steps(rng, rows: tuple[int, int], n_slots: int, n: int, nb: int, steps: int):
    """(table, wanted) of `steps` consecutive decode steps on one cache: each step's table is the
    reference's after the step before, wanted ascending unique ids of 1..n blocks, -1 padded."""
    table = np.asarray(empty_table(rows, n_slots))
    for _ in range(steps):
        wanted = np.full((*rows, n), -1, np.int32)
        for r in np.ndindex(rows):
            k = rng.integers(1, n + 1)
            wanted[r][:k] = np.sort(rng.choice(nb, k, replace=False))
        yield jnp.asarray(table), jnp.asarray(wanted)
        table = np.asarray(assign_slots(jnp.asarray(table), jnp.asarray(wanted)).table)


def test_plan_tasks_copy_the_missing_blocks_into_their_slots():
    """The task lists name each missing block's place in the host pool and its slot's place in
    the cache, -1 for the rest; one copy per missing block."""
    rng = np.random.default_rng(3)
    b, kh, s, n, nb, off = 2, 3, 9, 6, 20, 1000
    for table, wanted in _random_steps(rng, (b, kh), s, n, nb, 6):
        a = assign_slots(table, wanted)
        p = plan_copies_reference(table, wanted, off, n_blocks=nb)
        np.testing.assert_array_equal(p.table, a.table)
        np.testing.assert_array_equal(p.slots, a.slots)
        for i, j, t in np.ndindex(b, kh, n):
            if a.copy[i, j, t]:
                assert p.src[i, j, t] == off + (i * kh + j) * nb + wanted[i, j, t]
                assert p.dst[i, j, t] == (i * kh + j) * s + a.slots[i, j, t]
            else:
                assert p.src[i, j, t] == -1 and p.dst[i, j, t] == -1
        assert int(p.n_copies) == int(a.n_copies)


def _check_equals_reference(implementation: str, rows, n_slots: int, n: int, nb: int) -> None:
    """The backend's plan is bit-equal to the reference's over 8 consecutive random steps."""
    rng = np.random.default_rng(sum(rows) + n_slots + nb)
    for table, wanted in _random_steps(rng, rows, n_slots, n, nb, 8):
        off = int(rng.integers(0, 10_000))
        want = plan_copies(table, wanted, off, n_blocks=nb, implementation="xla")
        got = plan_copies(table, wanted, off, n_blocks=nb, implementation=implementation)
        chex.assert_trees_all_equal(got, want)


@pytest.mark.parametrize("rows,n_slots,n,nb", [((2, 3), 24, 24, 65), ((1, 2), 10, 6, 16), ((3, 1), 7, 5, 9)])
def test_triton_plan_equals_reference_interpreted(rows, n_slots, n, nb):
    """Bit-equal to the jnp reference over consecutive steps, at SmolLM2's 4K geometry (24 slots,
    24 wanted of 65 blocks) and at sizes that are not powers of two (the kernel pads)."""
    _check_equals_reference("triton_interpret", rows, n_slots, n, nb)


def test_triton_plan_masks_its_padded_rows():
    """Every access to a row padded to a power of two goes through a mask: compiled, a plain store
    of the padding overwrote the next row's first entries (H100, 16e5709), which the interpreter
    cannot show. The check itself flags a kernel that stores a padded block plainly."""
    t, w = empty_table((1, 3), 24), jnp.zeros((1, 3, 24), jnp.int32)
    padded, unmasked = padded_block_accesses(lambda t, w: plan_copies_triton(t, w, 0, n_blocks=65, interpret=True), t, w)
    assert len(padded) == 6 and unmasked == []  # table, wanted and the four outputs: 24 in blocks of 32

    def plain(x_ref, o_ref, p_ref):
        o_ref[...] = x_ref[...] + 1
        pltriton.store(p_ref, pltriton.load(x_ref, mask=jnp.arange(32) < 24))  # the store unmasked

        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = jnp.zeros(32, jnp.int32)

    spec = pl.BlockSpec((None, 32), lambda i: (i, 0))
    bad = pl.pallas_call(plain, out_shape=[jax.ShapeDtypeStruct((3, 24), jnp.int32)] * 2, grid=(3,),
                         in_specs=[spec], out_specs=[spec, spec], interpret=True)
    padded, unmasked = padded_block_accesses(bad, jnp.zeros((3, 24), jnp.int32))
    assert len(padded) == 3
    assert sorted(a.split("(")[-1] for a in unmasked) == ["get)", "masked_swap without a mask)", "swap)", "swap)"]


def test_plan_rejects_bad_inputs():
    t, w = empty_table((1, 2), 4), jnp.zeros((1, 2, 3), jnp.int32)
    with pytest.raises(ValueError, match="at least as many slots"):
        plan_copies(t, jnp.zeros((1, 2, 5), jnp.int32), n_blocks=8)
    with pytest.raises(TypeError, match="int32"):
        plan_copies(t.astype(jnp.int16), w, n_blocks=8)
    with pytest.raises(ValueError, match="share B, K"):
        plan_copies(t, jnp.zeros((2, 2, 3), jnp.int32), n_blocks=8)
    with pytest.raises(ValueError, match="n_blocks"):
        plan_copies(t, w, n_blocks=0)
    with pytest.raises(TypeError, match="integer scalar"):
        plan_copies(t, w, jnp.zeros(2, jnp.int32), n_blocks=8)


@pytest.mark.skipif(has_gpu(), reason="on a GPU the kernel runs compiled")
def test_triton_plan_needs_a_gpu():
    with pytest.raises(NotImplementedError, match="GPU"):
        plan_copies(empty_table((1, 1), 4), jnp.zeros((1, 1, 2), jnp.int32), n_blocks=8, implementation="triton")


@gpu
@pytest.mark.parametrize("rows,n_slots,n,nb", [((1, 3), 24, 24, 65), ((8, 3), 24, 24, 129), ((4, 2), 96, 96, 2048),
                                               ((3, 1), 7, 5, 9)])
def test_triton_plan_equals_reference_compiled(rows, n_slots, n, nb):
    """Compiled: bit-equal to the reference, at SmolLM2's 4K and 8K geometries, MiniCPM's budget
    (96 slots of 2048 blocks) and a size that is not a power of two (masked edge blocks)."""
    _check_equals_reference("triton", rows, n_slots, n, nb)


def test_paged_attention_equals_contiguous():
    """Scatter the selected blocks of a contiguous cache into random slots of a pool; attention
    through the slot table equals attention on the contiguous cache (and the NumPy reference)."""
    ks = jax.random.split(jax.random.key(1), 6)
    b, s, kh, g, d, tq, n, bs, n_slots = 2, 70, 2, 3, 8, 3, 4, 8, 7
    q = jax.random.normal(ks[0], (b, tq, kh * g, d))
    k = jax.random.normal(ks[1], (b, s, kh, d))
    v = jax.random.normal(ks[2], (b, s, kh, d))
    bias = jax.random.normal(ks[3], (b, s, kh))
    pos = jnp.array([[40, 55, 69], [10, 33, 68]], jnp.int32)
    nb = -(-s // bs)
    ids = np.full((b, kh, tq, n), -1, np.int32)
    rng = np.random.default_rng(2)
    for bi in range(b):
        for m in range(kh):
            for i in range(tq):
                cand = int(pos[bi, i]) // bs + 1
                c = min(int(rng.integers(1, n + 1)), cand)
                ids[bi, m, i, :c] = rng.choice(cand, c, replace=False)
    ids = jnp.asarray(ids)
    # the pool: every block of the contiguous cache in a random slot order per (b, kv head)
    pad = nb * bs - s
    kb = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, nb, bs, kh, d).transpose(0, 3, 1, 2, 4)
    vb = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, nb, bs, kh, d).transpose(0, 3, 1, 2, 4)
    cb = jnp.pad(bias, ((0, 0), (0, pad), (0, 0))).reshape(b, nb, bs, kh).transpose(0, 3, 1, 2)
    perm = jnp.asarray(rng.permutation(nb))  # block j -> slot perm[j]
    inv = jnp.argsort(perm)
    k_pool, v_pool, c_pool = kb[:, :, inv], vb[:, :, inv], cb[:, :, inv]
    slots = jnp.where(ids >= 0, perm[jnp.clip(ids, 0)], -1)
    paged = paged_sparse_attention_reference(q, k_pool, v_pool, slots, ids, pos, block_size=bs, bias_pool=c_pool)
    contiguous = sparse_attention_reference(q, k, v, ids, pos, block_size=bs, bias=bias)
    np.testing.assert_allclose(paged, contiguous, atol=1e-6)
    np.testing.assert_allclose(paged, ref.sparse_attention_ref(*(np.asarray(a) for a in (q, k, v, ids, pos, bias)),
                                                               block_size=bs), atol=2e-6)
    assert n_slots  # the pool here holds all nb blocks; the engine holds fewer
