"""What the prefix cache saved: prompt tokens the engines did not compute, the engine time and
GPU-seconds that is, and its money value (docs/operators.md, "Savings").

Inputs, all measured: the engine-reported ``usage.prompt_tokens_details.cached_tokens`` of every
answered request (the figure the prediction audit reads), and each replica's prefill speed,
estimated from the same requests: the least-squares slope of time to first token against the
tokens the engine had to compute (``prompt - cached``), so queueing and network time (the
intercept) are not counted as prefill. Prices come from ``operator.prices`` (or the dated
``PUBLISHED_PRICES``) and are applied when the report is read, so a reload reprices everything.

Formulas (per tenant, model and replica; summed in the report):
* saved_prefill_tokens = sum(cached_tokens)
* saved_engine_s = saved_prefill_tokens * prefill_s_per_token(replica)
* saved_gpu_s = saved_engine_s * operator.gpus_per_replica
* cost_usd = (prompt - cached) * input / 1e6 + cached * cached_input / 1e6
* saved_usd = cached * (input - cached_input) / 1e6   (what the same tokens cost uncached, less cost)

Bounded: ``max_tenants`` tenants are counted apart, later ones as ``other``; replicas and models
are the fleet's. Single writer: ``record`` on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.operator_config import OperatorConfig
from gateway.request_outcome import OTHER_TENANT, Outcome

MIN_SPEED_SAMPLES = 8
SPEED_DECAY = 0.999  # per sample: the estimate follows a replica whose speed changes


@dataclass(slots=True)
class PrefillSpeed:
    """Running least squares of ttft (s) on computed prompt tokens, exponentially weighted."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    samples: int = 0

    def add(self, computed_tokens: int, ttft_s: float) -> None:
        d = SPEED_DECAY
        x, y = float(computed_tokens), ttft_s
        self.n = self.n * d + 1
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y
        self.samples += 1

    def seconds_per_token(self) -> float | None:
        """The slope, or None before ``MIN_SPEED_SAMPLES`` or without spread in prompt sizes."""
        if self.samples < MIN_SPEED_SAMPLES:
            return None
        den = self.n * self.sxx - self.sx * self.sx
        if den <= 1e-9 * max(1.0, self.n * self.sxx):
            return None
        return max(0.0, (self.n * self.sxy - self.sx * self.sy) / den)


@dataclass(slots=True)
class Tally:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


Key = tuple[str, str, str]  # tenant, model, replica


class SavingsLedger:
    def __init__(self, cfg: OperatorConfig) -> None:
        self.cfg = cfg  # replaced on reload (prices, tenant bound)
        self._tallies: dict[Key, Tally] = {}
        self._tenants: set[str] = set()
        self._speeds: dict[str, PrefillSpeed] = {}
        self.unreported = 0  # answered requests whose engine gave no usage (not counted)

    def tenant(self, name: str) -> str:
        """``name`` while fewer than ``max_tenants`` are counted apart, else ``other``."""
        if name in self._tenants:
            return name
        if len(self._tenants) < self.cfg.max_tenants:
            self._tenants.add(name)
            return name
        return OTHER_TENANT

    def record(self, o: Outcome) -> None:
        if o.cached_tokens is None:
            self.unreported += 1
            return
        key = (self.tenant(o.tenant), o.model, o.replica)
        t = self._tallies.get(key)
        if t is None:
            t = self._tallies[key] = Tally()
        t.requests += 1
        t.prompt_tokens += o.prompt_tokens
        t.cached_tokens += o.cached_tokens
        if o.ttft_s is not None:
            speed = self._speeds.get(o.replica)
            if speed is None:
                speed = self._speeds[o.replica] = PrefillSpeed()
            speed.add(o.prompt_tokens - o.cached_tokens, o.ttft_s)

    def prefill_s_per_token(self) -> dict[str, float | None]:
        return {rid: s.seconds_per_token() for rid, s in sorted(self._speeds.items())}

    def by_replica(self) -> dict[str, dict[str, Any]]:
        """Per replica: the engine-counted hit rate of the requests it answered."""
        out: dict[str, dict[str, Any]] = {}
        for (_, _, replica), t in sorted(self._tallies.items()):
            row = out.setdefault(replica, {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0})
            row["requests"] += t.requests
            row["prompt_tokens"] += t.prompt_tokens
            row["cached_tokens"] += t.cached_tokens
        for row in out.values():
            row["hit_rate"] = _hit_rate(row["cached_tokens"], row["prompt_tokens"])
        return out

    def rows(self) -> list[dict[str, Any]]:
        """Per (tenant, model): tokens, time and money (see the module docstring)."""
        speeds = self.prefill_s_per_token()
        gpus = self.cfg.gpus_per_replica
        out: dict[tuple[str, str], dict[str, Any]] = {}
        for (tenant, model, replica), t in sorted(self._tallies.items()):
            row = out.get((tenant, model))
            if row is None:
                row = out[(tenant, model)] = _empty_row(tenant, model)
            row["requests"] += t.requests
            row["prompt_tokens"] += t.prompt_tokens
            row["saved_prefill_tokens"] += t.cached_tokens
            spt = speeds.get(replica)
            if spt is None:
                row["untimed_cached_tokens"] += t.cached_tokens
            else:
                row["saved_engine_s"] += t.cached_tokens * spt
        for row in out.values():
            row["saved_gpu_s"] = row["saved_engine_s"] * gpus
            row["hit_rate"] = _hit_rate(row["saved_prefill_tokens"], row["prompt_tokens"])
            self._price(row)
        return list(out.values())

    def _price(self, row: dict[str, Any]) -> None:
        price = self.cfg.price_of(row["model"])
        if price is None:
            row.update(cost_usd=None, uncached_cost_usd=None, saved_usd=None, price=None)
            return
        cached, fresh = row["saved_prefill_tokens"], row["prompt_tokens"] - row["saved_prefill_tokens"]
        row["cost_usd"] = (fresh * price.input + cached * price.cached_input) / 1e6
        row["uncached_cost_usd"] = (fresh + cached) * price.input / 1e6
        row["saved_usd"] = cached * (price.input - price.cached_input) / 1e6
        row["price"] = {"input": price.input, "cached_input": price.cached_input, "source": price.source}

    def totals(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        keys = ("requests", "prompt_tokens", "saved_prefill_tokens", "saved_engine_s", "saved_gpu_s")
        tot: dict[str, Any] = {k: sum(r[k] for r in rows) for k in keys}
        priced = [r for r in rows if r["saved_usd"] is not None]
        tot["saved_usd"] = sum(r["saved_usd"] for r in priced)
        tot["cost_usd"] = sum(r["cost_usd"] for r in priced)
        tot["unpriced_models"] = sorted({r["model"] for r in rows if r["saved_usd"] is None})
        tot["hit_rate"] = _hit_rate(tot["saved_prefill_tokens"], tot["prompt_tokens"])
        tot["requests_without_usage"] = self.unreported
        return tot


def _hit_rate(cached: int, prompt: int) -> float:
    return cached / prompt if prompt else 0.0


def _empty_row(tenant: str, model: str) -> dict[str, Any]:
    return {
        "tenant": tenant,
        "model": model,
        "requests": 0,
        "prompt_tokens": 0,
        "saved_prefill_tokens": 0,
        "untimed_cached_tokens": 0,
        "saved_engine_s": 0.0,
    }
