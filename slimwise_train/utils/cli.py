"""What every `python -m slimwise_train.<app>` entry point shares: one-line errors for bad input, checked before
the run creates anything (`hydra_app`), and a logged thread count."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

# Bad input raises one of these (a bad key in a config or file is a ValueError naming it). KeyError is not one: a missing
# dictionary key is a bug, and a bug shows its traceback (exit 1) instead of passing for the user's mistake.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError)


class OneLineParser(argparse.ArgumentParser):
    """argparse for the apps that take flags: a usage error is one line naming the flag, with a pointer to
    `--help`, instead of the whole usage block (subcommands' parsers are of this class too)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class MachineFault(RuntimeError):
    """A failure of the machine, not of the input (a disk that filled up mid-write): one line, exit 1, after the
    code that raised it has removed what it was writing."""


def _disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # safetensors' Rust writer reports ENOSPC as SafetensorError('... No space left on device (os error 28)')
    return type(exc).__name__ == "SafetensorError" and "os error 28" in str(exc)


def _report_to_torchrun(line: str) -> None:
    # torchrun ends with a "Root Cause" block read from this file: put the one clear line there, instead of
    # "error_file: <N/A>" and a pointer to the elastic docs, so it is what the user reads last.
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    with contextlib.suppress(OSError):
        with open(path, "w") as handle:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, handle)


@contextlib.contextmanager
def user_errors(prog: str, interrupted: str | None = None) -> Iterator[None]:
    """Turn a user error into `<prog>: error: <message>` on stderr and exit code 2 (no traceback); a MachineFault or
    a full disk into one such line and exit code 1; with `interrupted` (what of the run is kept), Ctrl-C into
    `<prog>: interrupted (Ctrl-C): <interrupted>` and exit code 130.

    Under torchrun only rank 0 prints it (every rank hits the same bad input); the others exit quietly with the
    same code."""
    try:
        yield
    except KeyboardInterrupt:
        if interrupted is None:
            raise
        _exit_with(f"{prog}: interrupted (Ctrl-C): {interrupted}", 130)
    except USER_ERRORS as exc:
        _exit_with(f"{prog}: error: {exc}", 2)
    except Exception as exc:
        if isinstance(exc, MachineFault):
            _exit_with(f"{prog}: error: {exc}", 1)
        if _disk_full(exc):
            _exit_with(f"{prog}: error: no space left on the device ({str(exc).splitlines()[0]}); free space or choose "
                       "another output folder (files being written were not published)", 1)
        raise


def _exit_with(line: str, code: int) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, file=sys.stderr)
    _report_to_torchrun(line)  # also from other ranks: an error only rank 1 hits still reaches the user
    raise SystemExit(code) from None


# --------------------------------------------------------------------------- Hydra entry points

# Flags after which Hydra does something other than run the job (help, config printing, completion) or reads the
# config from elsewhere: the pre-check composes the app's own config and would check the wrong thing there.
_NOT_A_RUN = ("-h", "--help", "--hydra-help", "--version", "-c", "--cfg", "-p", "--package", "--resolve", "-i",
              "--info", "-sc", "--shell-completion", "-cp", "--config-path", "-cn", "--config-name", "-cd",
              "--config-dir", "--experimental-rerun")


def _one_line(exc: BaseException) -> str:
    """Hydra's and OmegaConf's composition errors as one line: the first line of each message in the cause chain,
    the key OmegaConf names, and a group's options (without the typed `*_schema` entries)."""
    import dataclasses
    import difflib
    import re

    parts, options, key, schema = [], [], None, None
    while exc is not None:
        object_type = getattr(exc, "object_type", None)  # OmegaConf names the typed schema a bad key was aimed at
        schema = object_type if dataclasses.is_dataclass(object_type) else schema
        lines = [line for line in str(exc).splitlines() if line.strip()]
        if lines and lines[0].strip() not in parts:
            parts.append(lines[0].strip().rstrip("."))
        in_options = False
        for line in lines[1:]:
            stripped = line.strip()
            if stripped.startswith("Available options"):
                in_options = True
            elif not line.startswith("\t"):
                in_options = False
            if in_options and line.startswith("\t") and not stripped.endswith("_schema"):
                options.append(stripped)
            if stripped.startswith("full_key:") and stripped.split(":", 1)[1].strip():
                key = stripped.split(":", 1)[1].strip()
        exc = exc.__cause__
    line = ": ".join(parts)
    if key and key not in line:
        line += f" (key {key})"
    if options:
        line += f"; choose one of: {', '.join(options)}"
    unknown = re.search(r"Key '(\w+)' not in '(\w+)'", line)
    if unknown and schema is not None and schema.__name__ == unknown.group(2):
        close = difflib.get_close_matches(unknown.group(1), [f.name for f in dataclasses.fields(schema)], n=1)
        if close:
            line += f"; did you mean {close[0]}?"
    return line


def _moved_key(overrides: list[str], exc: BaseException, moved: Callable[[str], str | None]) -> str | None:
    """`distill.lr moved to distill.optim.lr` (what `moved(key)` says of a renamed key, None for any other) when the
    failed composition used a renamed key: on the command line (every one given), or in a YAML (the key OmegaConf
    names in the error, after the YAML Hydra names); None otherwise."""
    import re

    given = [moved(override.split("=", 1)[0].strip().lstrip("+~")) for override in overrides]
    if any(given):
        return "; ".join(dict.fromkeys(line for line in given if line))  # every renamed key given, each once
    where = re.match(r"In '[^']+'", str(exc))  # Hydra names the YAML: "In 'experiment/old': ..."
    while exc is not None:
        line = moved(str(getattr(exc, "full_key", "") or ""))
        if line:
            return f"{where.group(0)}: {line}" if where else line
        exc = exc.__cause__ or exc.__context__
    return None


def _override_variants(overrides: list[str]) -> list[list[str]]:
    """Each sweep value checked once: the first value of every sweep, then each other value of one sweep."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    base = [o.input_line if not o.is_sweep_override() else None for o in parsed]
    sweeps = {i: [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
              for i, o in enumerate(parsed) if o.is_sweep_override()}
    first = [line if line is not None else sweeps[i][0] for i, line in enumerate(base)]
    variants = [first]
    for i, values in sweeps.items():
        variants += [first[:i] + [value] + first[i + 1:] for value in values[1:]]
    return variants


def _shown_dict(values: dict) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in values.items()) + "}"


def _check_whole_dict_overrides(variant: list[str], compose: Callable[[list[str]], object]) -> None:
    """Refuse `key={...}` aimed at a dict the config already has (distill.loss.terms, model.tiny_overrides): Hydra
    merges a dict given whole into the one there, so `distill.loss.terms={kl: 1.0}` kept ce at 0.1, `{}` changed
    nothing, and a key not there (`{full_kl: 1.0}`) failed with "not in struct". The line spells the overrides that
    do make the dict the one given (`~` removes a key, `+` adds one). A null field (eval.budget) takes the dict as
    given and is not refused; `compose(overrides)` composes the variant without the dict overrides to see what is
    there."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    parsed = OverridesParser.create().parse_overrides(variant)
    # `+key={...}` and `++key={...}` on a dict that is there merge the same way
    whole = {i: o for i, o in enumerate(parsed) if not o.is_delete() and isinstance(o.value(), dict)}
    if not whole:
        return
    base = compose([line for i, line in enumerate(variant) if i not in whole])
    for i, override in whole.items():
        key = override.key_or_group
        there = OmegaConf.select(base, key, default=None)
        if not OmegaConf.is_dict(there):
            continue
        there, given = OmegaConf.to_container(there), override.value()
        if set(there) == set(given):
            continue
        kept, added = [k for k in there if k not in given], [k for k in given if k not in there]
        effect = "; ".join(part for part in (
            f"it would keep {', '.join(map(str, kept))}" if kept else "",
            f"it cannot add {', '.join(map(str, added))} that way"
            if added and not (override.is_add() or override.is_force_add()) else "") if part)
        spelling = [f"~{key}.{k}" for k in kept]
        spelling += [f"{'' if k in there else '+'}{key}.{k}={v}" for k, v in given.items()]
        raise ValueError(f"{variant[i]}: Hydra merges a dict given whole into the one there ({_shown_dict(there)}): "
                         f"{effect}; to make {key} {_shown_dict(given)} write "
                         f"{' '.join(spelling) if spelling else '(nothing to change)'}")


def _add_with_plus(overrides: list[str], exc: BaseException) -> str:
    """`; a new key of a dict is added with +distill.loss.terms.full_kl=1.0` where Hydra refused a key a free-form
    dict does not have yet ("not in struct"), given without `+`; "" otherwise (a typed schema's unknown key is
    check_known_keys' to name)."""
    import re

    text = " ".join(str(e) for e in (exc, exc.__cause__) if e is not None)
    missing = re.search(r"Key '([^']+)' is not in struct", text)
    if not missing:
        return ""
    for override in overrides:
        key = override.split("=", 1)[0]
        if not key.startswith(("+", "~")) and key.split(".")[-1] == missing.group(1):
            return f"; a new key of a dict is added with +{override}"
    return ""


def _unquoted_value(overrides: list[str]) -> str | None:
    """The fix for an override Hydra's grammar cannot read unquoted (a non-ASCII path: Hydra says only
    `LexerNoViableAltException: <override>`): quote the value for Hydra, inside the shell's quotes. None when every
    override parses alone (the error is another one)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except HydraException:
            key, sep, value = override.partition("=")
            if not sep or value[:1] in ("'", '"'):
                continue
            # Hydra's quotes inside the shell's: '"..."' in single quotes, or "'...'" where the value holds a "
            fix = f"'{key}=\"{value}\"'" if '"' not in value else f"\"{key}='{value}'\""
            return (f"{override}: Hydra's override grammar reads an unquoted value as ASCII letters, digits and a few "
                    f"symbols only; quote the value for Hydra inside the shell's quotes: {fix}")
    return None


def _compose_or_exit(config_name: str, prog: str, overrides: list[str], conf_dir: str,
                     check: Callable | None = None, schema: type | None = None,
                     moved: Callable[[str], str | None] | None = None):
    """Compose the app's config the way @hydra.main will; a bad override is one line and exit 2, before Hydra
    creates the output folder. With `check`, every variant (without its hydra node) is also passed to
    `check(cfg, schema)` (the apps: config.check_known_keys, which refuses an unknown key or a value outside a Literal
    field's choices such as engine.name=zero4 with a ValueError). Returns the config of the first variant (with its
    hydra node), or None where the pre-check cannot stand in for Hydra (help and config flags). With `moved`, a
    failure caused by a renamed key says where it moved instead (`_moved_key`)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import open_dict
    from omegaconf.errors import OmegaConfBaseException

    try:
        variants = _override_variants(overrides)
        first = None
        with initialize_config_dir(config_dir=conf_dir, version_base=None):
            for variant in variants:
                _check_whole_dict_overrides(variant, lambda lines: compose(config_name, overrides=lines))
                cfg = compose(config_name, overrides=variant, return_hydra_config=True)
                first = first if first is not None else cfg
                if check is not None:
                    body = cfg.copy()
                    with open_dict(body):
                        body.pop("hydra", None)
                    check(body, schema)
        return first
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        plain = isinstance(exc, ValueError) and not isinstance(exc, (HydraException, OmegaConfBaseException))
        # a flat distill key of before the groups (distill.lr): where it moved, rather than Hydra's "not in struct"
        renamed = _moved_key(overrides, exc, moved) if moved is not None and not plain else None
        quoted = _unquoted_value(overrides) if "LexerNoViableAlt" in str(exc) else None
        hydras = exc if plain else _one_line(exc) + _add_with_plus(overrides, exc)
        line = f"{prog}: error: {renamed or quoted or hydras}"  # check_known_keys' line, or Hydra's
        if int(os.environ.get("RANK", "0")) == 0:
            print(line, file=sys.stderr)
        _report_to_torchrun(line)
        raise SystemExit(2) from None


class _RunFolder:
    """What this run is about to create in its Hydra run folder (the folder and missing parents, the log), so a run
    refused for bad input, or stopped by Ctrl-C before writing anything else, can leave the disk as it found it."""

    def __init__(self, folder: Path, log_file: Path):
        self.folder, self.log_file = folder, log_file
        self.created = []  # deepest first
        for path in (folder, *folder.parents):
            if path.exists():
                break
            self.created.append(path)
        self.log_size = log_file.stat().st_size if log_file.exists() else None

    def undo(self, only_if_untouched: bool = False) -> None:
        if only_if_untouched and self.folder.is_dir():
            others = [p for p in self.folder.iterdir() if p != self.log_file and p.name != ".slimwise.lock"]
            if others:
                return
        with contextlib.suppress(OSError):
            if self.log_size is None:
                self.log_file.unlink()
            else:
                os.truncate(self.log_file, self.log_size)
        for path in self.created:
            with contextlib.suppress(OSError):
                path.rmdir()  # only ever empty folders: anything another writer put there stays


def threads_for_this_process() -> tuple[int, str]:
    """(threads, why): OMP_NUM_THREADS when set, else the physical cores this process may run on (its CPU
    affinity, hyper-threads counted once, capped by a cgroup CPU quota)."""
    from_env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if from_env.isdigit() and int(from_env) > 0:
        return int(from_env), "OMP_NUM_THREADS"
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
            cores.add(((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    count = max(1, len(cores))
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            count = max(1, min(count, int(int(quota) // int(period))))
    return count, "physical cores available to this process; set OMP_NUM_THREADS to change"


# What a help request may come with for our own help (overrides aside); any other flag goes to Hydra as before.
_HELP = ("-h", "--help")
_HELP_ALONGSIDE = (*_HELP, "-m", "--multirun")


def _print_help(task: Callable, conf_dir: str, config_name: str, prog: str, schema: type | None,
                args: list[str], moved: Callable[[str], str | None] | None = None) -> None:
    """`-h` / `--help`: the app's own help (utils/help.py), its values composed with the overrides given beside it."""
    from hydra.core.global_hydra import GlobalHydra

    from slimwise_train.utils.help import app_help

    overrides = [a for a in args if a not in _HELP_ALONGSIDE]
    cfg = _compose_or_exit(config_name, prog, overrides, conf_dir, moved=moved)
    try:
        module = sys.modules.get(getattr(task, "__module__", ""), None)
        text = app_help(cfg, prog=prog, conf_dir=conf_dir, schema=schema, doc=getattr(module, "__doc__", None),
                        overrides=tuple(overrides))
    finally:
        GlobalHydra.instance().clear()
    sys.stdout.write(text)
    sys.stdout.flush()


def hydra_app(conf_dir: str, config_name: str, prog: str, set_threads: bool = True,
              schema: type | None = None, check: Callable | None = None,
              moved: Callable[[str], str | None] | None = None,
              interrupted: str = "nothing of this run was kept") -> Callable[[Callable], Callable[[], None]]:
    """`@hydra.main` for the slimwise apps, with what each of them needs before and around the job:

    - the overrides are composed first, so a bad one (an unknown preset, `world_size=abc`) is one line and exit 2
      instead of Hydra's multi-line block, and an output folder that cannot be created is refused by name;
    - a run refused for bad input (exit 2) leaves no folder or log behind; one stopped with Ctrl-C before it
      wrote anything but its log neither;
    - torch's thread count is set and logged (`threads_for_this_process`), unless set_threads=False (the planner
      computes nothing and its `json_only` output must stay one line);
    - `-h` / `--help` print the app's own help (groups with their presets, every key with its value and the
      description from `schema`, the typed app config; default: the composed config's own type), exit 0;
    - Ctrl-C is one line, `<prog>: interrupted (Ctrl-C): <interrupted>` (what of the run is kept and how to go on),
      and exit 130 (128 + SIGINT), not a traceback;
      `--hydra-help` is Hydra's;
    - `check(cfg, schema)` (the apps: config.check_known_keys) runs on every composed variant before anything is
      created: a value outside a Literal field's choices is one line and exit 2, and no folder;
    - `moved(key)` (train and plan: config.moved_key_message) names the new place of a renamed key: an old key on
      the command line (with --help and --multirun too) or in a YAML is `<old> moved to <new>`, exit 2, no folder."""
    import functools

    import hydra

    def decorate(task: Callable) -> Callable[[], None]:
        @functools.wraps(task)
        def job(cfg) -> None:
            if not set_threads:
                return task(cfg)
            import torch

            from omegaconf import OmegaConf

            threads, why = threads_for_this_process()
            configured = OmegaConf.select(cfg, "cpu_threads", default=None)  # the train app's own key wins on CPU
            device = str(OmegaConf.select(cfg, "device", default="cpu"))
            on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
            if configured and on_cpu:
                threads, why = int(configured), "cpu_threads in the config"
            torch.set_num_threads(threads)
            logging.getLogger("slimwise").info("torch threads: %d (%s)", threads, why)
            return task(cfg)

        run_hydra = hydra.main(config_path=conf_dir, config_name=config_name, version_base=None)(job)

        @functools.wraps(task)
        def main() -> None:
            args = sys.argv[1:]
            flags = [arg for arg in args if arg.startswith("-")]
            if any(arg in _HELP for arg in flags) and all(arg in _HELP_ALONGSIDE for arg in flags):
                return _print_help(task, conf_dir, config_name, prog, schema, args, moved)
            if any(arg.split("=", 1)[0] in _NOT_A_RUN for arg in args):
                return run_hydra()
            multirun = any(arg in ("-m", "--multirun") for arg in args)
            cfg = _compose_or_exit(config_name, prog, [a for a in args if a not in ("-m", "--multirun")], conf_dir,
                                   check, schema, moved)
            if multirun or cfg is None:
                try:
                    return run_hydra()
                except KeyboardInterrupt:
                    _exit_with(f"{prog}: interrupted (Ctrl-C): {interrupted}", 130)
            from omegaconf import OmegaConf

            from slimwise_train.utils.rundir import check_writable

            try:
                folder = Path(OmegaConf.select(cfg, "hydra.run.dir"))
                job_name = OmegaConf.select(cfg, "hydra.job.name")
                with user_errors(prog):
                    check_writable(folder, what="output folder (hydra.run.dir)", create=False)
            finally:
                from hydra.core.global_hydra import GlobalHydra

                GlobalHydra.instance().clear()
            run_folder = _RunFolder(folder, folder / f"{job_name}.log")
            # Hydra resolves hydra.run.dir again in its own config, and ${now:...} there is a new clock reading (its
            # cache is per config): pin the folder checked here, so the run writes, and a refusal cleans, that one.
            sys.argv = [sys.argv[0], *(a for a in args if not a.startswith("hydra.run.dir=")),
                        "hydra.run.dir='" + str(folder).replace("'", "\\'") + "'"]
            try:
                run_hydra()
            except SystemExit as exc:
                if exc.code == 2:
                    run_folder.undo()
                raise
            except KeyboardInterrupt:
                run_folder.undo(only_if_untouched=True)
                _exit_with(f"{prog}: interrupted (Ctrl-C): {interrupted}", 130)

        return main

    return decorate
