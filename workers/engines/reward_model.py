"""A reward model on transformers: a sequence-classification model's scalar score of a text.

`RewardModelEngine` loads ``AutoModelForSequenceClassification`` (one label) and its tokenizer
from a local directory and scores texts ``batch_size`` at a time: each text is tokenized as the
tokenizer does on its own (its special tokens included), a text longer than ``max_length``
tokens keeps its last ``max_length`` (the response, when the text is prompt + response), rows
are right-padded with the model's pad token, and the score is the model's own pooled logit (at
a row's last token that is not padding).

Guarantees:
- Deterministic, and a text's score does not depend on the texts sharing its batch: right
  padding leaves each row's positions and attended tokens as they are alone, so a batch equals
  one forward pass per text up to float rounding.
- One forward pass at a time (a lock), so several threads may call `score`.
- A model with other than one label is refused at load, naming the directory.
- Called as a batched reward function, ``engine(prompts, responses, metas)`` scores each
  prompt + response (`workers.roles.reward_runner.RewardRunner` calls it so, in a thread).

Runs wherever torch runs (``workers.devices.pick_device``: CUDA, NPU, else CPU).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from workers.devices import pick_device
from workers.engines.hf_rollout import load_pretrained

__all__ = ["RewardModelEngine"]


class RewardModelEngine:
    """Scores texts with a sequence-classification reward model (see the module docstring)."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        max_length: int,
        batch_size: int,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if max_length < 1 or batch_size < 1:
            raise ValueError(f"max_length and batch_size must be >= 1, got {max_length} and "
                             f"{batch_size}")
        from transformers import AutoTokenizer

        self.model_dir = Path(model_dir)
        self.max_length = max_length
        self.batch_size = batch_size
        self.device = pick_device(device)
        self.model = load_pretrained("AutoModelForSequenceClassification", self.model_dir,
                                     device=self.device, dtype=dtype)
        labels = int(self.model.config.num_labels)
        if labels != 1:
            raise ValueError(f"{str(self.model_dir)!r}: a reward model has one label "
                             f"(num_labels=1), this one has {labels}")
        self.tokenizer: Any = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        self.pad_id = self._pad_id()
        self._lock = threading.Lock()

    def _pad_id(self) -> int:
        """The model's pad token, which its pooling looks for; the tokenizer's pad (or EOS)
        token becomes the model's when it has none."""
        config = self.model.config.get_text_config()
        pad = config.pad_token_id
        if pad is None:
            pad = self.tokenizer.pad_token_id
            if pad is None:
                pad = self.tokenizer.eos_token_id
            if pad is None:
                raise ValueError(f"{str(self.model_dir)!r}: neither the model nor its tokenizer "
                                 "has a pad or end-of-sequence token to pad batches with")
            config.pad_token_id = pad
        return int(pad)

    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str],
        metas: Sequence[Mapping[str, Any]],
    ) -> list[float]:
        """The reward of each response: the score of prompt + response."""
        return self.score([p + r for p, r in zip(prompts, responses, strict=True)])

    def score(self, texts: Sequence[str]) -> list[float]:
        """One float per text, in order."""
        if not texts:
            return []
        ids = self.tokenizer(list(texts)).input_ids
        for i, row in enumerate(ids):
            if not row:
                raise ValueError(f"text {i} encodes to no tokens")
        rows = [row[-self.max_length:] for row in ids]
        out: list[float] = []
        with self._lock:
            for start in range(0, len(rows), self.batch_size):
                out.extend(self._forward(rows[start:start + self.batch_size]))
        return out

    @torch.inference_mode()
    def _forward(self, rows: Sequence[Sequence[int]]) -> list[float]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.as_tensor(r, dtype=torch.long)
            mask[i, :len(r)] = 1
        logits = self.model(input_ids=ids.to(self.device),
                            attention_mask=mask.to(self.device)).logits
        return [float(x) for x in logits[:, 0].float().cpu()]
