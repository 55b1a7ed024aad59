"""Which keep set a run uses, and whether it may: the keep-set rules that prune, distill, eval, lm_eval and serve all
apply, in one place (a keep-set rule is one change here).

Before a run uses a keep set file (`keep_set_for_run`, no weights needed):
  1. it is read strictly (`KeepSet.load`: every index a JSON integer, a model_type recorded);
  2. it belongs to the family of the model's config;
  3. a run that exports a stock checkpoint gets a keep set that family can hold (a non-uniform one only where the
     family has a per-expert router bias);
  4. its experts were chosen on this model's weights. A scored keep set records them (`provenance`: meta.model, the
     name, and meta.weights, a sha256 of the model's weight files or of a generated model's recipe), and they are
     compared by content: a byte-identical copy at another path is the same model, a fine-tune written over the
     same folder is not. A keep set from before that record names its model only (meta.model): then the same name
     or the same local folder counts. Another model is an error unless the run allows it (`allow_foreign`), and then
     a warning says the model changed.
Once the weights load, the keep set must fit them (`check_fits`: MoE layers, expert counts, top-k). Whether a run
folder may continue with a keep set is the checkpoint code's (`distill/checkpoint.py`, `check_run_folder`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from dataclasses import dataclass
from types import SimpleNamespace

from slimwise_train.moe.keepset import KeepSet
from slimwise_train.utils.fingerprint import weight_files_digest, weight_files_state
from slimwise_train.utils.hf import resolve_path

log = logging.getLogger("slimwise")


@dataclass(frozen=True)
class ModelWeights:
    """A run's model as the rules compare it.

    identity: its name in messages and in meta.model (`models.model_identity`: `<path>@<revision>` or
    `tiny:<type>:seed=<n>`); folder: the local folder of its weight files (a checkpoint folder, or a hub snapshot in
    the local cache), None for a generated model or a hub id that is not cached; recipe: a generated (tiny random)
    model's recipe as canonical JSON, which determines its weights. `models.model_weights(model_cfg)` builds one from
    a model config; `ModelWeights.of_folder(path)` from a checkpoint folder alone (serve)."""

    identity: str
    folder: str | None = None
    recipe: str | None = None

    @classmethod
    def of_folder(cls, folder: str | os.PathLike) -> "ModelWeights":
        real = os.path.realpath(os.path.expanduser(str(folder)))
        return cls(identity=f"{folder}@main", folder=real)

    @functools.cached_property
    def sha256(self) -> str | None:
        """The content: sha256 of the recipe, or of the weight files (read once per process); None when unknown."""
        if self.recipe is not None:
            return hashlib.sha256(self.recipe.encode()).hexdigest()
        return weight_files_digest(self.folder) if self.folder else None

    def record(self) -> dict:
        """meta.weights of a keep set scored on this model: the content digest, and for a folder its path and its
        files' sizes and times (so a later check of the same, untouched folder need not read them again)."""
        record = {"sha256": self.sha256}
        if self.folder:
            record.update(folder=self.folder, files=weight_files_state(self.folder))
        return record

    def matches(self, recorded: dict) -> bool | None:
        """Whether `recorded` (a meta.weights) describes these weights; None when this model's content is unknown."""
        if self.folder and recorded.get("folder") == self.folder and recorded.get("files") == weight_files_state(
                self.folder):
            return True  # the very files the digest was taken of, not rewritten since
        if self.sha256 is None:
            return None
        return self.sha256 == recorded.get("sha256")

    def has_name(self, scored_on: str) -> bool:
        """Whether a bare meta.model (a keep set written before meta.weights) names this model: the same identity, or
        a local folder named by another path (relative / absolute) at the same revision."""
        if scored_on == self.identity:
            return True
        if not self.folder or "@" not in scored_on or "@" not in self.identity:
            return False
        path, _, revision = scored_on.rpartition("@")
        if revision != self.identity.rpartition("@")[2]:
            return False
        try:
            return os.path.samefile(os.path.expanduser(resolve_path(path)), self.folder)
        except OSError:
            return False


def provenance(model: ModelWeights) -> dict:
    """What a keep set scored on `model` records in its meta (the prune stage's scoring adds it)."""
    return {"model": model.identity, "weights": model.record()}


def _short(digest: str | None) -> str:
    return digest[:12] if digest else "unknown"


def check_scored_on(keep_set: KeepSet, model: ModelWeights, where: str, allow_foreign: bool = False,
                    allow_key: str = "allow_foreign_keep_set") -> None:
    """Raise a one-line ValueError (`where` first) unless `keep_set` was scored on `model`'s weights; with
    `allow_foreign` only warn that the model changed. A keep set that records no model passes (nothing to compare)."""
    scored_on = keep_set.meta.get("model")
    recorded = keep_set.meta.get("weights")
    if isinstance(recorded, dict) and recorded.get("sha256"):
        same = model.matches(recorded)
        if same is None:  # this model's content cannot be read (a hub id not in the local cache): its name decides
            same = bool(scored_on) and model.has_name(str(scored_on))
        if same:
            return
        change = (f"was scored on {scored_on} (weights sha256 {_short(recorded['sha256'])}) but this run's model is "
                  f"{model.identity} (weights sha256 {_short(model.sha256)})")
    elif scored_on:
        if model.has_name(str(scored_on)):
            return
        change = f"was scored on {scored_on} but this run's model is {model.identity}"
    else:
        return
    if allow_foreign:
        log.warning("%s %s: the model changed since the keep set was scored; using it anyway (%s=true)", where, change,
                    allow_key)
        return
    raise ValueError(f"{where} {change}: its experts were chosen for other weights; prune again on this model "
                     f"(python -m slimwise_train.prune with the same model.*), or set {allow_key}=true to use it "
                     "anyway")


def check_exportable(keep_set: KeepSet, config, where: str, export_key: str) -> None:
    """A run that writes a stock checkpoint (`export_key` true) needs a keep set the family can hold: a non-uniform one
    is refused now, by the model's config, not after the work."""
    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.moe.pruning import check_exportable as family_can_export

    if keep_set.is_uniform:
        return
    try:
        family_can_export(get_adapter(config), SimpleNamespace(config=config), keep_set)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}; or run without the export ({export_key}=false)") from None


def keep_set_for_run(path, key: str, *, config, model: ModelWeights, allow_foreign: bool = False,
                     allow_key: str = "allow_foreign_keep_set", export_key: str | None = None) -> KeepSet:
    """The keep set at `path` (given as config key or flag `key`) if this run may use it, checked with the model's
    config and weight files only, before the weights load: rules 1-4 of the module docstring. `export_key`: the key
    that makes this run export a stock checkpoint (rule 3), None when it does not. Errors are one line starting
    `<key>=<path>`."""
    keep_set = KeepSet.load(path, key=key)
    where = f"{key}={path}"
    try:
        keep_set.check_family(config)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if export_key is not None:
        check_exportable(keep_set, config, where, export_key)
    check_scored_on(keep_set, model, where, allow_foreign, allow_key)
    return keep_set


def check_fits(keep_set: KeepSet, model, where: str) -> None:
    """Once the weights load: the keep set's MoE layers, expert counts and top-k are the model's (`where` first)."""
    try:
        keep_set.check_model(model)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def keep_set_difference(recorded: KeepSet, requested: KeepSet) -> str:
    """`recorded` against `requested` in a few words: the first thing that differs."""
    if recorded.model_type and requested.model_type and recorded.model_type != requested.model_type:
        return f"model_type {recorded.model_type}, this run asks for {requested.model_type}"
    mine, theirs = [lk.layer for lk in requested], [lk.layer for lk in recorded]
    if mine != theirs:
        return f"MoE layers {theirs}, this run asks for {mine}"
    if recorded.num_kept != requested.num_kept:
        return f"{list(recorded.num_kept)} kept experts per layer, this run asks for {list(requested.num_kept)}"
    for old, new in zip(recorded, requested):
        if old != new:
            return f"layer {old.layer} keeping experts {list(old.kept)}, this run asks for {list(new.kept)}"
    return "another keep set"
