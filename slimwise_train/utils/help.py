"""`--help` of the Hydra apps (`hydra_app` in utils/cli.py): usage, the config groups the app's config really uses
with their options (the YAML presets, never the typed `*_schema` entries) and every key of the composed config with
its value and a one-line description taken from the typed schema (the `# comments` on and above each dataclass
field, and a class's docstring for a section)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

WIDTH = 110
KEY_COLUMN = 44  # where a key's description starts (a longer `key=value` puts it on the next line)

# App-level keys no schema comment describes: what they mean in every app (a comment on the field wins).
_FALLBACK = {
    "output_dir": "the run folder (hydra.run.dir): everything the run writes goes here",
    "device": "auto: cuda when a GPU is visible, else cpu | cpu | cuda | cuda:<n>",
    "progress": "a progress bar on stderr",
}


# --------------------------------------------------------------------------- descriptions from the schema source


def _own_doc(cls: type) -> str:
    """The class's own docstring, not the signature dataclasses writes for one without."""
    doc = cls.__dict__.get("__doc__") or ""
    if dataclasses.is_dataclass(cls) and doc.startswith(f"{cls.__name__}("):
        return ""
    return inspect.cleandoc(doc)


@lru_cache(maxsize=None)
def field_comments(cls: type) -> dict[str, str]:
    """{field: description} from the class source: the trailing `# comment` of the field's line(s), else the block of
    comment lines right above it. Fields of dataclass bases are included (a subclass's own comment wins)."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        lines = source.splitlines()
        comments: dict[int, tuple[str, bool]] = {}  # line -> (text, after code on that line)
        try:
            for tok in tokenize.generate_tokens(io.StringIO(source).readline):
                if tok.type == tokenize.COMMENT:
                    row, col = tok.start
                    comments[row] = (tok.string.lstrip("#").strip(), bool(lines[row - 1][:col].strip()))
            body = ast.parse(source).body[0].body
        except (SyntaxError, tokenize.TokenError, IndexError, AttributeError):
            continue
        for node in body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            trailing = [comments[row][0] for row in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                        if row in comments and comments[row][1]]
            above, row = [], node.lineno - 1
            while row in comments and not comments[row][1]:
                above.insert(0, comments[row][0])
                row -= 1
            text = " ".join(part for part in (trailing or above) if part)
            if text:
                found[node.target.id] = text
    return found


def _clean(text: str) -> str:
    """One line for the help: the whole comment (never cut: a cut description misleads), without references to the
    source ("(PrefixFrom above)")."""
    return re.sub(r"\s*\((?:see )?[A-Z]\w+ above\)", "", " ".join(text.split()))


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls, include_extras=True)
    except Exception:  # an annotation that does not resolve: no choices, no nested schema
        return {}


def _choices(hint: Any) -> Optional[tuple]:
    """The Literal values of an `Annotated[..., Literal[...]]` (or plain Literal) field, else None."""
    if typing.get_origin(hint) is typing.Annotated:
        for meta in hint.__metadata__:
            if typing.get_origin(meta) is typing.Literal:
                return typing.get_args(meta)
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    return None


def _nested_schema(hint: Any) -> Optional[type]:
    """The dataclass a field holds (through Annotated and Optional), else None."""
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else None
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


# --------------------------------------------------------------------------- values


def _fmt(value: Any) -> str:
    """A value as it is written on the command line (`key=<this>`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return value if value.strip() and value == value.strip() else repr(value)
    return str(value)


def _value(node: Any, key: str) -> str:
    """The value of `node[key]`, resolved where it resolves (an interpolation that does not is shown as written)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    child = node._get_node(key)
    if child is None:
        return "null"
    if OmegaConf.is_missing(node, key):
        return "???"
    try:
        value = node[key]
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
    except Exception:
        value = child._value()
    return _fmt(value)


def _prepare_hydra_node(cfg: Any) -> None:
    """Let `${hydra:...}` resolve as in a run: HydraConfig set, runtime.output_dir = hydra.run.dir (its `${now:...}`
    parts shown as their <format> rather than this second's time)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    if "hydra" not in cfg:
        return
    run_dir = OmegaConf.select(cfg, "hydra.run.dir", default=None)
    raw = cfg.hydra.run._get_node("dir")._value() if run_dir is not None else None
    with open_dict(cfg):
        if isinstance(raw, str):
            cfg.hydra.runtime.output_dir = re.sub(r"\$\{now:([^}]*)\}", r"<\1>", raw)
    try:
        HydraConfig.instance().set_config(cfg)
    except Exception:  # an unusual hydra node: `${hydra:...}` values are then shown as written
        pass


# --------------------------------------------------------------------------- sections


def _wrap(head: str, text: str, column: int = KEY_COLUMN, width: int = WIDTH) -> list[str]:
    """`head` then `text` from `column`, wrapped to `width` with a hanging indent."""
    if not text:
        return [head.rstrip()]
    if len(head) + 2 > column:
        lines = [head.rstrip()]
        head = ""
    else:
        lines = []
    body = textwrap.wrap(text, width=width - column) or [""]
    lines.append(head.ljust(column) + body[0])
    lines += [" " * column + rest for rest in body[1:]]
    return lines


def usage_lines(doc: Optional[str], prog: str) -> tuple[str, list[str]]:
    """(summary, example command lines) from an app module's docstring: its first paragraph, and the lines starting
    with `python -m` / `torchrun` (with their `\\` continuation lines)."""
    doc = inspect.cleandoc(doc or "")
    paragraphs = doc.split("\n\n")
    summary = " ".join(paragraphs[0].split()) if paragraphs and paragraphs[0].strip() else ""
    summary = re.sub(r"^(?:`[^`]*`\s*/?\s*)+:\s*", "", summary)  # "`python -m x`: does y" -> "does y"
    examples, continued = [], False
    for line in doc.splitlines():
        stripped = line.strip()
        if continued or stripped.startswith(("python -m ", "torchrun ")):
            examples.append(("    " if continued else "") + stripped)
            continued = stripped.endswith("\\")
    return summary, examples


def group_lines(cfg: Any, conf_dir: str) -> list[str]:
    """One line per config group of the composed config (hydra.runtime.choices): `group=default` and the presets of
    <conf_dir>/<group>/ (Hydra's own groups left out, but for hydra/launcher where the project ships launchers)."""
    from omegaconf import OmegaConf

    choices = OmegaConf.select(cfg, "hydra.runtime.choices", default=None)
    if choices is None:
        return []
    choices = OmegaConf.to_container(choices)
    top = list(k for k in cfg.keys() if k != "hydra")
    conf = Path(conf_dir)

    def order(group: str) -> tuple:
        package = group.split("@", 1)[1] if "@" in group else group.replace("/", ".")
        head = package.split(".")[0]
        return (top.index(head) if head in top else len(top) + (1 if group.startswith("hydra/") else 0),
                group.count("/"), group)

    lines = []
    for group in sorted(choices, key=order):
        folder = conf / group.split("@", 1)[0]
        if group.startswith("hydra/") and not folder.is_dir():
            continue
        default = choices[group]
        options = sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []
        if default is not None and default not in options:
            options = sorted([*options, default])
        options = [o for o in options if not o.endswith("_schema")]
        head = f"  {group}={_fmt(default)}"
        lines += _wrap(head, "options: " + ", ".join(options) if options else "")
    return lines


def key_lines(cfg: Any, schema: Optional[type]) -> list[str]:
    """Every key of the composed config (the hydra node aside), grouped by top-level section: `key=value` and the
    schema's description (with the Literal choices of a choice field)."""
    from omegaconf import DictConfig

    top_level: list[str] = []
    sections: list[str] = []

    def describe(owner: Optional[type], name: str, path: str) -> str:
        comments = field_comments(owner) if owner else {}
        text = comments.get(name) or (_FALLBACK.get(path, "") if "." not in path else "")
        choices = _choices(_hints(owner).get(name)) if owner else None
        text = _clean(text)
        if choices:
            text = (text + " " if text else "") + "[one of: " + ", ".join(_fmt(c) for c in choices) + "]"
        return text

    def walk(node: DictConfig, owner: Optional[type], prefix: str, out: list[str]) -> None:
        hints = _hints(owner) if owner else {}
        for key in node.keys():
            key = str(key)
            if not prefix and key == "hydra":
                continue
            path = f"{prefix}{key}"
            child = node._get_node(key)
            sub_schema = _nested_schema(hints.get(key))
            if isinstance(child, DictConfig) and sub_schema is not None and not child._is_missing() \
                    and not child._is_none():
                about = describe(owner, key, path) or _clean(_own_doc(sub_schema).split("\n\n")[0])
                if prefix:
                    out += _wrap(f"  {path}:", about, column=KEY_COLUMN)
                    walk(child, sub_schema, f"{path}.", out)
                else:
                    section = []
                    walk(child, sub_schema, f"{path}.", section)
                    sections.append("")
                    sections.extend(textwrap.wrap(f"{path}: {about}" if about else f"{path}:", WIDTH,
                                                  subsequent_indent="    "))
                    sections.extend(section)
                continue
            out += _wrap(f"  {path}={_value(node, key)}", describe(owner, key, path))

    walk(cfg, schema, "", top_level)
    lines = ["top level:", *top_level] if top_level else []
    return lines + sections


def app_help(cfg: Any, *, prog: str, conf_dir: str, schema: Optional[type] = None, doc: Optional[str] = None,
             overrides: tuple[str, ...] = ()) -> str:
    """The `--help` text of a Hydra app: `cfg` is its config composed with the hydra node (return_hydra_config=True)
    for this command line's overrides; `schema` its typed app schema (default: the composed config's own type),
    `doc` the app module's docstring (summary and example commands)."""
    from omegaconf import OmegaConf

    if schema is None:
        found = OmegaConf.get_type(cfg)
        schema = found if isinstance(found, type) and dataclasses.is_dataclass(found) else None
    _prepare_hydra_node(cfg)
    command = f"python -m {prog}"
    summary, examples = usage_lines(doc, prog)
    out = [f"usage: {command} [group=option ...] [key=value ...] [--multirun] [--help] [--hydra-help]"]
    if summary:
        out += ["", *textwrap.wrap(summary, WIDTH)]
    if examples:
        out += ["", "examples:", *(f"  {line}" for line in examples)]
    shown = f" (with {' '.join(overrides)})" if overrides else ""
    groups = group_lines(cfg, conf_dir)
    if groups:
        out += ["", f"config groups: group=option picks a preset; the current one{shown} is shown", *groups]
    out += ["", f"keys: key=value sets one; the values shown are this command line's{shown}", *key_lines(cfg, schema)]
    out += ["", *textwrap.wrap("A list value: key=[a,b]; a sweep: --multirun key=a,b. Hydra's own options: "
                               "--hydra-help; the whole config as YAML: --cfg job.", WIDTH)]
    return "\n".join(line.rstrip() for line in out) + "\n"
