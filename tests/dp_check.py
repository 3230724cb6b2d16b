"""The data-parallel training step against one device: the same batch on a mesh of n devices
and on a mesh of one, through `train_step` (losses, gradients, updated parameters) and through
the gradients `finetune_step` averages (losses, gradients). Shared by the CPU test (8 fake devices, in a subprocess) and the
GPU test (the GPUs of one host)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from sparda_jax import SparseConfig, get_preset, init_forecast, init_model
from sparda_jax.io.adapter_file import LoraConfig, adapter_shapes
from sparda_jax.train.finetune import FinetuneConfig, finetune_loss
from sparda_jax.train.objective import TrainConfig, forecast_loss, init_state, mean_grads, train_step
from sparda_jax.train.run import make_mesh, shard_batch


def sharpened_tiny():
    """The tiny preset with q/k scaled up: random init gives near-uniform teacher and student
    (KL ~1e-4), and a check on a loss with nothing behind it could not fail."""
    c = get_preset("tiny")
    params = init_model(c, jax.random.key(0))
    layers = dict(params["layers"])
    for n in ("q_proj", "k_proj"):
        layers[n] = {"kernel": layers[n]["kernel"] * 8}
    return c, dict(params, layers=layers)


def kernel_sized():
    """A config the Mosaic GPU kernels take (64-token blocks, head dim 64, bf16), two layers:
    on a Hopper GPU its sparse attention runs the compiled prefill kernel and its backward."""
    c = get_preset("tiny").replace(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, num_layers=2,
                                   sparse=SparseConfig(block_size=64, init_blocks=1, local_blocks=2, topk=4,
                                                       kernel_size=32, kernel_stride=16, dense_len=0))
    return c, init_model(c, jax.random.key(0))


def _placed(mesh, tree):
    return jax.device_put(tree, NamedSharding(mesh, P()))


def check_train_step(n: int, *, rtol_loss=1e-4, rtol_param=1e-5, atol_param=1e-7) -> float:
    """Forecast training, float32: n devices against one. Returns the loss."""
    c, params = sharpened_tiny()
    f = jax.tree.map(lambda a: a * 30, init_forecast(c, jax.random.key(1)))
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (2, n, 160), 0, c.vocab_size), np.int32)
    tc = TrainConfig(seq_len=160, batch=2 * n, micro_batch=n, dtype="float32")
    out = {}
    for m in (1, n):
        mesh = make_mesh(m)
        batch = shard_batch(mesh, tokens, tokens.shape)
        assert len(batch.sharding.device_set) == m
        grad_fn = jax.value_and_grad(functools.partial(forecast_loss, config=c, dtype="float32"), has_aux=True)
        g = jax.jit(functools.partial(mean_grads, grad_fn, mesh=mesh))(
            _placed(mesh, f), _placed(mesh, params), batch, jnp.zeros((c.num_layers,), jnp.float32))
        s, metrics = train_step(_placed(mesh, init_state(f, tc)), _placed(mesh, params), batch, config=c, tc=tc,
                                mesh=mesh)
        out[m] = (g, s, metrics)
    (l1, _, g1), s1, m1 = out[1]
    (ln, _, gn), sn, mn = out[n]
    # the same float32 math in another reduction order (rows averaged per device, then across
    # devices): KL terms of both signs cancel, so allow 1e-4 relative, ~1000 ulps
    np.testing.assert_allclose(ln, l1, rtol=rtol_loss)
    np.testing.assert_allclose(mn["loss"], m1["loss"], rtol=rtol_loss)
    gmax = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g1))
    for a, b in zip(jax.tree.leaves(gn), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=rtol_loss, atol=1e-5 * gmax)
    for a, b in zip(jax.tree.leaves(sn.forecast), jax.tree.leaves(s1.forecast)):
        np.testing.assert_allclose(a, b, rtol=rtol_param, atol=atol_param)
    assert float(l1) > 1e-3, float(l1)  # a loss with real supervision behind it
    return float(l1)


def check_finetune_grads(n: int, *, config=None, params=None, dtype: str = "float32", rtol: float = 1e-4,
                         atol_rel: float = 1e-5, compiled_text: list | None = None) -> float:
    """Sparse-attention fine-tuning (LoRA): the loss and gradients that `finetune_step` averages
    (`mean_grads` of `finetune_loss`), n devices against one, on `config` (default: the tiny
    preset), within rtol and atol_rel x the largest gradient. compiled_text: gets the n-device
    program's compiled HLO (to see which kernels ran). Returns the loss."""
    if config is None:
        config, params = sharpened_tiny()
    lora = LoraConfig(rank=4, alpha=8.0)
    seq = 2 * config.sparse.block_size * config.sparse.topk  # twice the budget: sparse is not dense
    fc = FinetuneConfig(lora=lora, seq_len=seq, batch=2 * n, micro_batch=n, dtype=dtype)
    rng = np.random.default_rng(5)
    adapter = {t: {"a": jnp.asarray(rng.standard_normal(s["a"]) / np.sqrt(s["a"][1]), jnp.float32),
                   "b": jnp.asarray(0.05 * rng.standard_normal(s["b"]), jnp.float32)}
               for t, s in adapter_shapes(config, lora).items()}
    tokens = np.asarray(rng.integers(0, config.vocab_size, (2, n, seq)), np.int32)
    backbone = jax.tree.map(lambda a: a.astype(jnp.dtype(dtype)), params)
    grad_fn = jax.value_and_grad(functools.partial(finetune_loss, config=config, fc=fc), has_aux=True)
    out = {}
    for m in (1, n):
        mesh = make_mesh(m)
        mg = jax.jit(functools.partial(mean_grads, grad_fn, mesh=mesh))
        args = (_placed(mesh, adapter), _placed(mesh, backbone), shard_batch(mesh, tokens, tokens.shape),
                {"nll_sparse": jnp.float32(0)})
        if m == n and compiled_text is not None:
            compiled_text.append(mg.lower(*args).compile().as_text())
        out[m] = mg(*args)
    (l1, _, g1), (ln, _, gn) = out[1], out[n]
    np.testing.assert_allclose(ln, l1, rtol=rtol)
    gmax = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g1))
    for a, b in zip(jax.tree.leaves(gn), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol_rel * gmax)
    assert float(l1) > 1.0, float(l1)  # a next-token NLL of random tokens: far from zero
    return float(l1)
