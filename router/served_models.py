"""Which model's serving path a request goes to, by the model name it asks for.

A deployment may serve several models (``models:`` in the config), each with its own pools,
tokenizer, limits and adapters (its own :class:`RequestService`); the front ends share one set
of ports, keys, admission limit and accounting (one Gatekeeper, one ClusterView) and hand each
request to the service of the model it names.
"""

from __future__ import annotations

from duet.router.serving import RequestService
from duet.router.validation import UnknownModel


class ModelChangeError(Exception):
    """A model could not be added or removed. ``kind``: "invalid" (what was asked: a bad config,
    a name taken or not served), "unavailable" (its workers could not start)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ServedModels:
    def __init__(self, services: list[RequestService]) -> None:
        self.services = services
        self.default = services[0]  # what a request that names no model gets

    def for_model(self, name: object) -> RequestService:
        """The service of the model (or LoRA adapter) ``name``; the default one for no name,
        or for a name no model serves when only one is served (its validation then refuses it
        as vLLM's server does); UnknownModel naming every served model otherwise."""
        if not name or len(self.services) == 1:
            return self.default
        for service in self.services:
            if name in service.limits.served_names():
                return service
        bases = ", ".join(service.limits.name for service in self.services)
        raise UnknownModel(str(name), bases, self.names())

    def is_ready(self) -> bool:
        """Whether every served model would be served now (a model being added is not yet
        among them, so its starting workers do not make the front door unready)."""
        return all(service.is_ready() for service in self.services)

    def names(self) -> list[str]:
        """Every model name served: each model's, then its adapters'."""
        return [name for service in self.services for name in service.limits.served_names()]
