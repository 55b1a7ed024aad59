"""Keep sets: which routed experts each MoE layer keeps for decode.

A keep set is keyed by decoder layer index, records each layer's original expert count and top-k, and is
validated on construction (indices in range, unique, at least top-k kept). `check_model` validates it against
a concrete model (`check_family` against its config alone, before the weights load), so a keep set scored on one
model cannot silently be applied to another. The JSON form is read strictly: every index a JSON integer (3.7 or
true is an error naming the layer, never 3 or 1) and `model_type` required.

JSON form (``format: slimwise-keepset/1``)::

    {"format": "slimwise-keepset/1", "model_type": "qwen3_moe",
     "layers": [{"layer": 0, "num_experts": 8, "top_k": 2, "kept": [0, 3, 5, 6]}, ...],
     "meta": {"criterion": "reap", "ratio": 0.5, ...}}
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from slimwise_train.utils.atomic import write_json_atomic

FORMAT = "slimwise-keepset/1"


@dataclass(frozen=True)
class LayerKeep:
    layer: int
    num_experts: int
    top_k: int
    kept: tuple[int, ...]

    @property
    def removed(self) -> tuple[int, ...]:
        kept = set(self.kept)
        return tuple(j for j in range(self.num_experts) if j not in kept)

    def removed_mask(self, device=None) -> torch.Tensor:
        """[E] bool, True for removed experts."""
        mask = torch.ones(self.num_experts, dtype=torch.bool, device=device)
        mask[list(self.kept)] = False
        return mask


@dataclass(frozen=True)
class KeepSet:
    layers: tuple[LayerKeep, ...]
    model_type: str | None = None
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if not self.layers:
            raise ValueError("keep set has no layers")
        # Sorted indices make kept expert j map to a stable new index in a physically pruned layer.
        object.__setattr__(self, "layers", tuple(
            LayerKeep(lk.layer, lk.num_experts, lk.top_k, tuple(sorted(lk.kept))) for lk in self.layers
        ))
        seen = set()
        for lk in self.layers:
            where = f"keep set layer {lk.layer}"
            if lk.layer in seen:
                raise ValueError(f"{where} appears twice")
            seen.add(lk.layer)
            if len(set(lk.kept)) != len(lk.kept):
                raise ValueError(f"{where}: duplicate expert indices in {list(lk.kept)}")
            bad = [j for j in lk.kept if not 0 <= j < lk.num_experts]
            if bad:
                raise ValueError(f"{where}: expert indices {bad} out of range 0..{lk.num_experts - 1}")
            if len(lk.kept) < lk.top_k:
                raise ValueError(
                    f"{where} keeps {len(lk.kept)} experts but the router picks top-{lk.top_k}; "
                    f"keep at least {lk.top_k} (lower the pruning ratio)"
                )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_kept(cls, moe_layers, kept: dict[int, list[int]] | list[list[int]], model_type=None, meta=None):
        """Build from an adapter's `moe_layers(model)` and kept indices per layer (list in layer order, or a
        dict keyed by decoder layer index)."""
        if isinstance(kept, dict):
            missing = [m.layer_index for m in moe_layers if m.layer_index not in kept]
            if missing:
                raise ValueError(f"kept experts missing for MoE layers {missing}")
            extra = sorted(set(kept) - {m.layer_index for m in moe_layers})
            if extra:
                raise ValueError(f"kept experts given for layers {extra}, which are not MoE layers of this model")
            rows = [kept[m.layer_index] for m in moe_layers]
        else:
            if len(kept) != len(moe_layers):
                raise ValueError(f"kept experts given for {len(kept)} layers but the model has {len(moe_layers)} MoE layers")
            rows = kept
        layers = tuple(
            LayerKeep(m.layer_index, m.num_experts, m.top_k, tuple(int(j) for j in row)) for m, row in zip(moe_layers, rows)
        )
        return cls(layers, model_type=model_type, meta=dict(meta or {}))

    @classmethod
    def keep_all(cls, moe_layers, model_type=None):
        return cls.from_kept(moe_layers, [list(range(m.num_experts)) for m in moe_layers], model_type=model_type)

    # ------------------------------------------------------------------ queries
    def __iter__(self):
        return iter(self.layers)

    def __len__(self):
        return len(self.layers)

    def layer(self, layer_index: int) -> LayerKeep:
        for lk in self.layers:
            if lk.layer == layer_index:
                return lk
        raise ValueError(f"keep set has no layer {layer_index}; it was made for another model")

    @property
    def is_uniform(self) -> bool:
        return len({len(lk.kept) for lk in self.layers}) == 1

    @property
    def num_kept(self) -> tuple[int, ...]:
        return tuple(len(lk.kept) for lk in self.layers)

    @property
    def keep_fraction(self) -> float:
        return sum(self.num_kept) / sum(lk.num_experts for lk in self.layers)

    def check_family(self, model_or_config, adapter=None) -> None:
        """Raise a one-line ValueError unless this keep set was made for the family of `model_or_config` (a model or
        its config: the check needs no weights)."""
        from slimwise_train.moe.adapters import get_adapter, model_type_of

        adapter = adapter or get_adapter(model_or_config)
        if self.model_type is not None and adapter.family != _family_of(self.model_type):
            raise ValueError(
                f"keep set was made for model_type {self.model_type!r} but the model is "
                f"{model_type_of(model_or_config)!r}; prune again on this model (python -m slimwise_train.prune "
                "model=...) and pass that keep_set.json"
            )

    def check_model(self, model, adapter=None) -> None:
        """Raise a one-line ValueError unless this keep set fits `model` (layer indices, counts, top-k, family)."""
        from slimwise_train.moe.adapters import get_adapter

        adapter = adapter or get_adapter(model)
        self.check_family(model, adapter)
        moes = adapter.moe_layers(model)
        model_layers = [m.layer_index for m in moes]
        mine = [lk.layer for lk in self.layers]
        if model_layers != mine:
            raise ValueError(
                f"keep set covers MoE layers {mine} but the model has MoE layers {model_layers}; "
                "it was made for another model"
            )
        for moe, lk in zip(moes, self.layers):
            if moe.num_experts != lk.num_experts:
                raise ValueError(
                    f"keep set layer {lk.layer} is for {lk.num_experts} experts but the model layer has "
                    f"{moe.num_experts}; it was made for another (or an already pruned) model"
                )
            if moe.top_k != lk.top_k:
                raise ValueError(f"keep set layer {lk.layer} assumes top-{lk.top_k}, the model routes top-{moe.top_k}")
            adapter.check_keep(moe, list(lk.kept))

    # ------------------------------------------------------------------ IO
    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "model_type": self.model_type,
            "layers": [
                {"layer": lk.layer, "num_experts": lk.num_experts, "top_k": lk.top_k, "kept": list(lk.kept)}
                for lk in self.layers
            ],
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: dict, where: str = "keep set", require_model_type: bool = True) -> "KeepSet":
        """Parse the JSON form. Every index must be a JSON integer (3.7 or true is an error, never read as 3 or 1),
        and the keep set must name the model_type it was made for (unless `require_model_type` is False: reading a
        run folder's own record, written before model_type was required). `where` starts every error message."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{where}: not a keep set: expected format {FORMAT!r}, got {got!r}")
        model_type = data.get("model_type")
        if model_type is not None and (not isinstance(model_type, str) or not model_type):
            raise ValueError(f"{where}: model_type is {json.dumps(model_type)}, not a model_type name; prune again on "
                             "this model (python -m slimwise_train.prune)")
        if model_type is None and require_model_type:
            raise ValueError(f"{where} records no model_type, so it cannot be checked against the model it is used on; "
                             "prune again on this model (python -m slimwise_train.prune model=...) and pass that "
                             "keep_set.json")
        rows = data.get("layers")
        if not isinstance(rows, list):
            raise ValueError(f"{where}: 'layers' must be a list of {{layer, num_experts, top_k, kept}} entries, got "
                             f"{type(rows).__name__}")
        layers = []
        for position, row in enumerate(rows):
            if not isinstance(row, dict) or not {"layer", "num_experts", "top_k", "kept"} <= set(row):
                raise ValueError(f"{where}: layers[{position}] is {json.dumps(row)[:80]}; each layer needs layer, "
                                 "num_experts, top_k and kept")
            name = f"layers[{position}]"
            layer = _integer(row["layer"], f"{where}: {name} has layer")
            name = f"layer {layer}"
            num_experts = _integer(row["num_experts"], f"{where}: {name} has num_experts")
            top_k = _integer(row["top_k"], f"{where}: {name} has top_k")
            if not isinstance(row["kept"], list):
                raise ValueError(f"{where}: {name} has kept {json.dumps(row['kept'])[:80]}, not a list of expert "
                                 "indices; fix the file or prune again")
            kept = tuple(_integer(j, f"{where}: {name} lists kept expert") for j in row["kept"])
            layers.append(LayerKeep(layer, num_experts, top_k, kept))
        meta = data.get("meta") or {}
        if not isinstance(meta, dict):
            raise ValueError(f"{where}: meta is {json.dumps(meta)[:80]}, not a mapping; fix the file or prune again")
        try:
            return cls(tuple(layers), model_type=model_type, meta=meta)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    def save(self, path: str | os.PathLike) -> None:
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike, key: str | None = None, require_model_type: bool = True) -> "KeepSet":
        """Read a keep_set.json. `key` (e.g. "prune.keep_set") names the config key in errors: `key=path: ...`."""
        path = Path(path)
        where = f"{key}={path}" if key else f"keep set file {path}"
        if not path.is_file():
            raise FileNotFoundError(f"{where} does not exist; write one with `python -m slimwise_train.prune`"
                                    if key is None else f"{where}: no such file; write one with "
                                    "`python -m slimwise_train.prune`")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not valid JSON: {exc}") from None
        return cls.from_dict(data, where, require_model_type=require_model_type)

    def digest(self) -> str:
        """sha256 (hex) of what the keep set keeps: model_type and every layer's counts, top-k and kept experts (meta
        ignored, as `==` does). Names outputs by content: two keep sets whose paths end alike never share a name."""
        content = {"model_type": self.model_type, "layers": self.to_dict()["layers"]}
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()

    def same_experts(self, other: "KeepSet") -> bool:
        """The same kept experts per layer (and counts, top-k) for the same family; model_type is compared only when
        both record one; meta is ignored."""
        if self.layers != other.layers:
            return False
        if self.model_type is None or other.model_type is None:
            return True
        return _family_of(self.model_type) == _family_of(other.model_type)


def _integer(value, what: str) -> int:
    """A JSON integer; bool (a Python int subclass), float and str are refused: never read 3.7 as 3 or true as 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} {json.dumps(value)[:40]}, not an integer; fix the file or prune again")
    return value


def _family_of(model_type: str) -> str:
    from slimwise_train.moe.adapters import family_of

    return family_of(model_type)
