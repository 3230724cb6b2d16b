"""CPU pilot of --select-weight: SmolLM2 + the shipped adapter, a 2K window with a budget that
selects (1 init + 2 local + own block forced, topk 8 of 32 blocks), 12 steps of 2 windows, with
and without the selection term; then held-out copy NLL and source share under Sparse."""
import dataclasses, json, sys, time
import jax
from sparda_jax import api
from sparda_jax.io.adapter_file import adapter_path, LoraConfig
from sparda_jax.train.finetune import FinetuneConfig, finetune
from sparda_jax.train.augment import RetrievalMix
arm = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 12  # 36: resumes a 12-step run from its checkpoints
m = api.load_pretrained("smollm2-135m")
cfg = m.config.replace(sparse=dataclasses.replace(m.config.sparse, local_blocks=2, topk=8))
model = api.Pretrained(cfg, m.params, m.tokenizer, m.dtype)
fc = FinetuneConfig(lora=LoraConfig(rank=32, alpha=64.0), objective="distill", copy_weight=1.0,
                    select_weight=2.0 if arm == "select" else 0.0, seq_len=2048, batch=2, micro_batch=1,
                    steps=steps, lr=5e-4, dtype="bfloat16", seed=5)
t = time.time()
r = finetune(model, fc, f"/tmp/pilot/{arm}", data_paths=["/tmp/s21/data"], save_every=4, eval_every=0,
             mix=RetrievalMix(repeat_share=0.5, scatter_share=0.0), init_from=adapter_path("smollm2-135m-sparse"),
             progress=False, log=print)
print(arm, json.dumps(r["final"]), round(time.time() - t), "s", flush=True)
