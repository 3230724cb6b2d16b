"""Copy NLL at the sparse mode's budget with the attention-mass oracle selection, beside dense and
sparse, on held-out splits: the adapted SmolLM2 (the shipped adapter), float32, CPU."""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from sparda_jax import api
from sparda_jax.eval.copy import copy_sequence, eval_copy, source_share
from sparda_jax.eval.heldout import corpus_texts
from sparda_jax.eval.bound import oracle_forward
oracle_only = "--oracle-only" in sys.argv  # skip the dense and sparse rows (taken from another run)
args = [a for a in sys.argv[1:] if a != "--oracle-only"]
length, samples, splits = int(args[0]), int(args[1]), args[2:]
m = api.load_pretrained("smollm2-135m-sparse")
# the recorded runs predate the preset's dense layer 18: every layer selects, as they did
import dataclasses
m.config = m.config.replace(sparse=dataclasses.replace(m.config.sparse, dense_layers=()))
c, sp = m.config, m.config.sparse
texts = corpus_texts("/tmp/s21/data", splits, vocab_size=c.vocab_size)
t0 = time.time()
base = {"rows": []}
if not oracle_only:
    base = eval_copy(m, lengths=(length,), samples=samples, modes=("dense", "sparse"), texts=texts, progress=False)
    print("dense/sparse", round(time.time() - t0), "s", flush=True)
rows = []
for text in texts:
    nll, src = [], []
    for i in range(samples):
        s = copy_sequence(text.docs, length, i, block_size=sp.block_size, init_blocks=sp.init_blocks,
                          local_blocks=sp.local_blocks)
        at = jnp.arange(s.repeat - 1, length - 1, dtype=jnp.int32)[None]
        logits, ids = oracle_forward(m.params, jnp.asarray(s.tokens[None]), c, dtype=m.dtype, logits_at=at)
        lp = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)
        target = jnp.asarray(s.tokens[s.repeat:])
        nll.append(-float(jnp.mean(jnp.take_along_axis(lp, target[:, None], axis=-1))))
        h, r = source_share(np.asarray(ids), s, block_size=sp.block_size, shift=1)
        src.append((np.asarray(h).sum(), np.asarray(r).sum()))
    rows.append({"split": text.split, "length": length, "mode": "attention oracle", "copy_nll": float(np.mean(nll)),
                 "copy_nll_per_sample": nll, "source_share": float(sum(a for a, _ in src) / sum(b for _, b in src))})
    print(rows[-1]["split"], rows[-1]["copy_nll"], rows[-1]["source_share"], round(time.time() - t0), "s", flush=True)
for r in base["rows"]:
    print(r["split"], r["mode"], round(r["copy_nll"], 4), r.get("source_share"), flush=True)
json.dump({"base": base, "oracle": rows, "length": length, "samples": samples}, open(f"/tmp/bound/bound_{length}.json", "w"))
