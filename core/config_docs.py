"""The config reference (``cpr config-docs``): a markdown table of every field with its type,
default, allowed range and the docstring written under it."""

from __future__ import annotations

from pydantic import BaseModel

from core.config import RunConfig

__all__ = ["config_reference"]


def _allowed(info) -> str:
    parts = []
    for m in info.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            v = getattr(m, attr, None)
            if v is not None:
                parts.append(f"{sym} {v}")
    return ", ".join(parts)


def config_reference() -> str:
    """The config reference as a markdown table, from the models' field docstrings."""
    rows = ["| field | type | default | allowed | meaning |", "|---|---|---|---|---|"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            ann = info.annotation
            sub = next(
                (a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)),
                None,
            )
            if sub is not None:
                doc = (sub.__doc__ or "").strip().splitlines()[0]
                rows.append(f"| **{prefix}{name}** | section | | | {doc} |")
                walk(sub, f"{prefix}{name}.")
                continue
            type_s = str(ann).replace("typing.", "").replace("<class '", "").replace("'>", "").replace("|", "\\|")
            default = ("required" if info.is_required() else "computed" if info.default_factory is not None
                       else repr(info.default))
            desc = " ".join((info.description or "").split())
            rows.append(f"| `{prefix}{name}` | `{type_s}` | `{default}` | {_allowed(info)} | {desc} |")

    walk(RunConfig, "")
    return "\n".join(rows)
