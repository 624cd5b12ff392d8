"""Environments for multi-turn (agentic) rollouts: the interface, the registry and the built-ins."""

from streamrft.envs.base import (
    OBSERVATION_ROLES,
    EnvStep,
    Environment,
    EnvSpecError,
    load_environment,
    register_environment,
    registered_environments,
)

__all__ = [
    "OBSERVATION_ROLES",
    "EnvStep",
    "Environment",
    "EnvSpecError",
    "load_environment",
    "register_environment",
    "registered_environments",
]
