"""Split points, bucketing and continuation batches for teacher-KV distillation.

Every sequence x (n tokens: prompt + answer + EOS, or a whole conversation rendered by the chat template) gets its own
split point s (distill.split.*); the teacher prefills x[:s] and the student predicts the continuation x[s:] on the
teacher's cache
(distill.split.prefix_from=student: on the cache of its own prefill of x[:s]; the same split points and batches either
way). Bounds (inclusive):

    s ~ U{lo, ..., hi},   lo = max(min_split, prompt_len if split_after_prompt else 0),   hi = n - min_continuation

min_split >= 1 (the cache needs a token) and min_continuation >= 2 (the last continuation token has no next token,
so a continuation of m tokens gives m - 1 loss positions). Sequences with lo > hi cannot be split: they are dropped
when the data is loaded and counted (`num_too_short`).

A sequence is (ids, prompt_len) or (ids, prompt_len, supervised) (data/loading.py `encode_all`): with `supervised`,
only the continuation tokens with supervised[i] = 1 (the assistant turns, data.supervise) are loss targets; the split
point is drawn over the whole sequence all the same, as the method says. prompt_len is the first assistant token, so
split_after_prompt starts the continuation in the first assistant turn. A sequence with no supervised token after its
lowest split point is dropped with the too-short ones.

Determinism and resumption: the order of sequences and their split points depend only on (data seed, split seed,
epoch), never on RNG state, so a resumed run replays exactly the batches an uninterrupted run sees, and the same
global batch is seen whatever the split into ranks x accumulation micro-batches (1 x 2 and 2 x 1 see the same data).

Waste control: student compute runs on continuation tokens only (the prefix is the teacher's; with
distill.split.prefix_from=student the student also runs the left-padded prefixes). The remaining waste
is right padding of the continuations (logged as student_pad_share). Split points are drawn before batching and
windows of `bucket_windows` global batches are sorted by continuation length before being cut into batches; inside
a step the sequences are again sorted by continuation length before being cut into micro-batches. Packing several
sequences in one row is not used: each row needs its own prefix cache.

Shapes: B micro-batch rows, P longest prefix (left-padded), L longest continuation (right-padded).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from slimwise_train.distill.losses import IGNORE_INDEX


@dataclass(frozen=True)
class SplitRule:
    """distill.split's bounds of the split point (min_split, min_continuation, split_after_prompt)."""

    min_split: int = 1
    min_continuation: int = 2
    after_prompt: bool = False

    @classmethod
    def from_config(cls, split_cfg) -> "SplitRule":
        """The rule of `distill.split`."""
        return cls(int(split_cfg.min_split), int(split_cfg.min_continuation), bool(split_cfg.split_after_prompt))

    def __post_init__(self):
        if self.min_split < 1:
            raise ValueError(f"distill.split.min_split must be >= 1 (the teacher prefix needs a token), "
                             f"got {self.min_split}")
        if self.min_continuation < 2:
            raise ValueError(
                f"distill.split.min_continuation must be >= 2 (a continuation of m tokens has m - 1 next-token "
                f"targets), got {self.min_continuation}"
            )

    def bounds(self, length: int, prompt_len: int) -> tuple[int, int]:
        lo = max(self.min_split, prompt_len if self.after_prompt else 0)
        return lo, length - self.min_continuation

    def splittable(self, length: int, prompt_len: int) -> bool:
        lo, hi = self.bounds(length, prompt_len)
        return lo <= hi


def supervised_of(sequence: tuple) -> list[int] | None:
    """The per-token loss mask of a sequence, None where every token is a target."""
    return sequence[2] if len(sequence) > 2 else None


def _has_target(sequence: tuple, rule: SplitRule) -> bool:
    ids, prompt_len = sequence[0], sequence[1]
    lo, hi = rule.bounds(len(ids), prompt_len)
    if lo > hi:
        return False
    supervised = supervised_of(sequence)
    return supervised is None or any(supervised[lo + 1:])  # targets of the lowest split point: x[lo+1:]


def filter_splittable(encoded: list[tuple], rule: SplitRule) -> tuple[list[tuple], int]:
    """(sequences that can be split with a loss target after the split, number dropped as too short)."""
    kept = [e for e in encoded if _has_target(e, rule)]
    return kept, len(encoded) - len(kept)


def data_fingerprint(sequences: list[tuple]) -> str:
    """A digest of the token ids (and of the loss masks where there are any) a run trains on: a resume with other
    data is refused."""
    digest = hashlib.sha256(json.dumps([s[0] for s in sequences]).encode())
    if any(supervised_of(s) is not None for s in sequences):
        digest.update(json.dumps([supervised_of(s) for s in sequences]).encode())
    return digest.hexdigest()[:16]


def sample_splits(sequences: list[tuple], rule: SplitRule, generator: torch.Generator) -> list[int]:
    """One split point per sequence, uniform on its inclusive bounds, drawn from `generator`."""
    splits = []
    for sequence in sequences:
        ids, prompt_len = sequence[0], sequence[1]
        lo, hi = rule.bounds(len(ids), prompt_len)
        splits.append(int(torch.randint(lo, hi + 1, (1,), generator=generator)))
    return splits


def split_generator(seed: int, epoch: int, stream: int) -> torch.Generator:
    # A fixed stream per (seed, epoch, window): nothing to checkpoint, replayed exactly on resume.
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch * 7919 + stream * 104_729) % (2**63 - 1))


# --------------------------------------------------------------------------- order of the data


class DataPlan:
    """Deterministic global batches with their split points, identical on every rank.

    `global_batch` = world_size x distill.schedule.grad_accum x micro_batch sequences per optimizer step. An epoch holds
    floor(N / global_batch) steps (the remainder is dropped for that epoch; the next epoch reshuffles).
    Per epoch: a random order (data seed), then windows of `bucket_windows` global batches; every sequence of a
    window draws its split point (split seed, epoch, window), the window is sorted by continuation length and cut
    into global batches, and the batch order is shuffled. So a batch holds continuations of similar length (little
    right padding in the student), every sequence still gets s ~ U{lo..hi}, and the whole plan is a function of
    (seeds, epoch): a resumed run replays it exactly.
    """

    def __init__(self, sequences: list[tuple[list[int], int]], rule: SplitRule, global_batch: int, data_seed: int,
                 split_seed: int, bucket_windows: int = 8, shuffle: bool = True):
        if len(sequences) < global_batch:
            raise ValueError(
                f"{len(sequences)} usable training sequences but one optimizer step needs {global_batch} "
                "(world size x distill.schedule.grad_accum x data.batch_size); raise data.num_samples or lower the "
                "batch"
            )
        self.sequences = sequences
        self.rule = rule
        self.global_batch = global_batch
        self.data_seed = data_seed
        self.split_seed = split_seed
        self.bucket_windows = max(1, bucket_windows)
        self.shuffle = shuffle
        self.steps_per_epoch = len(sequences) // global_batch
        self._epoch_cache: tuple[int, list[list[tuple[int, int]]]] | None = None

    def _epoch_batches(self, epoch: int) -> list[list[tuple[int, int]]]:
        if self._epoch_cache is not None and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1]
        n = len(self.sequences)
        g = torch.Generator().manual_seed(self.data_seed * 100_003 + epoch)
        order = torch.randperm(n, generator=g).tolist() if self.shuffle else list(range(n))
        order = order[: self.steps_per_epoch * self.global_batch]
        window = self.global_batch * self.bucket_windows
        batches = []
        for w, start in enumerate(range(0, len(order), window)):
            chunk = order[start : start + window]
            splits = sample_splits([self.sequences[i] for i in chunk], self.rule,
                                   split_generator(self.split_seed, epoch, w + 2))
            # Bucketing on the student's work: sort by continuation length (stable: ties keep the random order).
            pairs = sorted(zip(chunk, splits), key=lambda p: len(self.sequences[p[0]][0]) - p[1])
            batches += [pairs[k : k + self.global_batch] for k in range(0, len(pairs), self.global_batch)]
        if self.shuffle:
            perm = torch.randperm(len(batches), generator=g).tolist()
            batches = [batches[i] for i in perm]
        self._epoch_cache = (epoch, batches)
        return batches

    def position(self, step: int) -> dict:
        return {"epoch": step // self.steps_per_epoch, "batch_in_epoch": step % self.steps_per_epoch}

    def step_batch(self, step: int) -> tuple[list[int], list[int]]:
        """(sequence indices, split points) of the global batch of `step`."""
        pos = self.position(step)
        pairs = self._epoch_batches(pos["epoch"])[pos["batch_in_epoch"]]
        return [i for i, _ in pairs], [s for _, s in pairs]


def plan_micro_batches(sequences, splits: list[int], world_size: int, grad_accum: int) -> list[list[list[int]]]:
    """Cut one step's sequences into grad_accum micro-batches per rank: [rank][accum] -> positions in `sequences`.

    Sorted by continuation length and dealt round-robin to ranks (each rank gets a similar mix, so no rank waits
    for the others), then each rank's sorted share is cut into contiguous micro-batches (little padding).
    """
    assert len(sequences) % (world_size * grad_accum) == 0
    order = sorted(range(len(sequences)), key=lambda i: (len(sequences[i][0]) - splits[i], i))
    plan = []
    for rank in range(world_size):
        mine = order[rank::world_size]
        size = len(mine) // grad_accum
        plan.append([mine[a * size : (a + 1) * size] for a in range(grad_accum)])
    return plan


# --------------------------------------------------------------------------- tensors


@dataclass
class ContinuationBatch:
    prefix_ids: torch.Tensor  # [B, P] left-padded
    prefix_mask: torch.Tensor  # [B, P]
    cont_ids: torch.Tensor  # [B, L] right-padded
    full_mask: torch.Tensor  # [B, P + L] prefix mask then continuation mask
    labels: torch.Tensor  # [B, L] next token inside the continuation where supervised, IGNORE_INDEX elsewhere
    splits: list[int]
    lengths: list[int]

    @property
    def num_loss_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def stats(self) -> dict[str, int]:
        """Token accounting: student rows are continuation slots (real + right padding)."""
        cont_real = sum(n - s for n, s in zip(self.lengths, self.splits))
        prefix_real = sum(self.splits)
        return {
            "cont_tokens": cont_real,
            "cont_slots": self.cont_ids.numel(),
            "prefix_tokens": prefix_real,
            "prefix_slots": self.prefix_ids.numel(),
            "loss_tokens": self.num_loss_tokens,
        }

    def to(self, device) -> "ContinuationBatch":
        for name in ("prefix_ids", "prefix_mask", "cont_ids", "full_mask", "labels"):
            setattr(self, name, getattr(self, name).to(device, non_blocking=True))
        return self


def continuation_batch(sequences: list[tuple], splits: list[int], pad_id: int) -> ContinuationBatch:
    """Tensors for one micro-batch: prefix x[:s] left-padded, continuation x[s:] right-padded, labels x[s+j+1] (only
    where that token is supervised, for a sequence with a loss mask)."""
    batch = len(sequences)
    prefix_width = max(splits)
    cont_width = max(len(sequence[0]) - s for sequence, s in zip(sequences, splits))
    prefix_ids = torch.full((batch, prefix_width), pad_id, dtype=torch.long)
    prefix_mask = torch.zeros((batch, prefix_width), dtype=torch.long)
    cont_ids = torch.full((batch, cont_width), pad_id, dtype=torch.long)
    cont_mask = torch.zeros((batch, cont_width), dtype=torch.long)
    labels = torch.full((batch, cont_width), IGNORE_INDEX, dtype=torch.long)
    for row, (sequence, s) in enumerate(zip(sequences, splits)):
        ids, supervised = sequence[0], supervised_of(sequence)
        ids_t = torch.tensor(ids, dtype=torch.long)
        prefix_ids[row, prefix_width - s :] = ids_t[:s]
        prefix_mask[row, prefix_width - s :] = 1
        m = len(ids) - s
        cont_ids[row, :m] = ids_t[s:]
        cont_mask[row, :m] = 1
        targets = ids_t[s + 1 :]
        if supervised is not None:
            unsupervised = torch.tensor(supervised[s + 1 :], dtype=torch.bool).logical_not()
            targets = targets.masked_fill(unsupervised, IGNORE_INDEX)
        labels[row, : m - 1] = targets
    return ContinuationBatch(
        prefix_ids=prefix_ids,
        prefix_mask=prefix_mask,
        cont_ids=cont_ids,
        full_mask=torch.cat([prefix_mask, cont_mask], dim=1),
        labels=labels,
        splits=list(splits),
        lengths=[len(sequence[0]) for sequence in sequences],
    )
