"""One source of defaults and closed choices as types (issue 25): the typed schemas in slimwise_train/config.py hold every default, and a config
group's YAML (conf/<group>/*.yaml) sets only what its preset changes.

The rule checked here: no key in a group YAML repeats the schema's default value (such a line is a second copy of the
default that silently disagrees with the schema the day one of them changes). A preset's `name` equal to its own file
name (engine/torch.yaml: `name: torch`, logger/none.yaml: `name: none`) is the one exception: it names the choice.
The app YAMLs (conf/train.yaml, ...) are not group presets and are not checked.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import get_args

import pytest
from omegaconf import MISSING, OmegaConf

from slimwise_train.config import (CONF_DIR, CheckpointConfig, DataConfig, DistillConfig, DistillEvalConfig,
                                   EngineConfig, LoggerConfig, LossConfig, MemoryConfig, OptimConfig, PruneConfig,
                                   ScheduleConfig, SplitConfig, StudentConfig, TrainableConfig)

# conf/<folder>/*.yaml -> the schema its files are merged onto
GROUPS = {"data": DataConfig, "prune": PruneConfig, "distill": DistillConfig, "distill/trainable": TrainableConfig,
          "engine": EngineConfig, "logger": LoggerConfig}


def _defaults(schema: type) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(schema), resolve=False)


def repeated_defaults(values: dict, defaults: dict, where: str = "") -> list[str]:
    """`key=value` for every key of `values` (nested dicts followed) whose value equals the schema's default."""
    found = []
    for key, value in values.items():
        if key == "defaults" or key not in defaults or defaults[key] == MISSING:
            continue
        path = f"{where}{key}"
        if isinstance(value, dict) and isinstance(defaults[key], dict):
            nested = repeated_defaults(value, defaults[key], f"{path}.")
            found += nested if value != defaults[key] else [f"{path}={value}"]
        elif value == defaults[key]:
            found.append(f"{path}={value}")
    return found


def _group_files():
    for folder, schema in GROUPS.items():
        for path in sorted((Path(CONF_DIR) / folder).glob("*.yaml")):
            yield pytest.param(path, schema, id=f"{folder}/{path.name}")


@pytest.mark.parametrize("path,schema", list(_group_files()))
def test_group_yaml_repeats_no_schema_default(path, schema):
    values = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    if values.get("name") == path.stem:
        values.pop("name")
    repeated = repeated_defaults(values, _defaults(schema))
    assert repeated == [], (f"{path.relative_to(Path(CONF_DIR).parent)} repeats the schema's default "
                            f"({schema.__name__}): drop {', '.join(repeated)}")


def test_every_group_folder_is_checked():
    # a new config group with a schema of its own gets a row in GROUPS
    groups = {p.parent.relative_to(CONF_DIR).as_posix() for p in Path(CONF_DIR).rglob("*.yaml")}
    assert groups - {".", "model", "experiment", "hydra/launcher"} == set(GROUPS)


def test_the_rule_sees_a_repeat_and_lets_a_change_pass():
    defaults = _defaults(DistillConfig)
    assert repeated_defaults({"optim": {"lr": OptimConfig.lr}, "schedule": {"max_steps": 40}}, defaults) == [
        f"optim.lr={OptimConfig.lr}"]
    assert repeated_defaults({"loss": {"top_k": 64, "chunk_size": 8}}, defaults) == ["loss.top_k=64"]
    # a whole group equal to the schema's is one repeat
    assert repeated_defaults({"checkpoint": {"every": 50, "keep": 2}}, defaults) == [
        "checkpoint={'every': 50, 'keep': 2}"]


# --------------------------------------------------------------------------- the distill groups (issue 25 item 5)

DISTILL_GROUPS = {"loss": LossConfig, "student": StudentConfig, "trainable": TrainableConfig, "split": SplitConfig,
                  "memory": MemoryConfig, "optim": OptimConfig, "schedule": ScheduleConfig, "eval": DistillEvalConfig,
                  "checkpoint": CheckpointConfig}


def test_distill_is_grouped_with_each_default_in_one_schema():
    """distill.* is nested groups (each its own dataclass: the one place its defaults are set) plus four run-wide
    flags; every group has a docstring (the --help line of the section) and every field a comment."""
    from slimwise_train.utils.help import field_comments

    fields = {f.name: f for f in dataclasses.fields(DistillConfig)}
    nested = {name: f.default_factory for name, f in fields.items() if f.default_factory is not dataclasses.MISSING}
    assert nested == DISTILL_GROUPS
    assert set(fields) - set(nested) == {"log_every", "export", "check_frozen", "allow_foreign_keep_set"}
    for schema in (DistillConfig, *DISTILL_GROUPS.values()):
        assert schema.__doc__ and not schema.__doc__.startswith(schema.__name__ + "("), schema
        assert set(field_comments(schema)) == {f.name for f in dataclasses.fields(schema)}, schema


def test_every_moved_key_names_a_key_of_the_schema_and_no_yaml_uses_an_old_one():
    """config.MOVED_KEYS (the flat keys of before the groups, refused in one line naming the new place): each old key
    is gone from the schema and its new one is there, with the same default; no YAML under conf/ (group presets,
    app configs, experiments) sets an old key."""
    from slimwise_train.config import MOVED_KEYS

    schema = OmegaConf.structured(DistillConfig)
    old_defaults = {"lr": 1e-3, "max_steps": 100, "eval_every": 50, "save_every": 50, "keep_checkpoints": 2,
                    "prefix_from": "teacher", "recompute": "none", "shared_expert_mode": "auto"}
    assert len(MOVED_KEYS) == 30
    for old, new in MOVED_KEYS.items():
        old_key, new_key = old.split(".", 1)[1], new.split(".", 1)[1]
        assert old_key not in schema and "." in new_key
        assert OmegaConf.select(schema, new_key, default="<absent>") != "<absent>", new
        if old_key in old_defaults:
            assert OmegaConf.select(schema, new_key) == old_defaults[old_key], new
    flat = {old.split(".", 1)[1] for old in MOVED_KEYS}
    for path in sorted(Path(CONF_DIR).rglob("*.yaml")):
        values = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
        rel = path.relative_to(CONF_DIR).as_posix()
        distill = values if rel.startswith("distill/default") else values.get("distill") or {}
        assert not flat & set(distill), f"conf/{rel} sets old flat distill keys {sorted(flat & set(distill))}"


def test_every_app_places_the_model_preset_last_then_self():
    # One order for every app YAML: the groups, `model` last among them (a real checkpoint's preset sets its own data
    # defaults over the data group's), then `_self_` (the app's own values win over the preset), then only
    # `experiment` (train: overrides everything above).
    apps = sorted(p for p in Path(CONF_DIR).glob("*.yaml"))
    assert {p.stem for p in apps} >= {"train", "prune", "eval", "plan"}
    for path in apps:
        entries = [next(iter(e)) if isinstance(e, dict) else e for e in OmegaConf.to_container(OmegaConf.load(path))["defaults"]]
        entries = [e for e in entries if not e.startswith("override hydra/")]  # Hydra's groups, which must come last
        assert entries.index("model") + 1 == entries.index("_self_"), f"{path.name}: {entries}"
        assert set(entries[entries.index("_self_") + 1:]) <= {"experiment"}, f"{path.name}: {entries}"


# --------------------------------------------------------------------------- closed choices and the derived stage


def test_the_zero_stage_is_derived_from_the_engine_name_only():
    from slimwise_train.config import ZERO_STAGE, EngineName, zero_stage
    from slimwise_train.plan import memory

    assert ZERO_STAGE == {"torch": 0, "zero1": 1, "zero2": 2, "zero3": 3}
    assert tuple(ZERO_STAGE) == get_args(EngineName) and memory.ZERO_STAGE is ZERO_STAGE
    assert "zero_stage" not in {f.name for f in dataclasses.fields(EngineConfig)}
    for name, stage in ZERO_STAGE.items():
        assert zero_stage(OmegaConf.structured(EngineConfig(name=name))) == stage


def test_registries_are_read_from_the_schema_literals():
    from slimwise_train.config import EvalMode, EvalConfig
    from slimwise_train.eval.modes import MODES

    assert MODES == get_args(EvalMode) and tuple(EvalConfig().modes) == MODES


def test_the_criterion_registry_is_the_one_list_of_criteria():
    """A new criterion is one function and one entry in prune/criteria.py's CRITERIA: the schema holds no copy of the
    names, and a name outside the registry is refused in one line naming the key and every registered name."""
    from slimwise_train.config import PruneConfig
    from slimwise_train.prune.criteria import CRITERIA, validate_prune_config

    assert PruneConfig.__annotations__["criterion"] in (str, "str")
    with pytest.raises(ValueError) as info:
        validate_prune_config(OmegaConf.structured(PruneConfig(criterion="magic")))
    assert str(info.value) == f"prune.criterion='magic' is not one of: {', '.join(CRITERIA)}"


@pytest.mark.parametrize("app,override,line", [
    ("train", "engine.name=zero4", "engine.name='zero4' is not one of: torch, zero1, zero2, zero3"),
    ("train", "engine.precision=fp16", "engine.precision='fp16' is not one of: auto, fp32, bf16"),
    ("train", "logger.mode=loud", "logger.mode='loud' is not one of: auto, online, offline, disabled"),
    ("prune", "prune.scope=row", "prune.scope='row' is not one of: layer, global"),
    ("plan", "device=tpu", "device='tpu' is not one of: cuda, cpu"),
    ("eval", "eval.modes=[full,fast]",
     "eval.modes=['full', 'fast']: 'fast' is not one of: full, conventional, slimwise, reverse, conventional_distill, "
     "slimwise_distill"),
])
def test_a_value_outside_a_choice_is_one_line_naming_the_key_and_the_choices(app, override, line):
    from helpers import compose_config

    from slimwise_train.config import EvalAppConfig, PlanAppConfig, PruneAppConfig, TrainAppConfig, check_known_keys

    schema = {"train": TrainAppConfig, "prune": PruneAppConfig, "plan": PlanAppConfig, "eval": EvalAppConfig}[app]
    with pytest.raises(ValueError) as info:
        check_known_keys(compose_config(app, override), schema)
    assert str(info.value) == line
