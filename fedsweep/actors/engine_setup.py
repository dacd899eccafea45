"""What the engine is given, made from the run's config where an actor computes: the
:class:`~fedsweep.engine.settings.EngineSettings` (:func:`settings_from`, once per actor) and the
frozen base with its adapters attached (:func:`build_base`). The engine itself never reads the config.
"""

from __future__ import annotations

from fedsweep.config import ExperimentConfig
from fedsweep.engine.base import FrozenBase
from fedsweep.engine.objectives import Dpo, objective
from fedsweep.engine.settings import EngineSettings
from fedsweep.lazy import torch
from fedsweep.models import loading
from fedsweep.models.adapters import make_adapters


def settings_from(cfg: ExperimentConfig) -> EngineSettings:
    """The engine's settings of ``cfg``, whose batch plan the driver resolved (``cfg.batch_plan()``
    refuses one that is not: the one resolver is the driver's)."""
    tc, plan = cfg.train, cfg.batch_plan()
    return EngineSettings(
        seed=cfg.seed, objective=objective(tc.objective, tc.dpo_beta),
        margins=Dpo(tc.dpo_beta) if cfg.data.kind == "preference" else None,
        batch_size=tc.batch_size, steps_for=tc.steps_for, clients_per_step=plan.clients, alone_reason=plan.reason,
        autocast=tc.autocast, tf32=tc.tf32 and cfg.model.dtype == "float32" and tc.autocast == "none",
        optimizer=tc.optimizer, learning_rate=tc.learning_rate, weight_decay=tc.weight_decay,
        grad_clip=tc.grad_clip, forwards=tc.forwards, max_length=tc.max_length, system_prompt=cfg.data.system_prompt,
        eval_batch_size=cfg.eval.batch_size, eval_forwards=cfg.eval.forwards, max_new_tokens=cfg.eval.max_new_tokens,
        lora_dropout=cfg.lora_dropout(), park_on_cpu=cfg.clients.park == "cpu",
        pack_tokens=tc.pack_tokens,
        labels=tuple(cfg.data.labels) if cfg.train.objective == "classify" else ())


def apply_tf32(settings: EngineSettings, device: torch.device) -> bool:
    """Turn TF32 matrix products on in this process where the settings ask for them and it computes on a
    CUDA device (a process-wide switch of torch's); whether it did."""
    if not (settings.tf32 and device.type == "cuda"):
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def prepare_base(base, cfg: ExperimentConfig):
    """The precision and memory options that act on the frozen base before adapters attach:
    peft's k-bit preparation of a quantised base, and gradient checkpointing (non-reentrant, so the
    frozen base needs no input gradients)."""
    checkpointing = cfg.train.gradient_checkpointing
    if cfg.model.quantization != "none":
        from peft import prepare_model_for_kbit_training

        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=checkpointing,
                                               gradient_checkpointing_kwargs={"use_reentrant": False})
    elif checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if checkpointing:
        base.config.use_cache = False  # generation turns it back on per call
    return base


def build_base(cfg: ExperimentConfig, settings: EngineSettings, model_name: str, ranks: list[int],
               device: torch.device, group=None) -> FrozenBase:
    """The frozen base of ``model_name`` on ``device`` with adapters of ``ranks`` attached: loaded,
    prepared (:func:`prepare_base`), sharded over ``group``'s processes where a client is sharded
    (``clients.shard``), then adapted, its decoder layers compiled where ``train.compile`` asks."""
    apply_tf32(settings, device)
    model_cfg = cfg.model.model_copy(update={"name": model_name})
    tokenizer = loading.load_tokenizer(model_cfg)
    shard = cfg.clients.shard if group is not None else None
    # FSDP2's CPU offload takes the base from host memory and keeps its shards there
    load_on = "cpu" if shard and shard.offload == "cpu" and shard.backend == "fsdp" else str(device)
    base = prepare_base(loading.load_base_model(model_cfg, cfg.seed, len(tokenizer), load_on), cfg)
    shard_handle = None  # DeepSpeed's engine: its hooks gather the base's weights
    if shard is not None:
        from fedsweep.models.sharding import shard_base

        shard_handle = shard_base(base, shard.backend, shard.offload, device)
    adapters = make_adapters(base, cfg, cfg.seed, ranks)
    if shard is not None:  # the backend placed the base; the adapter, whole on each process, computes here
        adapters.to(device)
    elif cfg.model.quantization == "none":  # adapter modules follow the base (a quantised one refuses .to)
        adapters.model.to(device)
    adapters.model.eval()
    if cfg.train.compile != "off":
        from fedsweep.models.compiled import compile_layers

        compile_layers(adapters.model, cfg.train.compile)
    return FrozenBase(settings, tokenizer, adapters, device, group, shard_handle)
