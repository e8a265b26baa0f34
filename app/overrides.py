"""``--set KEY=VALUE`` on the command line: each VALUE read as YAML, as in a config file, and one
that YAML reads otherwise than it looks refused with how to quote it."""

from __future__ import annotations

import json
import shlex

import yaml

from core.errors import ConfigError

__all__ = ["parse_set"]


def parse_set(values: tuple[str, ...]) -> dict:
    """``--set KEY=VALUE`` overrides, each VALUE read as YAML (as in a config file); one that YAML
    cannot read, or reads otherwise than it looks (a comment, a mapping), is a ConfigError naming
    the key, what was typed and how to quote it."""
    overrides = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set: expected KEY=VALUE, e.g. --set training.epochs=2, got {item!r}")
        overrides[key.strip()] = _set_value(key.strip(), raw)
    return overrides


def _set_value(key: str, raw: str):
    shown = raw if raw.isprintable() else repr(raw)  # a tab or a newline shown as such
    try:
        value = yaml.safe_load(raw)
        comment = _comment(raw)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"--set {key}: cannot read {shown} as YAML ({problem}); {_quoted(key, raw)}") from None
    if comment:
        raise ConfigError(f"--set {key}: YAML reads {comment} in {shown} as a comment; {_quoted(key, raw)}")
    if isinstance(value, dict) and not raw.lstrip().startswith("{"):
        raise ConfigError(f"--set {key}: YAML reads {shown} as a mapping (a ': ' inside); {_quoted(key, raw)}, "
                          f"or write a mapping as {{key: value}}")
    return value


def _comment(raw: str) -> str:
    """The first comment in ``raw`` (a ``#`` between YAML's tokens, which it drops), or ""."""
    end = 0
    for token in yaml.scan(raw):
        gap = raw[end:token.start_mark.index]
        if "#" in gap:
            return gap[gap.index("#"):].splitlines()[0].strip()
        end = max(end, token.end_mark.index)
    return ""


def _quoted(key: str, raw: str) -> str:
    """How to type ``raw`` so that YAML reads it as typed: each item of a list, or the value, in double quotes."""
    text = raw.strip()
    if text.startswith("[") and text.endswith("]"):
        items = ", ".join(json.dumps(item.strip(), ensure_ascii=False) for item in text[1:-1].split(","))
        return f"quote each item holding ?, &, :, # or * inside the list: --set {shlex.quote(f'{key}=[{items}]')}"
    return f"quote the value: --set {shlex.quote(f'{key}={json.dumps(text, ensure_ascii=False)}')}"
