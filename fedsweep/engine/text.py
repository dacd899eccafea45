"""Turning records into token batches: prompts through the chat template, loss on response tokens,
preference pairs as rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedsweep.lazy import torch

IGNORE = -100


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least float32 (logits of a half-precision forward; float64 stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def prompt_text(tokenizer, prompt: str, system: str | None = None) -> str:
    """The prompt as the model sees it: its chat template with a generation prompt, if it has one.
    ``system``: a system turn before the prompt (``None``: whatever the template adds by default)."""
    if getattr(tokenizer, "chat_template", None):
        turns = ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    return (f"{system}\n" if system else "") + prompt + "\n"


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]


def encode_sft(tokenizer, prompt: str, response: str, max_length: int, eos: bool = True,
               system: str | None = None) -> Example:
    """Prompt and response tokens; labels are IGNORE on the prompt (loss on the response only).
    ``eos=False``: no end-of-sequence token after the response (a response that was cut off).

    An over-long example loses prompt tokens from the left first, so the response (and
    with it every supervised token) survives truncation whenever it fits.
    """
    p = tokenizer(prompt_text(tokenizer, prompt, system), add_special_tokens=False)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
    r = r[:max_length - 1]
    p = p[-(max_length - len(r)):]
    return Example(p + r, [IGNORE] * len(p) + r)


@dataclass
class Labelled:
    """A classification row: the templated prompt's tokens and its class index."""

    input_ids: list[int]
    label: int


def encode_labelled(tokenizer, prompt: str, label: int, max_length: int, system: str | None = None) -> Labelled:
    """The prompt through the chat template (with its generation prompt: the last token is where the
    answer would start, the representation the classification head reads), cut from the left to
    ``max_length``."""
    p = tokenizer(prompt_text(tokenizer, prompt, system), add_special_tokens=False)["input_ids"]
    return Labelled(p[-max_length:], int(label))


def encode_preference(tokenizer, record: dict, max_length: int, system: str | None = None) -> dict[str, list[int]]:
    """TRL's preference example layout: prompt, chosen and rejected token ids (EOS appended).

    Truncation drops prompt tokens from the left first so both completions fit in ``max_length``.
    """
    p = tokenizer(prompt_text(tokenizer, record["prompt"], system), add_special_tokens=False)["input_ids"]
    c = tokenizer(record["chosen"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    r = tokenizer(record["rejected"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    c, r = c[:max_length - 1], r[:max_length - 1]
    keep = max_length - max(len(c), len(r))
    return {"prompt_ids": p[-keep:] if keep > 0 else [], "chosen_ids": c, "rejected_ids": r}


def padded(seqs: list[list[int]], fill: int, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``seqs`` as one (n, width) long tensor padded with ``fill`` (on the right, or the ``left``), and
    the mask that is 1 on each row's own tokens: built in numpy, one tensor each, so a batch of
    any number of rows costs the same few operator calls."""
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    width = int(lengths.max()) if len(seqs) else 0
    cols = np.arange(width)
    mask = (cols >= (width - lengths)[:, None]) if left else (cols < lengths[:, None])
    out = np.full((len(seqs), width), fill, dtype=np.int64)
    out[mask] = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=int(lengths.sum()))
    return torch.from_numpy(out), torch.from_numpy(mask.astype(np.int64))


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch with attention mask; padding is IGNORE in the labels."""
    ids, mask = padded([e.input_ids for e in examples], pad_id)
    labels, _ = padded([e.labels for e in examples], IGNORE)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def encode_prompts_left(tokenizer, prompts: list[str], max_length: int,
                        system: str | None = None) -> dict[str, torch.Tensor]:
    """Left-padded prompt batch for generation."""
    seqs = [tokenizer(prompt_text(tokenizer, p, system), add_special_tokens=False)["input_ids"][-max_length:] for p in prompts]
    ids, mask = padded(seqs, tokenizer.pad_token_id, left=True)
    return {"input_ids": ids, "attention_mask": mask}


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropy over supervised positions, and their count."""
    return target_loss_sum(logits[:, :-1], labels[:, 1:])


def token_loss_rows(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_loss_sum` per row: each row's summed loss (B,) and its count (B,)."""
    return target_loss_rows(logits[:, :-1], labels[:, 1:])


def target_loss_rows(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`target_loss_sum` per row: each row's summed loss (B,) and its target count (B,)."""
    return _cross_entropy(logits, targets, "none").reshape(targets.shape).sum(dim=1), (targets != IGNORE).sum(dim=1)


def target_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sum of cross-entropy of ``logits`` (B, n, V) against aligned ``targets`` (B, n), IGNORE
    excluded, and the number of targets counted."""
    return _cross_entropy(logits, targets, "sum"), int((targets != IGNORE).sum())


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    """Cross-entropy of ``logits`` (B, n, V) in float32 against ``targets`` (B, n), IGNORE excluded."""
    return torch.nn.functional.cross_entropy(upcast(logits).reshape(-1, logits.size(-1)), targets.reshape(-1),
                                             ignore_index=IGNORE, reduction=reduction)


def pair_rows(pairs: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Preference pairs (``encode_preference``'s prompt, chosen and rejected ids) as one right-padded
    batch of rows prompt + chosen, prompt + rejected, pair by pair (row 2i chosen, 2i + 1 rejected),
    with a completion mask that is 1 on the completion's tokens."""
    seqs, masks = [], []
    for p in pairs:
        for completion in (p["chosen_ids"], p["rejected_ids"]):
            seqs.append(list(p["prompt_ids"]) + list(completion))
            masks.append([0] * len(p["prompt_ids"]) + [1] * len(completion))
    ids, attention = padded(seqs, pad_id)
    completion, _ = padded(masks, 0)
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def pair_lengths(pair: dict) -> tuple[int, int]:
    """Tokens of a preference pair's two rows (prompt + chosen, prompt + rejected)."""
    p = len(pair["prompt_ids"])
    return p + len(pair["chosen_ids"]), p + len(pair["rejected_ids"])
