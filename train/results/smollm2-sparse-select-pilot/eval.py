import dataclasses, json, sys, time
import numpy as np
from sparda_jax import api
from sparda_jax.io.adapter_file import adapter_path, load_adapter, merge_adapter
from sparda_jax.eval.copy import eval_copy
from sparda_jax.eval.heldout import corpus_texts
m = api.load_pretrained("smollm2-135m")
cfg = m.config.replace(sparse=dataclasses.replace(m.config.sparse, local_blocks=2, topk=8))
texts = corpus_texts("/tmp/s21/data", ["eval-man", "eval-licenses"], vocab_size=cfg.vocab_size)
# python eval.py [OUT NAME=ADAPTER ...]: the 12-step evaluation without arguments; the 36-step one was
# python eval.py /tmp/pilot/eval36.json select36=/tmp/pilot/select/adapter.safetensors control36=/tmp/pilot/control/adapter.safetensors
OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/pilot/eval.json"
ADAPTERS = [tuple(a.split("=", 1)) for a in sys.argv[2:]] or [
    ("shipped", adapter_path("smollm2-135m-sparse")), ("select", "/tmp/pilot/select/adapter.safetensors"),
    ("control", "/tmp/pilot/control/adapter.safetensors")]
out = {}
for name, path in ADAPTERS:
    ad, lora = load_adapter(path, cfg)
    model = api.Pretrained(cfg, merge_adapter(m.params, ad, lora), m.tokenizer, m.dtype)
    t = time.time()
    r = eval_copy(model, lengths=(2048,), samples=8, modes=("dense", "sparse"), texts=texts, progress=False)
    out[name] = r["rows"]
    for row in r["rows"]:
        print(name, row["split"], row["mode"], round(row["copy_nll"], 4), row.get("source_share"), round(time.time() - t), flush=True)
json.dump(out, open(OUT, "w"))
# the selection term itself on held-out windows (the same 2 windows for every adapter)
import jax, jax.numpy as jnp
from sparda_jax.train.finetune import FinetuneConfig, finetune_loss
from sparda_jax.io.adapter_file import LoraConfig
toks = []
for t in texts:
    doc = np.concatenate(t.docs)[:4096]
    toks.append(doc[:2048])
tok = jnp.asarray(np.stack(toks), jnp.int32)
fc = FinetuneConfig(lora=LoraConfig(rank=32, alpha=64.0), objective="distill", select_weight=1.0, seq_len=2048,
                    batch=2, micro_batch=2, dtype="float32")
bb = m.params
for name, path in ADAPTERS:
    ad, lora = load_adapter(path, cfg)
    _, parts = jax.jit(lambda a: finetune_loss(a, bb, tok, config=cfg, fc=fc))(ad)
    out.setdefault("heldout_parts", {})[name] = {k: float(v) for k, v in parts.items()}
    print(name, "held-out", {k: round(float(v), 4) for k, v in parts.items()}, flush=True)
json.dump(out, open(OUT, "w"))
