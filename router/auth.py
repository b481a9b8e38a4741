"""Who may call duet, and how much: API keys and per-key quotas, shared by both front ends.

A key is checked in constant time and is never logged or echoed: a caller is known by its key's
*name* from then on. Quotas belong to the key, not to the front end, so a key's requests over
gRPC and over HTTP draw on the same budget:

- ``requests_per_minute``: a token bucket holding up to a minute's worth of requests, refilled
  continuously; an empty bucket answers with the seconds until the next request is allowed;
- ``max_concurrent_requests``: requests of that key in flight at once;
- ``models``: the model names (the served model's, its LoRA adapters') the key may request;
- ``model_quotas``: a rate and an in-flight limit of the key's own for one model name, on top
  of its overall ones (a tenant may send 600 requests a minute, at most 60 of them to the large
  model).

Keys come from a YAML file (one entry per key, each with optional quotas of its own) and from an
environment variable (comma-separated, default quotas), so that secrets can come from a
Kubernetes Secret mounted either way.
"""

from __future__ import annotations

import hmac
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from duet.config import AuthConfig, ConfigError
from duet.yaml_config import read_yaml, validate_mapping


class Unauthenticated(Exception):
    """No key, or one that is not configured (gRPC UNAUTHENTICATED, HTTP 401)."""


class QuotaExceeded(Exception):
    """A key is over one of its quotas (gRPC RESOURCE_EXHAUSTED, HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelNotAllowed(Exception):
    """A key asked for a model it is not allowed (gRPC PERMISSION_DENIED, HTTP 403)."""


class _ModelQuota(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    requests_per_minute: float | None = Field(default=None, gt=0)
    """The key's request rate limit for this model name; null is the key's overall limit only."""
    max_concurrent_requests: int | None = Field(default=None, ge=1)
    """The key's limit on requests in flight for this model name; null is the key's overall
    limit only."""


class _KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(min_length=1)
    """The key's name: it labels the key's metrics and logs (the key itself never appears)."""
    key: SecretStr = Field(min_length=8)
    """The secret the client sends as `Authorization: Bearer KEY` (at least 8 characters)."""
    requests_per_minute: float | None = Field(default=None, gt=0)
    """This key's request rate limit (overrides auth.requests_per_minute); null is unlimited."""
    max_concurrent_requests: int | None = Field(default=None, ge=1)
    """This key's limit on requests in flight (overrides auth.max_concurrent_requests); null is
    unlimited."""
    admin: bool = False
    """May call the Admin service (scale pools, drain workers, load and unload LoRA adapters)."""
    models: list[str] | None = None
    """The model names this key may request: the served model's and its LoRA adapters' (an
    adapter loaded later included, by its name); null: every one."""
    model_quotas: dict[str, _ModelQuota] = {}
    """Quotas of this key for single model names (a served model's or an adapter's), on top of
    its overall ones: a request counts against both."""


class _KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    keys: list[_KeyEntry] = Field(min_length=1)
    """One entry per API key."""


@dataclass
class Quota:
    """One budget of requests: a rate (a token bucket holding a minute's worth, refilled
    continuously) and a number in flight. ``owner`` says whose in refusals."""

    owner: str
    requests_per_minute: float | None
    max_concurrent_requests: int | None
    inflight: int = 0
    _tokens: float = field(default=0.0, repr=False)
    _refilled_at: float = field(default_factory=time.monotonic, repr=False)

    def __post_init__(self) -> None:
        self._tokens = self.requests_per_minute or 0.0

    def check_room(self, count: int = 1) -> None:
        """Raise QuotaExceeded unless ``count`` more requests fit in flight."""
        limit = self.max_concurrent_requests
        if limit is None or self.inflight + count <= limit:
            return
        asked = "a request" if count == 1 else f"{count} requests together"
        raise QuotaExceeded(
            f"{self.owner} has {self.inflight} requests in flight and this call asks for {asked} "
            f"(limit {limit}); retry when one finishes",
            1.0,
        )

    def take_rate_token(self) -> None:
        """Take one request from the rate budget, or raise QuotaExceeded with the wait."""
        if self.requests_per_minute is None:
            return
        now = time.monotonic()
        per_second = self.requests_per_minute / 60.0
        self._tokens = min(self.requests_per_minute, self._tokens + (now - self._refilled_at) * per_second)
        self._refilled_at = now
        if self._tokens < 1.0:
            wait = (1.0 - self._tokens) / per_second
            raise QuotaExceeded(
                f"{self.owner} is over its rate limit of {self.requests_per_minute:g} requests per minute; "
                f"retry in {math.ceil(wait)} s",
                wait,
            )
        self._tokens -= 1.0

    def refund_rate_token(self) -> None:
        """Give back a token taken for a request that another quota then refused."""
        if self.requests_per_minute is not None:
            self._tokens = min(self.requests_per_minute, self._tokens + 1.0)


@dataclass
class Caller:
    """An authenticated key: its name and its quota state (never the key itself)."""

    name: str
    requests_per_minute: float | None
    max_concurrent_requests: int | None
    admin: bool = False
    models: frozenset[str] | None = None  # the model names it may request (None: every one)
    # Quotas for single model names, on top of the key's overall one.
    model_limits: dict[str, tuple[float | None, int | None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.quota = Quota(f"API key {self.name!r}", self.requests_per_minute, self.max_concurrent_requests)
        self.model_quotas = {
            model: Quota(f"API key {self.name!r} for model {model!r}", rate, concurrent)
            for model, (rate, concurrent) in self.model_limits.items()
        }

    @property
    def inflight(self) -> int:
        return self.quota.inflight

    def may_use(self, model: str) -> bool:
        """Whether this key may request model (or adapter) ``model``."""
        return self.models is None or model in self.models

    def check_model(self, model: str) -> None:
        """Raise ModelNotAllowed unless this key may request ``model``."""
        if not self.may_use(model):
            allowed = ", ".join(sorted(self.models or ())) or "none"
            raise ModelNotAllowed(f"API key {self.name!r} may not use model {model!r} (it may use: {allowed})")

    def _quotas(self, model: str) -> list[Quota]:
        model_quota = self.model_quotas.get(model)
        return [self.quota] if model_quota is None else [self.quota, model_quota]

    def check_room(self, model: str, count: int) -> None:
        """Raise QuotaExceeded unless ``count`` more requests for ``model`` fit in flight."""
        for quota in self._quotas(model):
            quota.check_room(count)

    def acquire(self, model: str) -> None:
        """Take one request slot of this key for ``model``; raise QuotaExceeded if the key, or
        its quota for that model, has none left (then nothing is taken).

        Every successful ``acquire`` must be paired with a ``release`` of the same model.
        """
        quotas = self._quotas(model)
        self.check_room(model, 1)
        taken: list[Quota] = []
        try:
            for quota in quotas:
                quota.take_rate_token()
                taken.append(quota)
        except QuotaExceeded:
            for quota in taken:
                quota.refund_rate_token()
            raise
        for quota in quotas:
            quota.inflight += 1

    def release(self, model: str) -> None:
        for quota in self._quotas(model):
            quota.inflight -= 1


# The caller of a deployment without keys (loopback, or explicitly unauthenticated): no quotas,
# and it may operate the pools, as whoever can reach the port could restart duet anyway.
ANONYMOUS = Caller("anonymous", None, None, admin=True)


class Gatekeeper:
    """The configured keys; ``authenticate`` maps a presented bearer token to its Caller."""

    def __init__(self, keys: list[tuple[str, Caller]]) -> None:
        self._keys = [(secret.encode(), caller) for secret, caller in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, token: str | None) -> Caller:
        if not self._keys:
            return ANONYMOUS
        if not token:
            raise Unauthenticated("an API key is required: send it as 'Authorization: Bearer KEY'")
        presented = token.encode()
        found = None
        for secret, caller in self._keys:  # every key compared: the time taken says nothing
            if hmac.compare_digest(secret, presented):
                found = caller
        if found is None:
            raise Unauthenticated("the API key is not valid")
        return found

    def caller(self, name: str) -> Caller | None:
        """The caller of the key named ``name`` (None if no key has that name now): a batch
        job runs as the key that created it, whichever front door runs it."""
        if not self._keys:
            return ANONYMOUS if name == ANONYMOUS.name else None
        return next((caller for _, caller in self._keys if caller.name == name), None)

    def authenticate_header(self, authorization: str | None) -> Caller:
        """Authenticate an ``Authorization`` header value (``Bearer KEY``)."""
        token = None
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() != "bearer" or not value.strip():
                raise Unauthenticated("the Authorization header must be 'Bearer KEY'")
            token = value.strip()
        return self.authenticate(token)

    @classmethod
    def from_config(cls, auth: AuthConfig, environ: dict[str, str] | None = None) -> "Gatekeeper":
        """Load keys from ``auth.api_keys_file`` and the ``auth.api_keys_env`` variable."""
        environ = os.environ if environ is None else environ
        keys: list[tuple[str, Caller]] = []
        if auth.api_keys_file:
            path = Path(auth.api_keys_file).expanduser()
            data = read_yaml(path, "API keys file", ConfigError)
            entries = validate_mapping(_KeysFile, data, str(path), ConfigError).keys
            for entry in entries:
                keys.append((entry.key.get_secret_value(), Caller(
                    entry.name,
                    entry.requests_per_minute or auth.requests_per_minute,
                    entry.max_concurrent_requests or auth.max_concurrent_requests,
                    admin=entry.admin,
                    models=frozenset(entry.models) if entry.models is not None else None,
                    model_limits={
                        model: (quota.requests_per_minute, quota.max_concurrent_requests)
                        for model, quota in entry.model_quotas.items()
                    },
                )))
        for index, item in enumerate(filter(None, (part.strip() for part in environ.get(auth.api_keys_env, "").split(",")))):
            name, _, secret = item.rpartition(":")
            keys.append((secret, Caller(name or f"{auth.api_keys_env}[{index}]", auth.requests_per_minute, auth.max_concurrent_requests)))
        names = [caller.name for _, caller in keys]
        duplicate = next((name for name in names if names.count(name) > 1), None)
        if duplicate is not None:
            raise ConfigError(f"API key name {duplicate!r} is used twice; give every key its own name")
        if any(len(secret) < 8 for secret, _ in keys):
            raise ConfigError(f"{auth.api_keys_env}: every API key must be at least 8 characters")
        return cls(keys)
