"""Policies by name, with typed and validated parameters.

``build_policy("kv_aware", {"balance_abs": 16}, seed=1)`` validates the parameters against the
policy's pydantic model (unknown or ill-typed fields raise ``PolicyConfigError`` naming the field)
and returns a fresh policy object. A name of the form ``package.module:attr`` loads an out-of-tree
policy: ``attr`` must be a class with a ``Params`` pydantic model and a ``(params, seed)`` init.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, NamedTuple

from pydantic import BaseModel, ValidationError

from router_policies.errors import UserInputError
from router_policies.policies.consistent_hash import ConsistentHash, ConsistentHashParams
from router_policies.policies.kv_aware import KvAware
from router_policies.policies.kv_aware_params import KvAwareParams
from router_policies.policies.least_loaded import LeastLoaded, LeastLoadedParams
from router_policies.policies.round_robin import RoundRobin, RoundRobinParams
from router_policies.policy import Policy


class PolicyConfigError(UserInputError):
    """A policy name or parameter is invalid; the message names it."""


class PolicyEntry(NamedTuple):
    params: type[BaseModel]
    factory: Any  # (params, seed) -> Policy


BUILTIN_POLICIES: Mapping[str, PolicyEntry] = {
    "round_robin": PolicyEntry(RoundRobinParams, RoundRobin),
    "least_loaded": PolicyEntry(LeastLoadedParams, LeastLoaded),
    "consistent_hash": PolicyEntry(ConsistentHashParams, ConsistentHash),
    "kv_aware": PolicyEntry(KvAwareParams, KvAware),
}


def format_validation_error(err: ValidationError, prefix: str) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in (prefix, *e["loc"]) if x != "")
        msg = e["msg"].removeprefix("Value error, ")
        head, sep, rest = msg.partition(": ")
        if sep and " " not in head:
            # a nested validator already named its sub-path: join it onto ours
            loc, msg = f"{loc}.{head}" if loc else head, rest
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def policy_entry(name: str) -> PolicyEntry:
    if name in BUILTIN_POLICIES:
        return BUILTIN_POLICIES[name]
    if ":" in name:
        mod_name, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as exc:
            raise PolicyConfigError(f"policy {name!r} cannot be loaded: {exc}") from None
        params = getattr(cls, "Params", None)
        if not (isinstance(params, type) and issubclass(params, BaseModel)):
            raise PolicyConfigError(f"policy {name!r} has no pydantic Params model")
        return PolicyEntry(params, cls)
    known = ", ".join(sorted(BUILTIN_POLICIES))
    raise PolicyConfigError(f"unknown policy {name!r} (known: {known}, or module:attr)")


def validate_params(name: str, params: Mapping[str, Any] | None, path: str = "") -> BaseModel:
    entry = policy_entry(name)
    try:
        return entry.params.model_validate(dict(params or {}))
    except ValidationError as exc:
        raise PolicyConfigError(format_validation_error(exc, path or name)) from None


def build_policy(name: str, params: Mapping[str, Any] | BaseModel | None = None, seed: int = 0) -> Policy:
    entry = policy_entry(name)
    model = params if isinstance(params, BaseModel) else validate_params(name, params)
    policy: Policy = entry.factory(model, seed)
    return policy
