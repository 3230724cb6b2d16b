"""The ops' one dispatch (sparda_jax/ops/_dispatch.py): each op registers exactly the backend
names of `config.IMPLEMENTATION_NAMES`, None walks the default order past backends that raise
NotImplementedError, a named backend runs alone."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import has_gpu

from sparda_jax.config import IMPLEMENTATION_NAMES
from sparda_jax.ops._dispatch import Registry
from sparda_jax.ops.block_select import api as select_api
from sparda_jax.ops.copy_plan import api as plan_api
from sparda_jax.ops.dense_attention import api as dense_api
from sparda_jax.ops.sparse_attention import api as sparse_api


@pytest.mark.parametrize("registry,op", [
    (dense_api.BACKENDS, "dense_attention"), (sparse_api.BACKENDS, "sparse_attention"),
    (sparse_api.PAGED_BACKENDS, "sparse_attention"), (select_api.INFLLMV2_BACKENDS, "select"),
    (select_api.FORECAST_BACKENDS, "select"), (plan_api.BACKENDS, "copy_plan")])
def test_each_op_registers_the_contract_names(registry, op):
    assert set(registry.backends) == set(IMPLEMENTATION_NAMES[op])


def test_default_order_falls_back_and_a_name_runs_alone():
    reg = Registry("select")
    calls = []

    def refuse(x):
        calls.append("mosaic_gpu")
        raise NotImplementedError("not here")

    reg.register("mosaic_gpu")(refuse)
    reg.register("xla")(lambda x: calls.append("xla") or x + 1)
    assert reg(None, ("mosaic_gpu", "xla"), 1) == 2 and calls == ["mosaic_gpu", "xla"]
    with pytest.raises(NotImplementedError, match="not here"):
        reg("mosaic_gpu", ("xla",), 1)  # named: no fallback
    with pytest.raises(NotImplementedError, match="no select backend supports these inputs: mosaic_gpu: not here"):
        reg(None, ("mosaic_gpu",), 1)
    with pytest.raises(ValueError, match="unknown select implementation 'rows'"):
        reg("rows", ("xla",), 1)
    with pytest.raises(ValueError, match="not one of"):
        reg.register("xla_count")


@pytest.mark.skipif(has_gpu(), reason="on a GPU the default is cudnn")
def test_dense_default_falls_back_to_xla_off_the_gpu():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 8, 4, 16)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, 8, 2, 16)), jnp.bfloat16)
    np.testing.assert_array_equal(dense_api.dense_attention(q, k, k), dense_api.dense_attention(q, k, k, implementation="xla"))
    with pytest.raises(NotImplementedError, match="GPU"):
        dense_api.dense_attention(q, k, k, implementation="cudnn")
