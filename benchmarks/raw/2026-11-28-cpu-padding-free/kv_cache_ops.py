"""aten calls of one training forward + backward of a SmolLM2-135M-shaped model (random weights, fp32,
CPU), with the KV-cache object transformers builds by default in training and without it."""
import json
import torch
from torch.profiler import profile
from fedsweep.config import validate
from fedsweep.models import loading
from fedsweep.engine.base import prepare_base

cfg = validate({"name": "c", "model": {"name": "random:smollm2-135m-instruct"}})
m = prepare_base(loading.load_base_model(cfg.model, 0), cfg)
m.train()
for p in m.parameters():
    p.requires_grad_(False)
m.model.embed_tokens.weight.requires_grad_(True)  # something to differentiate
ids = torch.randint(0, 1000, (4, 100))
mask = torch.ones_like(ids)
out = {"use_cache_default": m.config.use_cache, "layers": m.config.num_hidden_layers}
for label, kw in (("default", {}), ("use_cache_false", {"use_cache": False})):
    m(input_ids=ids, attention_mask=mask, **kw).logits.sum().backward()  # warm-up
    with profile() as prof:
        res = m(input_ids=ids, attention_mask=mask, **kw)
        res.logits.sum().backward()
    ev = prof.key_averages()
    out[label] = {"aten_calls": sum(e.count for e in ev if e.key.startswith("aten::")),
                  "cat_calls": sum(e.count for e in ev if e.key == "aten::cat"),
                  "cache": type(res.past_key_values).__name__}
print(json.dumps(out, indent=1))
