"""`hf_overrides` (vLLM's engine argument): keys written over the model's Hugging Face config
after config.json is read, before anything is built from it.

As in vLLM, a key's value replaces the config's attribute of that name (a key the config
lacks is added: `classifier_from_token`, `is_original_qwen3_reranker`, `method` are read
by raylm although no config.json holds them), except that a dict whose key names a nested
config (a vision-language model's `text_config`) is merged into it, recursively (dicts
within it merged too). A dict-valued attribute of the top-level config (`rope_scaling`) is
replaced whole, as vLLM replaces it.

Values are checked before they are set, so that a wrong one fails here, naming the key,
rather than deep inside the model's constructor: a key the config already holds must keep
its kind (a number stays a number, an integer an integer (a whole float is taken as one), a flag a flag, a string a
string, a list a list, a dict a dict; None is allowed, as for "no sliding window"), and the
keys raylm reads itself must be what it reads (`architectures` a non-empty list of
strings, `classifier_from_token` a non-empty list of strings, `is_original_qwen3_reranker`
a flag, `method` a string). The model's sizes (hidden_size, num_hidden_layers,
max_position_embeddings, ...) must be positive integers; a key must be a setting (not a
private attribute or a method of the config class); and a nested config key
(`text_config`) the model's config lacks is refused rather than set as a plain dict.
"""

from __future__ import annotations

import json
from typing import Any

# Keys raylm reads that config.json rarely holds, and the kind each must be.
_READ_KEYS: dict[str, tuple[type, str]] = {
    "architectures": (list, "a non-empty list of architecture names"),
    "classifier_from_token": (list, "a non-empty list of token strings"),
    "is_original_qwen3_reranker": (bool, "true or false"),
    "method": (str, "a string"),
}

# The model's shape: each must stay a positive integer, or the model's constructor fails
# far from the key (a negative dimension, a division by zero) or allocates nothing sensible.
_SIZE_KEYS = frozenset({"hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                        "num_hidden_layers", "vocab_size", "max_position_embeddings", "head_dim"})

# Nested configs that transformers' get_text_config() and raylm's multi-modal models read
# as config objects: a dict set where the model has none would be read as one and fail.
_NESTED_CONFIG_KEYS = frozenset({"text_config", "vision_config", "audio_config", "decoder", "encoder",
                                 "language_config"})


def parse_hf_overrides(value: dict[str, Any] | str | None) -> dict[str, Any]:
    """hf_overrides as a dict: a dict, a JSON object string (the command line's), or None (none)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"hf_overrides must be a JSON object, got {value!r} ({error}).") from None
    if not isinstance(value, dict):
        raise ValueError(f"hf_overrides must be a dict (a JSON object on the command line) of config keys, got "
                         f"{value!r}.")
    return value


def apply_hf_overrides(hf_config: Any, overrides: dict[str, Any] | str | None) -> None:
    """Writes `overrides` over `hf_config` in place (see the module's docstring); a
    ValueError names the first key that cannot be applied, its value and what is allowed."""
    overrides = parse_hf_overrides(overrides)
    _check_read_keys(overrides)
    for key, value in overrides.items():
        _check_attribute_name(hf_config, key, f"hf_overrides[{key!r}]")
        current = getattr(hf_config, key, None)
        if _is_nested_config(current):
            if not isinstance(value, dict):
                raise ValueError(f"hf_overrides[{key!r}] names a nested config: give a JSON object of its keys to "
                                 f"merge into it, got {value!r}.")
            _merge(current, value, f"hf_overrides[{key!r}]")
        elif key in _NESTED_CONFIG_KEYS and current is None:
            raise ValueError(f"hf_overrides[{key!r}] names a nested config the model's config "
                             f"({type(hf_config).__name__}) does not have: give its keys at the top level of "
                             f"hf_overrides, got {value!r}.")
        else:
            setattr(hf_config, key, _checked(current, value, f"hf_overrides[{key!r}]"))


def _is_nested_config(value: Any) -> bool:
    from transformers import PretrainedConfig

    return isinstance(value, PretrainedConfig)


def _merge(target: Any, updates: dict[str, Any], where: str) -> None:
    """vLLM's nested update: a dict value merges into the dict or object it names, any other
    value (or a dict where there is none) is set."""
    if not all(isinstance(key, str) for key in updates):
        raise ValueError(f"{where} must have string keys, got {list(updates)!r}.")
    for key, value in updates.items():
        if not isinstance(target, dict):
            _check_attribute_name(target, key, f"{where}[{key!r}]")
        current = target.get(key) if isinstance(target, dict) else getattr(target, key, None)
        if isinstance(value, dict) and (isinstance(current, dict) or hasattr(current, "__dict__")):
            _merge(current, value, f"{where}[{key!r}]")
            continue
        value = _checked(current, value, f"{where}[{key!r}]")
        if isinstance(target, dict):
            target[key] = value
        else:
            setattr(target, key, value)


def _check_attribute_name(config: Any, key: str, where: str) -> None:
    """A key is a config setting: not a private or dunder attribute (`__dict__` would replace
    every setting at once, `__class__` the config's type), nor one of the config class's
    methods or read-only properties (`to_dict`, `get_text_config`), which transformers and
    raylm call. A property with a setter (transformers' `num_labels`) is a setting."""
    declared = getattr(type(config), key, None)
    if key.startswith("_"):
        what = "a private attribute"
    elif isinstance(declared, property):
        what = "a read-only property" if declared.fset is None else None
    else:
        what = "a method" if callable(declared) else None
    if what is not None:
        raise ValueError(f"{where} names {what} of the model's config ({type(config).__name__}), not a setting: "
                         f"give config.json keys.")


def _check_read_keys(overrides: dict[str, Any]) -> None:
    if not all(isinstance(key, str) for key in overrides):
        raise ValueError(f"hf_overrides must have string keys (config attribute names), got {list(overrides)!r}.")
    for key, (kind, allowed) in _READ_KEYS.items():
        if key not in overrides:
            continue
        value = overrides[key]
        valid = isinstance(value, kind) and (kind is not list or (value and all(isinstance(v, str) for v in value)))
        if not valid:
            raise ValueError(f"hf_overrides[{key!r}] must be {allowed}, got {value!r}.")


def _checked(current: Any, value: Any, where: str) -> Any:
    """`value`, to replace `current`, once checked to keep its kind (None either way is
    allowed) and, for a size of the model, to be a positive integer. A whole float where the
    config holds an integer is taken as that integer (JSON's `1e6` is a float, and some
    configs write `rope_theta: 1000000`); an integer where it holds a float as that float
    (transformers' configs type-check their float fields)."""
    value = _kept_kind(current, value, where)
    key = where.rsplit("[", 1)[-1].strip("]'\"")
    if key in _SIZE_KEYS and value is not None and not _is_positive_integer(value):
        raise ValueError(f"{where} must be a positive integer (a size of the model), got {value!r}.")
    if key in _SIZE_KEYS and isinstance(value, float):
        return int(value)  # JSON's 1e6 where the config had no value to keep the kind of
    return value


def _kept_kind(current: Any, value: Any, where: str) -> Any:
    if current is None or value is None:
        return value
    kind = _kind(current)
    if kind == "integer" and _kind(value) == "number" and value.is_integer():
        return int(value)
    if kind == "number" and _kind(value) == "integer":
        return float(value)
    if kind is not None and _kind(value) != kind:
        raise ValueError(f"{where} must be {_KIND_NAMES[kind]}, as the model's config holds {current!r}; got "
                         f"{value!r}.")
    return value


def _is_positive_integer(value: Any) -> bool:
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return whole and not isinstance(value, bool) and value >= 1


_KIND_NAMES = {"flag": "true or false", "integer": "an integer", "number": "a number", "string": "a string",
               "list": "a list", "dict": "a JSON object"}


def _kind(value: Any) -> str | None:
    if isinstance(value, bool):
        return "flag"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, dict):
        return "dict"
    return None
