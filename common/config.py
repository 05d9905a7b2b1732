"""Load one service's frozen config from a YAML file plus environment overrides.

The YAML file has one section per service (`gateway`, `encoder`, `engine`) and
top-level keys shared by all of them (`model`). An environment variable
`PRISM_<SECTION>__<KEY>` (or `PRISM_<KEY>` for a shared key) overrides the
file; its value is parsed as YAML, so `PRISM_ENGINE__MAX_MODEL_LEN=2048` is an
int, except for a key that takes a string, which keeps the value as written
(`PRISM_GATEWAY__HOST=::`, a key with `#` in it). Validation errors name the
offending key, e.g. `engine.max_model_len`, or the variable.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import ClassVar, TypeVar

import pydantic
import yaml

ENV_PREFIX = "PRISM_"
SHARED_KEYS = ("model",)
SECTIONS = ("gateway", "encoder", "engine")
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "cpu-demo.yaml"

C = TypeVar("C", bound=pydantic.BaseModel)


class ConfigError(ValueError):
    pass


# A service's exit status when it refused its configuration (sysexits' EX_CONFIG): a
# supervisor does not restart it, since the same config would be refused again.
EXIT_CONFIG = 78


def exit_on_config_error(start: Callable[[], object]) -> object:
    """`start()`'s result, or the process exits with EXIT_CONFIG and the error, naming its key,
    in the log: a bad value found only as the service starts (a parser vLLM does not have)."""
    try:
        return start()
    except ConfigError as exc:
        logging.getLogger("prism").error("refused its configuration: %s", exc)
        logging.shutdown()
        os._exit(EXIT_CONFIG)  # its threads (vLLM's, torch's) must not hold the exit up


class FrozenConfig(pydantic.BaseModel):
    """Base of every service config: immutable, unknown keys rejected, and no infinite or NaN
    number (`.inf` as a drain timeout would make a stop wait for ever)."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    # Keys that were removed → why, and what stands in their place: a config
    # that still sets one fails saying so, not as an unknown key.
    removed_keys: ClassVar[dict[str, str]] = {}

    @pydantic.model_validator(mode="before")
    @classmethod
    def _no_removed_keys(cls, values):
        if isinstance(values, Mapping):
            for key in sorted(cls.removed_keys.keys() & values.keys()):
                raise ValueError(f"{key} was removed ({cls.removed_keys[key]}); delete it from the config")
        return values


def check_redis_url(url: str | None) -> str | None:
    """A shared-tier URL (encoder.shared_cache_url, engine.shared_cache_url), or None."""
    if url and not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("shared_cache_url must be a redis://, rediss:// or unix:// URL")
    return url


def _env_overrides(model: type[pydantic.BaseModel], section: str, env: Mapping[str, str]) -> dict[str, object]:
    values: dict[str, object] = {}
    for key in SHARED_KEYS:
        if raw := env.get(name := f"{ENV_PREFIX}{key.upper()}"):  # empty: unset (_model_variable)
            values[key] = _env_value(name, raw, model.model_fields.get(key))
    prefix = f"{ENV_PREFIX}{section.upper()}__"
    for name, raw in env.items():
        if name.startswith(prefix):
            key = name[len(prefix) :].lower()
            values[key] = _env_value(name, raw, model.model_fields.get(key))
    return values


def _env_value(name: str, raw: str, field: pydantic.fields.FieldInfo | None) -> object:
    """A variable's value as YAML reads it; a string key's as written (YAML would make `::` a
    mapping, `2024` a number, and cut `abc #1` at its comment), but null stays null, and so
    does an empty value where the key may be null (`${VAR:-}` in a compose file: unset)."""
    nulls = ("null", "~", "") if field is not None and field.annotation == str | None else ("null", "~")
    if field is not None and field.annotation in (str, str | None) and raw not in nulls:
        return raw
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        problem = str(exc).splitlines()[0]
        raise ConfigError(f"{name}: not a YAML value ({problem}); quote the parts that are strings, e.g. '[\"@key\"]'") from None


# What Kubernetes sets in every pod for a Service named prism-gateway (PRISM_GATEWAY_PORT=tcp://10.0.0.1:8000).
_SERVICE_LINK = re.compile(r"(tcp|udp|sctp)://")


def _check_env_spelling(model: type[pydantic.BaseModel], section: str, env: Mapping[str, str]) -> None:
    """A key set with one underscore after the section (PRISM_GATEWAY_API_KEYS) is read by no one:
    refused, or a deployment would run without the setting it believes it has."""
    prefix = f"{ENV_PREFIX}{section.upper()}_"
    for name, value in env.items():
        key = name[len(prefix):].lower()
        if name.startswith(prefix) and not key.startswith("_") and key in model.model_fields and not _SERVICE_LINK.match(value):
            raise ConfigError(f"{name} is not read: {section}.{key} is set as {prefix}_{key.upper()} (two underscores)")


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error: the
    later one would win and the earlier be dropped, unseen."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"{key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path) -> dict:
    """The file's sections, each a mapping; a key other than a section or a shared key is
    refused (a misspelt `engin:` would otherwise leave the engine at its defaults)."""
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of sections")
    if unknown := sorted(str(key) for key in data.keys() - {*SECTIONS, *SHARED_KEYS}):
        raise ConfigError(f"invalid config {path}: {', '.join(unknown)}: not a section ({', '.join(SECTIONS)}) "
                          f"nor a shared key ({', '.join(SHARED_KEYS)})")
    for section in SECTIONS:
        if data.get(section) is not None and not isinstance(data[section], dict):
            raise ConfigError(f"invalid config {path}: {section}: must be a mapping of keys")
    return data


def resolve_model(model: str) -> str:
    """A relative checkpoint path is taken from the repo root; anything else
    (absolute path, hub id) is returned as it is."""
    path = Path(model)
    if not model:  # refused by the services' configs, not taken for the repo root
        return model
    if not path.is_absolute() and (path.parts[:1] == ("models",) or (REPO_ROOT / path).exists()):
        return str(REPO_ROOT / path)
    return model


def configured_model(path: Path | None = None, env: Mapping[str, str] | None = None) -> str:
    """The checkpoint every service of the file serves unless its section says
    otherwise: the top-level `model`, or PRISM_MODEL (what the launcher starts)."""
    path = path or Path(os.environ.get(f"{ENV_PREFIX}CONFIG", DEFAULT_CONFIG))
    env = os.environ if env is None else env
    if name := _model_variable(env):
        model, where = env[name], name  # as load_config reads it: a string key's value as written
    else:
        model, where = _read_yaml(path).get("model"), f"invalid config {path}: model"
    if not isinstance(model, str) or not model:
        raise ConfigError(f"{where}: a checkpoint directory or hub id is needed")
    return resolve_model(model)


def _model_variable(env: Mapping[str, str]) -> str | None:
    """PRISM_MODEL where it is set to something: empty (`${PRISM_MODEL:-}` in a compose file)
    is unset, as for every key that may be null, so the file's model stands."""
    name = f"{ENV_PREFIX}MODEL"
    return name if env.get(name) else None


# Validation context for a health probe: it needs only where the service listens, and must answer
# within its timeout, so checks that import vLLM or torch are skipped (`probing`).
PROBE = {"probe": True}


def probing(info: pydantic.ValidationInfo) -> bool:
    return bool(info.context and info.context.get("probe"))


def load_config(
    model: type[C], section: str, path: Path | None = None, env: Mapping[str, str] | None = None,
    context: dict | None = None,
) -> C:
    path = path or Path(os.environ.get(f"{ENV_PREFIX}CONFIG", DEFAULT_CONFIG))
    data = _read_yaml(path)
    values = dict(data.get(section) or {})
    for key in SHARED_KEYS:
        if key in data and key in model.model_fields:
            values.setdefault(key, data[key])
    env = os.environ if env is None else env
    _check_env_spelling(model, section, env)
    overrides = _env_overrides(model, section, env)
    values.update({k: v for k, v in overrides.items() if k in model.model_fields or k not in SHARED_KEYS})
    if isinstance(values.get("model"), str):
        values["model"] = resolve_model(values["model"])
    try:
        return model.model_validate(values, context=context)
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join((section, *(str(p) for p in err['loc'])))}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid config {path}: {problems}") from None
