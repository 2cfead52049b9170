"""Reading a YAML config file: a SafeLoader that refuses duplicate keys, and errors that say where the file is
wrong (ConfigError, which gateway/config.py raises for every invalid value too)."""
from __future__ import annotations

import typing
from typing import Any

import yaml


class ConfigError(ValueError):
    """An invalid config file or flag; the message names the file, the key path and the reason."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if not isinstance(key, typing.Hashable):
            continue  # construct_mapping reports it
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.load(f, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the config file {path}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(f"{path}: {where}invalid YAML: {getattr(e, 'problem', None) or e}") from None
