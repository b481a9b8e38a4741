"""Names of a deployment's detached actors, by which a restarted control plane finds them.

With a control plane apart (cluster/control_plane.py), workers and front doors are detached
actors that no process owns; each is named after the deployment and what it is, so that a
control plane started again under the same deployment id can list and take them over.
"""

from __future__ import annotations

import uuid

import ray


def actor_name(deployment_id: str, name: str) -> str:
    """A detached actor's name: the deployment, what it is, and a unique part (a replacement
    is created while its predecessor's name may still be taken)."""
    return f"{deployment_id}/{name}/{uuid.uuid4().hex[:8]}"


def named_actors(deployment_id: str, name_prefix: str = "") -> list[str]:
    """The names of the deployment's running actors (whose names start with ``name_prefix``
    after the deployment's id), in name order."""
    prefix = f"{deployment_id}/{name_prefix}"
    return sorted(name for name in ray.util.list_named_actors() if name.startswith(prefix))
