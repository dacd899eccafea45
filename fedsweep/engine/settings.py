"""What the engine reads of a run: one frozen object, made once from the run's config by the actor
that computes (``actors.engine_setup.settings_from``). The engine never sees the config itself, so
a rule of the run (the objective and its β, the precision, the steps, the seeds) is read in one
place, and the engine can be driven without a config (the bench's bare loops, tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fedsweep.engine.objectives import Dpo, Objective


@dataclass(frozen=True)
class EngineSettings:
    """A run's settings as the engine uses them."""

    seed: int
    """The run's seed: every stream of a client's round derives from (seed, round, client)."""
    objective: Objective
    """The training objective, with its own settings (DPO's β): ``engine.objectives``."""
    margins: Dpo | None
    """Preference data: the DPO objective its evaluation's reward margins are taken with (None: not
    preference data)."""
    batch_size: int
    steps_for: Callable[[int], int]
    """A client's local steps a round from its number of training examples (the config's one rule,
    ``train.steps`` or ``train.epochs``)."""
    clients_per_step: int
    """The batch plan: at most this many of an actor's clients share a training step."""
    alone_reason: str | None
    """Why clients train one at a time, where ``clients_per_step`` is 1."""
    autocast: str
    """Mixed precision of forwards: ``none``, ``bf16`` or ``fp16`` (resolved, never ``auto``)."""
    tf32: bool
    """TF32 matrix products on a GPU where the model computes in float32 (``train.tf32``)."""
    optimizer: str
    """``adamw``, ``adamw_8bit`` or ``sgd``."""
    learning_rate: float
    weight_decay: float
    grad_clip: float | None
    forwards: str
    """How a step's rows are cut into forwards: ``auto``, ``one`` or ``by_length``."""
    max_length: int
    system_prompt: str | None
    eval_batch_size: int
    eval_forwards: str
    """How an evaluation group's rows are cut into forwards: ``auto``, ``one`` or ``by_length``."""
    max_new_tokens: int
    lora_dropout: float
    """LoRA's dropout in training (0 for LoReFT)."""
    park_on_cpu: bool
    """Whether an idle client's optimiser state waits in host memory (``clients.park``)."""
    pack_tokens: int | None = None
    """Padding-free training rows of this many tokens (``train.pack_tokens``, ``engine.packing``); None:
    right-padded rows."""
    labels: tuple[str, ...] = ()
    """Classification data's classes (``data.labels``), the head's outputs in order; empty otherwise."""

    @property
    def classification(self) -> bool:
        """Whether rows are labelled prompts read by a classification head (``train.objective: classify``)."""
        return bool(self.labels)

    @property
    def preference(self) -> bool:
        """Whether the run trains and evaluates on preference pairs."""
        return self.margins is not None
