"""The experiment config's typed sections: YAML -> validated models, before anything starts.

Layout of an experiment file (every key optional except ``name``)::

    name: smoke
    seed: 0
    rounds: 2
    eval_every: 1
    model:      {name: tiny}                      # tiny | smollm2-135m-instruct | path | hub id
    lora:       {r: 8, alpha: 16, target_modules: [q_proj, v_proj]}
    data:       {source: reasoning_gym, tasks: [...], examples_per_task: 40}
    partition:  {scheme: task}                    # iid | dirichlet | task | mixed_task
    clients:    {num_clients: 4, fraction: 1.0}           # clients_per_actor: auto
    train:      {objective: sft, steps: 5, batch_size: 4, learning_rate: 1e-3}   # local training
    algorithm:  fedavg
    fedprox:    {mu: 0.01}                        # hyperparameters, one section per plugin

Hyperparameters live in a top-level section named after their plugin, so the sweep
paths read ``drift.delta``, ``fedicu.tau``, ``fedreft.alpha`` and one file can hold the
sections of several methods (a method sweep switches ``algorithm`` only).

The validated :class:`ExperimentConfig` is what every layer receives (it pickles): the
driver validates once (:func:`fedsweep.config.validate`) and passes the object to the
actors, which never rebuild it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from fedsweep.federation.attacks import ATTACKS
from fedsweep.federation.codecs import CODECS
from fedsweep.federation.robust import RULES


class Strict(BaseModel):
    """Config sections: unknown keys refused, every number finite and within its documented bounds,
    and a boolean never accepted where a number is expected (``true`` is not 1)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                value = data.get(name)
                if isinstance(value, bool) and _numeric(field.annotation):
                    raise ValueError(f"{name} = {value}: expected a number, not a boolean")
        return data


def _numeric(annotation: Any) -> bool:
    """int/float, optionally inside Optional/Union (bool itself excluded)."""
    import typing

    if annotation in (int, float):
        return True
    args = typing.get_args(annotation)
    return bool(args) and any(a in (int, float) for a in args) and bool not in args


class TinyModel(Strict):
    """Shape of the randomly initialised Llama used by tests and the smoke run."""

    hidden_size: int = Field(64, ge=8, le=65_536)
    num_layers: int = Field(2, ge=1, le=1024)
    num_heads: int = Field(4, ge=1, le=1024)
    num_kv_heads: int = Field(2, ge=1, le=1024)
    intermediate_size: int = Field(128, ge=8, le=1_048_576)


class ModelSection(Strict):
    name: str = Field("tiny", min_length=1)
    """``tiny``, ``smollm2-135m-instruct`` (bundled), ``random:<architecture>`` (configs/models/, random
    weights: benchmarks), a local directory, or a hub id."""
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    """The frozen base's weights (``bf16``/``fp16``/``fp32``/``fp64`` are accepted too; float64, with its
    adapters in float64 too, serves to check that two computations are the same mathematics). Adapter tensors (LoRA
    factors, ReFT interventions) stay float32 whatever this is: they are what clients exchange and
    the server aggregates."""
    quantization: Literal["none", "8bit", "4bit"] = "none"
    """Load the base quantised by bitsandbytes (LLM.int8 or NF4 with bf16 compute) and prepare it
    with peft's ``prepare_model_for_kbit_training``. Needs a CUDA GPU and ``bitsandbytes``."""
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] | None = None
    """The attention kernel (default: transformers' choice, sdpa). ``flash_attention_2`` needs a CUDA
    GPU and the ``flash-attn`` package."""
    tiny: TinyModel = TinyModel()
    cache_dir: str | None = None
    """Where converted bundled weights are kept (default ``~/.cache/fedsweep``)."""
    names: list[str] | None = None
    """One base model per client (length clients.num_clients) for methods that exchange no
    parameters; ``tiny@HIDDENxLAYERS`` is a tiny model of that shape."""


    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: Any) -> Any:
        return DTYPE_ALIASES.get(value, value)


DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}


class LoraSection(Strict):
    r: int = Field(8, ge=1, le=65_536)
    """The rank of every client, unless ``ranks`` or ``rank_choices`` is given."""
    alpha: float = Field(16.0, gt=0, le=1e6)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"], min_length=1)
    ranks: list[int] | None = None
    """One rank per client (length clients.num_clients)."""
    rank_choices: list[int] | None = Field(None, min_length=1)
    """Each client's rank drawn uniformly from these (seeded), e.g. [8, 16, 32]."""

    @model_validator(mode="after")
    def _one_rank_source(self) -> "LoraSection":
        if self.ranks is not None and self.rank_choices is not None:
            raise ValueError("lora: give ranks or rank_choices, not both")
        if any(r < 1 for r in (self.ranks or []) + (self.rank_choices or [])):
            raise ValueError("lora: every rank must be >= 1")
        return self


class ReftSection(Strict):
    """LoReFT interventions (adapter: reft)."""

    rank: int = Field(4, ge=1, le=65_536)
    layers: list[int] | None = None
    """Decoder layers to intervene on (None: all)."""
    first: int = Field(1, ge=0, le=1_000_000)
    """p: intervene on the first p prompt tokens."""
    last: int = Field(1, ge=0, le=1_000_000)
    """s: intervene on the last s prompt tokens."""
    tied: bool = False
    """One intervention per layer for all positions; false (the FedReFT+ paper's experiments): one per
    position group (first p, last s) per layer."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the intervention output Φ(h) at the intervened positions, during training (as the
    reference LoReFT implementation applies it); 0.0 as in the paper's hyperparameter tables."""


class DataSection(Strict):
    source: Literal["reasoning_gym", "jsonl", "hf"] = "reasoning_gym"
    kind: Literal["instruction", "preference", "classification"] = "instruction"
    """instruction: prompt and response; preference: prompt, chosen, rejected; classification: prompt and
    a ``label`` of ``data.labels`` (the bundled data: each task's question with a proposed answer, right
    or wrong, labelled whether it is right — ``train.objective: classify``)."""
    labels: list[str] = Field(default_factory=lambda: ["no", "yes"], min_length=2, max_length=1000)
    """The classes of classification data, in the order of the classification head's outputs."""
    tasks: list[str] = Field(
        default_factory=lambda: ["basic_arithmetic", "leg_counting", "spell_backward", "gcd"]
    )
    examples_per_task: int = Field(64, ge=4, le=10_000_000)
    path: str | None = None
    """JSONL file (source: jsonl) or dataset name / directory (source: hf)."""
    split: str = "train"
    columns: dict[Literal["prompt", "response", "chosen", "rejected", "task"], str | list[str]] = Field(default_factory=dict)
    """Record field -> the dataset's column (or columns joined by a blank line), for jsonl and hf
    sources whose names differ, e.g. Dolly: {prompt: [instruction, context], task: category}."""
    max_record_bytes: int = Field(1 << 20, ge=64, le=1 << 30)
    """Longest accepted JSONL record (line), in bytes."""
    test_fraction: float = Field(0.2, gt=0, lt=1)
    val_fraction: float = Field(0.0, ge=0, lt=1)
    """Share of each client's training records kept as its local validation split (FedReFT+ α tuning)."""
    holdout_fraction: float = Field(0.1, ge=0, lt=1)
    """Share of records kept out of every client, for methods needing public/validation data."""
    system_prompt: str | None = Field(None, max_length=10_000)
    """A system turn before every prompt (training, evaluation, generation); None: the chat template's
    own default (SmolLM2's adds a 30-token one)."""
    public_prompts: int = Field(0, ge=0, le=1_000_000)
    """Records drawn out of the data for every method, as a public set: a method that uses public
    prompts (FedCoFiT) takes its ``public_prompts`` from it, the others leave it unused, so every
    method's clients hold the same data (paired comparisons). 0: a method's public prompts are
    drawn for it alone."""
    preferences: Literal["correctness", "conflicting_styles"] = "correctness"
    """Preference pairs of the bundled data (``kind: preference``): ``correctness`` — the right
    answer over a wrong one; ``conflicting_styles`` — a concise answer against a verbose one, both
    right, preferred one way by the even-numbered clients and the other way by the odd ones (two
    groups whose preferences conflict, the setting personalised aggregation is for)."""
    holdout_for: Literal["pool_methods", "all"] = "pool_methods"
    """pool_methods: the held-out pool is withheld from training only for methods that use it (pFedGPT);
    the others train on the original data (pFedGPT's protocol, App. E.1). all: withheld for every method.
    Test splits are the same either way."""

    @model_validator(mode="after")
    def _path_needed(self) -> "DataSection":
        if self.source in ("jsonl", "hf") and not self.path:
            raise ValueError(f"data.path is required when data.source is '{self.source}'")
        if self.source == "reasoning_gym" and not self.tasks:
            raise ValueError("data.tasks must name at least one reasoning-gym task")
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"data.labels must be distinct, got {self.labels}")
        if self.preferences != "correctness" and (self.source != "reasoning_gym" or self.kind != "preference"):
            raise ValueError(f"data.preferences = {self.preferences} builds pairs of the bundled data: it needs "
                             f"data.source reasoning_gym and data.kind preference")
        return self


class PartitionSection(Strict):
    scheme: Literal["iid", "dirichlet", "task", "mixed_task"] = "iid"
    dirichlet_beta: float = Field(0.5, gt=0, le=1e6)
    tasks_per_client: int = Field(2, ge=1, le=100_000)
    min_examples: int = Field(2, ge=1, le=10_000_000)
    """Each client keeps at least this many training examples (Dirichlet re-draws)."""


class Resources(Strict):
    num_cpus: float = Field(1.0, ge=0, le=100_000)
    num_gpus: float = Field(0.0, ge=0, le=10_000)
    custom: dict[str, float] = Field(default_factory=dict)
    torch_threads: int | None = Field(None, ge=1, le=10_000)


def _count_or_auto(value: Any) -> Any:
    if value == "auto":
        return value
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.isdigit())):
        raise ValueError("expected a whole number from 1 to 10000, or auto")
    if not 1 <= int(value) <= 10_000:
        raise ValueError("expected a whole number from 1 to 10000, or auto")
    return int(value)


CountOrAuto = Annotated[int | Literal["auto"], BeforeValidator(_count_or_auto)]


class ShardSection(Strict):
    """One client's frozen base sharded over a group of processes (``clients.shard``).

    A sharded client is ``gpus_per_client`` Ray actors, one process per GPU (each with
    ``clients.resources``), forming one ``torch.distributed`` group. The frozen base is sharded
    over them (ZeRO-3 or FSDP2); the adapter and its optimiser state are replicated, its gradients
    averaged over the group, each batch's rows split between the processes. To the rest of fedsweep
    the group is one client actor."""

    gpus_per_client: int = Field(2, ge=1, le=4096)
    """Processes (normally one per GPU) the base is sharded over."""
    backend: Literal["deepspeed", "fsdp"] = "deepspeed"
    """``deepspeed``: DeepSpeed ZeRO stage 3 (needs the ``deepspeed`` package on every node);
    ``fsdp``: PyTorch FSDP2 (``fully_shard``), built into torch."""
    zero_stage: Literal[3] = 3
    """Only stage 3 shards weights; the base is frozen, so stages 1 and 2 would shard nothing."""
    offload: Literal["none", "cpu"] = "none"
    """``cpu``: the base's shards live in host memory and are fetched layer by layer."""
    comm_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """``auto``: NCCL on GPUs, gloo on CPUs. gloo on GPUs lets several processes share one GPU
    (NCCL refuses two ranks on one device): useful for tests, slow for real work."""
    placement_strategy: Literal["STRICT_PACK", "PACK"] = "STRICT_PACK"
    """How one group's processes are placed: ``STRICT_PACK`` keeps them on one node."""

    def comm(self, gpus: float) -> str:
        """The torch.distributed backend for processes given ``gpus`` each."""
        if self.comm_backend != "auto":
            return self.comm_backend
        return "nccl" if gpus > 0 else "gloo"


class ByzantineSection(Strict):
    """Attacking clients, for studying robust aggregation (``federation/attacks.py``)."""

    fraction: float = Field(0.0, ge=0, lt=0.5)
    """Share of the clients that attack (⌊fraction·K + ½⌋ of them, drawn from the seed; every round)."""
    attack: Literal[tuple(ATTACKS)] = "sign_flip"  # type: ignore[valid-type]
    scale: float = Field(1.0, ge=-1e9, le=1e9)
    """λ of sign_flip (−λΔ) and scale (λΔ); the value every entry takes in same_value."""
    sigma: float = Field(1.0, gt=0, le=1e9)
    """σ of the gaussian attack's noise, added to every entry of the update."""


class UploadSection(Strict):
    """What a client sends of its update (``federation/codecs.py``)."""

    compression: Literal[tuple(CODECS)] = "none"  # type: ignore[valid-type]
    block_size: int = Field(64, ge=1, le=1 << 24)
    """int8: entries per block (one float32 scale each)."""
    topk_fraction: float = Field(0.01, gt=0, le=1)
    """topk: share ρ of each tensor's entries sent (k = ⌈ρ n⌉); the rest is kept as the client's residual."""


class DownloadSection(UploadSection):
    """The global model as the server sends it (``federation/download.py``); the upload's codecs and settings."""


class SpeedSection(Strict):
    """Clients' simulated speeds, for ``server.deadline_s`` and ``clients.over_selection``."""

    examples_per_s: float = Field(1.0, gt=0, le=1e12)
    """A client's nominal training speed, in examples per simulated second."""
    sigma: float = Field(0.0, ge=0, le=10)
    """Log-normal spread: client k's speed is examples_per_s · exp(σ z_k), z_k ~ N(0, 1) drawn once from
    (seed, client); 0: every client equally fast."""


class ClientsSection(Strict):
    num_clients: int = Field(4, ge=1, le=10_000)
    fraction: float = Field(1.0, gt=0, le=1)
    clients_per_actor: CountOrAuto = "auto"
    """Clients packed on one ClientActor (one base model, one process). ``auto``: chosen from the
    cluster's CPUs, GPUs and memory before actors start (``fedsweep.plan.layout``)."""
    num_actors: CountOrAuto = "auto"
    """ClientActors to start; ``auto`` follows from ``clients_per_actor`` (or the cluster)."""
    resources: Resources = Resources()
    park: Literal["gpu", "cpu"] = "gpu"
    """Where an idle client's optimiser state waits between its rounds: ``gpu`` (no copies) or
    ``cpu`` (host memory; moved to the GPU for the client's training only). Adapter tensors of idle
    clients are always kept on the CPU: they are what algorithms and the server compute with."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    shard: ShardSection | None = None
    """Shard each client's base over several processes (GPUs); None: one process per client actor."""
    byzantine: ByzantineSection = ByzantineSection()
    upload: UploadSection = UploadSection()
    dropout: float = Field(0.0, ge=0, lt=1)
    """Probability that a sampled client fails to report a round (seeded by seed, round, client): it is
    not trained that round, and its state stays as it was."""
    speed: SpeedSection = SpeedSection()
    over_selection: int = Field(0, ge=0, le=10_000)
    """Sample this many clients more than ⌈fraction · K⌉ and keep the ⌈fraction · K⌉ fastest (by
    simulated time); the others are late and not trained."""

    @property
    def per_round(self) -> int:
        """Clients a round samples before over-selection: max(1, ⌈C·K⌉), C = ``fraction``, K = ``num_clients``
        (the one place this is computed)."""
        return max(1, math.ceil(self.fraction * self.num_clients))

    @property
    def shards(self) -> int:
        """Processes per client actor: ``shard.gpus_per_client``, else 1."""
        return self.shard.gpus_per_client if self.shard else 1

    @model_validator(mode="after")
    def _layout_agrees(self):
        per, actors = self.clients_per_actor, self.num_actors
        if per != "auto" and actors != "auto" and math.ceil(self.num_clients / per) != actors:
            raise ValueError(f"num_actors={actors} and clients_per_actor={per} disagree: {self.num_clients} clients "
                             f"at {per} per actor make {math.ceil(self.num_clients / per)} actor(s); set one to auto")
        return self


class RobustSection(Strict):
    """A Byzantine-robust rule over the clients' updates before the method's aggregation
    (``federation/robust.py``)."""

    rule: Literal[tuple(RULES)] = "none"  # type: ignore[valid-type]
    beta: float = Field(0.1, ge=0, lt=0.5)
    """trimmed_mean: share of values dropped at each end of every entry."""
    f: int = Field(1, ge=0, le=10_000)
    """krum / multi_krum: the attackers tolerated (needs at least 2f + 3 accepted clients)."""
    m: int | None = Field(None, ge=1, le=10_000)
    """multi_krum: clients kept (default: the accepted clients less f)."""
    bound: float | Literal["median"] = "median"
    """norm_bound: the largest update norm; ``median``: the round's median update norm."""

    @field_validator("bound")
    @classmethod
    def _positive(cls, value):
        if not isinstance(value, str) and value <= 0:
            raise ValueError("server.robust.bound must be a positive number or 'median'")
        return value


class ServerSection(Strict):
    resources: Resources = Resources(num_cpus=0.1)
    call_timeout_s: float = Field(3600.0, gt=0, le=30 * 86_400)
    """Longest a single client call (train/evaluate) may take before the round fails."""
    max_replacements: int = Field(3, ge=0, le=1000)
    """How many times a run replaces a server actor that died (from the newest committed round, the
    rounds after it run again); past them the run stops, naming the round kept and ``--resume``."""
    max_update_ratio: float = Field(100.0, gt=1, le=1e12)
    """Reject a client update ‖θ_k − θ_start‖ more than this times ‖θ_start‖ (where the server sent a
    start), or more than this times the median of the other clients' update norms: a diverged client."""
    max_loss_ratio: float = Field(10.0, gt=1, le=1e12)
    """Reject a client whose training loss ends more than this times where it started (exploding)."""
    robust: RobustSection = RobustSection()
    download: DownloadSection = DownloadSection()
    """What the server sends of the global model (``federation/download.py``): the upload's codecs, the
    server keeping the clients' replica and sending what it lacks (its error feedback)."""
    partial_sums: bool = True
    """For a method that reads its clients' uploads only through their mean (FedAvg, FedProx, FedIT,
    FedAvgM, the FedOpt family, FFA-LoRA), and with no robust rule, upload codec or attacker: each client
    actor sends one weighted partial sum of its clients' uploads instead of each (``federation.chain``).
    The mean equals the one from each upload within float rounding (it is summed in float64); a client
    screening rejects makes that round fall back to each upload."""
    deadline_s: float | None = Field(None, gt=0, le=1e12)
    """The round's deadline in *simulated* seconds (a client's steps × batch size over its speed,
    ``clients.speed``): clients that would answer later are not trained that round. The wall-clock
    guard stays ``call_timeout_s``."""


class TrainSection(Strict):
    optimizer: Literal["adamw", "adamw_8bit", "sgd"] = "adamw"
    """``adamw_8bit``: bitsandbytes' 8-bit AdamW (block-wise quantised moments; needs CUDA)."""
    autocast: Literal["auto", "none", "bf16", "fp16"] = "auto"
    """Mixed precision around forward and backward (``torch.autocast``); ``fp16`` adds a gradient
    scaler and needs CUDA. The trainable adapter stays float32 (its master copy). ``auto`` (the
    default) is resolved when the config is validated, so the run's config.yaml holds the value it
    trained with: ``bf16`` where the client actors are given GPUs (``clients.resources.num_gpus`` > 0;
    on a GPU without bfloat16, before Ampere, torch turns autocast off with a warning), else ``none``."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them."""
    tf32: bool = False
    """TF32 matrix products where the model computes in float32 (no autocast) on a GPU that has them
    (Ampere and later): about 3× float32's speed at a 10-bit mantissa. Off by default until a GPU run
    decides it (``make gpu-check``); no effect on the CPU."""
    objective: Literal["sft", "dpo", "classify"] = "sft"
    """sft: loss on response tokens; dpo: DPO on preference pairs, frozen base as reference; classify:
    cross-entropy of a classification head on the intervened last prompt token (FedReFT+ eq. 3–4:
    LoReFT adapters and classification data)."""
    dpo_beta: float = Field(0.1, gt=0, le=1e4)
    """DPO's β (DRIFT's paper trains with 0.2)."""
    steps: int | None = Field(10, ge=1, le=100_000_000)
    epochs: float | None = Field(None, gt=0, le=1e6)
    batch_size: int = Field(4, ge=1, le=1_000_000)
    learning_rate: float = Field(1e-3, gt=0, le=1e3)
    weight_decay: float = Field(0.0, ge=0, le=1e3)
    max_length: int = Field(256, ge=8, le=1_048_576)
    grad_clip: float | None = Field(1.0, gt=0, le=1e9)
    batch_clients: Literal["auto", "off"] | Annotated[int, Field(ge=1, le=1_000_000)] = "auto"
    """How many of an actor's clients share one training step (the engine's groups: one forward and
    backward over all their rows per step, each row with its own client's adapter; evaluation groups
    of personalised clients likewise). ``auto``: on the CPU all of an actor's clients, on a GPU as
    many as the memory planner fits; N: at most N; ``off``: one at a time. Resolved once, on the
    driver, to a number written into the run's config.yaml (``plan.batching``). Results equal one
    client at a time up to float rounding; LoReFT, DP-SGD, sharded clients, 8-bit AdamW and fp16
    train one at a time (``train.batch_reason`` says why)."""
    forwards: Literal["auto", "one", "by_length"] = "auto"
    """How a group step's rows are cut into forwards. ``one``: every row of the step in one forward,
    each client's rows side by side (padding to the step's longest row is cheap on a GPU, and one
    forward is one set of launches whatever the number of clients); ``by_length``: rows sorted by
    length and cut so that padding stays within 15 % of the real tokens (``engine.rows``: on a CPU
    padding costs as much as real tokens); ``auto``: ``one`` on a GPU, ``by_length`` on the CPU.
    Results are the same up to float rounding."""
    pack_tokens: int | None = Field(None, ge=8, le=1_048_576)
    """Padding-free training rows (``engine.packing``): each client's sequences of a forward (an SFT
    example; a DPO pair's two) laid end to end into rows of at most this many tokens (the width that
    computes the fewest cells, at least the longest sequence), positions restarting per
    sequence and attention kept within each (transformers' packed-sequence masks), so a forward
    computes no padding but each row's unused tail. None (the default): right-padded rows. SFT or DPO
    with LoRA, without LoRA dropout or a sharded client. Results equal the padded rows up to float
    rounding. Off until a GPU measurement decides its default (``make gpu-check``)."""
    compile: Literal["off", "inductor", "aot_eager"] = "off"
    """Compile each decoder layer of the base, with its LoRA updates, by ``torch.compile`` (``models.compiled``:
    dynamic shapes, one graph for every layer; a decoding forward, given a KV cache, runs uncompiled).
    ``inductor``: fused generated kernels, for a GPU step bound by launching one kernel per operator;
    ``aot_eager``: the same traced forward and backward on torch's own operators (no generated code, a
    check that compiles in seconds anywhere). Each variant (with or without gradients, how rows' owners
    are laid out) is traced once, in the first round. Results equal the uncompiled layers up to float
    rounding (``aot_eager``: bit for bit, measured on the CPU). LoRA without dropout, without gradient
    checkpointing, a sharded client or a quantised base. Off until a GPU measurement decides its default
    (``make gpu-check``)."""
    batch_reason: str | None = None
    """Why clients train one at a time, where the resolved ``batch_clients`` is 1 (written by the
    driver with the batch plan; a value given in a file is replaced then)."""

    def steps_for(self, examples: int) -> int:
        """A client's local steps a round: ``steps``, or ``epochs`` over its ``examples`` training examples
        in batches of ``batch_size`` (the one rule: the engine trains them, participation times them)."""
        return self.steps or max(1, math.ceil(self.epochs * examples / self.batch_size))

    @field_validator("batch_clients", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        """YAML reads a bare ``off`` as false: it means ``off`` here."""
        return "off" if value is False else value

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> "TrainSection":
        if self.epochs is not None and self.steps is not None and "steps" not in self.model_fields_set:
            object.__setattr__(self, "steps", None)  # epochs given: drop the default steps
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("train: give exactly one of steps or epochs")
        return self


class EvalSection(Strict):
    max_new_tokens: int = Field(16, ge=0, le=1_048_576)
    """Tokens generated per test prompt for accuracy; 0: no generation, test loss only."""
    batch_size: int = Field(8, ge=1, le=1_000_000)
    forwards: Literal["auto", "one", "by_length"] = "auto"
    """How an evaluation group's rows are cut into forwards (and its prompts into generate calls):
    ``one``: every test row of the group in one forward and every prompt in one generation, each row
    with its own client's adapter (a GPU's launches then do not grow with the clients); ``by_length``:
    rows sorted by length in forwards of at most ``batch_size`` rows, prompts in batches of
    ``batch_size``; ``auto``: ``one`` on a GPU, ``by_length`` on the CPU. Results equal up to float
    rounding."""
    max_examples: int | None = Field(None, ge=1, le=100_000_000)
    """Cap on the test records per client whose answers are generated for accuracy (None: all of them).
    Test loss is always computed on the whole test split."""


class TrackingSection(Strict):
    enabled: bool = True
    uri: str = "sqlite:///results/mlflow.db"
    experiment: str | None = None
    """MLflow experiment name (default: the config's ``name``)."""
    run_name: str | None = None
    parent_run_id: str | None = None
    """Nest this run under a parent (fedsweep tune sets it to the study's run)."""
    tags: dict[str, str] = Field(default_factory=dict)
    wait_s: float = Field(900.0, ge=0, le=7 * 86_400)
    """How long a run that has ended waits for a tracking server that does not answer, to deliver what
    it could not send meanwhile (training never waits for it: every write goes through an outbox on
    disk, ``orchestrator/tracking/outbox.py``). What still waits after that is sent by a resumed run
    or by ``fedsweep runs --sync``."""


class CheckpointSection(Strict):
    enabled: bool = True
    dir: str = "results/runs"
    keep: int = Field(2, ge=1, le=1_000_000)
    overlap: bool = True
    """Write a round's files while the next round trains (the client actors copy their state out
    before it changes) and commit the round once they are on disk; the last round is written before
    the run ends. A crash of the driver or server while they are written costs that round too (the
    run resumes from the one before)."""


@dataclass(frozen=True)
class BatchPlan:
    """Clients per training step (at most; an actor's last group may be smaller) and, where that is
    1, why: ``train.batch_clients`` and ``train.batch_reason`` once resolved (``plan.batching``)."""

    clients: int
    reason: str | None = None


class ExperimentConfig(Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    seed: int = Field(0, ge=0, lt=2 ** 32)
    rounds: int = Field(2, ge=1, le=1_000_000)
    eval_every: int = Field(1, ge=1, le=1_000_000)
    algorithm: str = "fedavg"
    adapter: Literal["lora", "reft"] = "lora"
    model: ModelSection = ModelSection()
    lora: LoraSection = LoraSection()
    reft: ReftSection = ReftSection()
    data: DataSection = DataSection()
    partition: PartitionSection = PartitionSection()
    clients: ClientsSection = ClientsSection()
    server: ServerSection = ServerSection()
    train: TrainSection = TrainSection()
    eval: EvalSection = EvalSection()
    tracking: TrackingSection = TrackingSection()
    checkpoint: CheckpointSection = CheckpointSection()
    hparams: dict[str, Any] = Field(default_factory=dict, exclude=True)
    """Validated hyperparameter sections, by plugin name (filled by :func:`validate`)."""

    @model_validator(mode="after")
    def _cross_checks(self) -> "ExperimentConfig":
        if self.train.autocast == "auto":  # the one place ``auto`` is resolved (see TrainSection.autocast)
            resolved = "bf16" if self.clients.resources.num_gpus > 0 else "none"
            object.__setattr__(self.train, "autocast", resolved)
        if self.model.names is not None and len(self.model.names) != self.clients.num_clients:
            raise ValueError(f"model.names has {len(self.model.names)} entries for {self.clients.num_clients} clients")
        if self.lora.ranks is not None and len(self.lora.ranks) != self.clients.num_clients:
            raise ValueError(f"lora.ranks has {len(self.lora.ranks)} entries for {self.clients.num_clients} clients")
        self._check_shard()
        self._check_federation()
        needs = self.cuda_requirements()
        if needs and self.clients.resources.num_gpus == 0:
            raise ValueError(f"{needs[0]} needs a CUDA GPU: set clients.resources.num_gpus above 0 "
                             f"(a CPU-only cluster cannot run it)")
        if self.train.objective == "dpo" and self.data.kind != "preference":
            raise ValueError("train.objective 'dpo' needs preference data: set data.kind to 'preference'")
        if (self.train.objective == "classify") != (self.data.kind == "classification"):
            raise ValueError("train.objective 'classify' and data.kind 'classification' go together: classification "
                             "data trains a classification head, and the head needs labelled records")
        if self.train.objective == "classify" and self.adapter != "reft":
            raise ValueError("train.objective 'classify' trains LoReFT interventions with a classification head "
                             "(FedReFT+ eq. 3–4): set adapter to 'reft'")
        if self.train.pack_tokens is not None:
            self._check_packing()
        self._check_compile()
        if self.partition.scheme in ("task", "mixed_task") and self.data.source == "reasoning_gym":
            if self.partition.scheme == "task" and self.clients.num_clients < len(self.data.tasks):
                raise ValueError(
                    f"partition.scheme 'task' gives each client one task: clients.num_clients "
                    f"({self.clients.num_clients}) must be >= the number of data.tasks ({len(self.data.tasks)})"
                )
            if self.partition.scheme == "mixed_task" and self.partition.tasks_per_client > len(self.data.tasks):
                raise ValueError(
                    f"partition.tasks_per_client ({self.partition.tasks_per_client}) exceeds the "
                    f"{len(self.data.tasks)} data.tasks"
                )
        return self

    def lora_dropout(self) -> float:
        """LoRA's dropout where the adapter is LoRA (0 for LoReFT, whose ``lora`` section is unused)."""
        return self.lora.dropout if self.adapter == "lora" else 0.0

    def packing_refusal(self) -> str | None:
        """Why this config's rows cannot be packed (``train.pack_tokens``); None where they can
        (``models.packing``'s rule, from the config's fields)."""
        from fedsweep.models.packing import packing_refusal

        return packing_refusal(self.train.objective, self.adapter == "lora",
                               self.lora_dropout(), self.clients.shard is not None)

    def _check_packing(self) -> None:
        """What ``train.pack_tokens`` cannot pack, refused with the reason."""
        why = self.packing_refusal()
        if why:
            raise ValueError(why)

    def _check_compile(self) -> None:
        """What ``train.compile`` cannot compile, refused with the reason (``models.compiled``'s rule)."""
        from fedsweep.models.compiled import compile_refusal

        why = compile_refusal(self.train.compile, self.adapter == "lora",
                              self.lora_dropout(), self.clients.shard is not None,
                              self.train.gradient_checkpointing, self.model.quantization != "none")
        if why:
            raise ValueError(why)

    def _check_federation(self) -> None:
        """Robust rules, attacks and compression where the method can take them (``federation.checks``)."""
        from fedsweep.algorithms import registry
        from fedsweep.federation.checks import refusal

        if self.algorithm in registry.names():
            why = refusal(self, self.algorithm, registry.get(self.algorithm).capabilities)
            if why:
                raise ValueError(why)

    def _check_shard(self) -> None:
        """Options a sharded base cannot take, refused with the reason."""
        if self.clients.shard is None:
            return
        refused = {
            "model.quantization": (self.model.quantization != "none",
                                   "a bitsandbytes-quantised base cannot be sharded"),
            "model.names": (self.model.names is not None, "one sharded base is shared by the clients of a group"),
        }
        for path, (bad, why) in refused.items():
            if bad:
                raise ValueError(f"clients.shard cannot be combined with {path}: {why}")
        if self.clients.resources.num_gpus > 1:
            raise ValueError("clients.shard: each process of a sharded client takes one GPU at most "
                             "(clients.resources.num_gpus <= 1); set shard.gpus_per_client for more GPUs")

    def check_shard_method(self) -> None:
        """What the chosen method asks that a sharded base cannot give (its hyperparameters validated)."""
        if self.clients.shard is None:
            return
        from fedsweep.algorithms import registry

        if registry.get(self.algorithm).capabilities.base_merges:
            raise ValueError(f"clients.shard cannot run {self.algorithm}: it merges aggregates into the frozen "
                             f"base, which a sharded client holds in pieces")
        if getattr(self.algo_params, "dp", None) is not None:
            raise ValueError(f"clients.shard cannot be combined with {self.algorithm}.dp: DP-SGD clips each "
                             f"example's gradient on one process")

    def cuda_requirements(self) -> list[str]:
        """The chosen options that only run on a CUDA GPU, as ``path=value``."""
        out = []
        if self.model.quantization != "none":
            out.append(f"model.quantization={self.model.quantization}")
        if self.model.attn_implementation == "flash_attention_2":
            out.append("model.attn_implementation=flash_attention_2")
        if self.train.optimizer == "adamw_8bit":
            out.append("train.optimizer=adamw_8bit")
        if self.train.autocast == "fp16":
            out.append("train.autocast=fp16")
        return out

    def client_models(self) -> list[str]:
        """Every client's base model name."""
        return list(self.model.names) if self.model.names is not None else [self.model.name] * self.clients.num_clients

    @property
    def layout_chosen(self) -> bool:
        """Whether ``clients.clients_per_actor`` is a number (set, or chosen by :meth:`with_layout`)."""
        return self.clients.clients_per_actor != "auto"

    def with_layout(self, layout) -> "ExperimentConfig":
        """This config with the actor layout fixed (a :class:`fedsweep.plan.layout.Layout`)."""
        clients = self.clients.model_copy(update={"clients_per_actor": layout.clients_per_actor,
                                                  "num_actors": layout.num_actors})
        return self.model_copy(update={"clients": clients})

    def actor_groups(self) -> list[list[int]]:
        """Clients hosted by each ClientActor: clients of one base model, ``clients_per_actor`` at a time."""
        if not self.layout_chosen:
            raise RuntimeError("clients.clients_per_actor is auto: choose the layout first "
                               "(fedsweep.plan.resolve.resolve_layout)")
        by_model: dict[str, list[int]] = {}
        for cid, name in enumerate(self.client_models()):
            by_model.setdefault(name, []).append(cid)
        per = int(self.clients.clients_per_actor)
        return [cids[i:i + per] for cids in by_model.values() for i in range(0, len(cids), per)]

    def with_batch_plan(self, plan) -> "ExperimentConfig":
        """This config with ``train.batch_clients`` resolved (a :class:`BatchPlan`)."""
        train = self.train.model_copy(update={"batch_clients": plan.clients, "batch_reason": plan.reason})
        return self.model_copy(update={"train": train})

    def batch_plan(self):
        """The batch plan the driver resolved and wrote into ``train.batch_clients`` (a
        :class:`BatchPlan`). Raises where it is not resolved: the one resolver is the run's plan
        (``plan.resolve.resolve_layout``; ``plan.resolve.for_actor`` for an actor built in-process)."""
        setting = self.train.batch_clients
        if not isinstance(setting, int) or (setting == 1 and not self.train.batch_reason):
            raise ValueError(f"train.batch_clients={setting!r} is not resolved: resolve the batch plan first "
                             f"(fedsweep.plan.resolve.resolve_layout, or fedsweep.plan.resolve.for_actor)")
        return BatchPlan(setting, self.train.batch_reason)

    def client_ranks(self) -> list[int]:
        """Every client's LoRA rank (deterministic in the seed)."""
        if self.lora.ranks is not None:
            return list(self.lora.ranks)
        if self.lora.rank_choices is not None:
            import numpy as np

            from fedsweep import salts

            rng = np.random.default_rng([self.seed, salts.CLIENT_RANKS])
            return [int(r) for r in rng.choice(self.lora.rank_choices, size=self.clients.num_clients)]
        return [self.lora.r] * self.clients.num_clients

    @property
    def algo_params(self) -> BaseModel:
        """The chosen algorithm's validated hyperparameters."""
        return self.hparams[self.algorithm]

    @property
    def num_actors(self) -> int:
        return len(self.actor_groups())

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain data, hyperparameter sections at top level."""
        out = self.model_dump(mode="json")
        for name, params in self.hparams.items():
            out[name] = params.model_dump(mode="json")
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)
