"""Built-in environments small enough to reason about in tests and docs.

``scripted``: answers a fixed list of observations, one per model turn, then ends the episode; the
per-turn rewards are given alongside. It is what the acceptance tests drive through the real model: the
episode's shape is known in advance, so token ids, masks and rewards can be checked exactly.

``echo``: answers every model turn with that turn's text (as role ``user``) until ``turns`` model turns
have been made; the per-turn reward is 1.0 when the turn contains ``target`` (if given).
"""

from __future__ import annotations

from streamrft.envs.base import OBSERVATION_ROLES, EnvStep, register_environment


def _check_role(role: str, env: str) -> str:
    if role not in OBSERVATION_ROLES:
        raise ValueError(f"env.kwargs.role for {env!r} is {role!r}; expected one of {list(OBSERVATION_ROLES)}")
    return role


@register_environment("scripted")
class ScriptedEnvironment:
    """Observation ``observations[i]`` after model turn i; done after the last (or when the list is empty)."""

    def __init__(self, observations: list[str] | None = None, rewards: list[float] | None = None,
                 role: str = "tool", greeting: str | None = None) -> None:
        self.observations = list(observations or [])
        self.rewards = [float(r) for r in (rewards or [])]
        if self.rewards and len(self.rewards) != len(self.observations) + 1:
            raise ValueError(
                f"env.kwargs.rewards for 'scripted' has {len(self.rewards)} value(s); expected one per model turn "
                f"({len(self.observations) + 1} = len(observations) + 1)"
            )
        self.role = _check_role(role, "scripted")
        self.observation_roles = (self.role,)  # checked against the chat template before the run (validate_env)
        self.greeting = greeting
        self.actions: list[str] = []
        self.closed = False

    async def reset(self, row: dict) -> str | None:
        self.actions = []
        return self.greeting

    async def step(self, action: str) -> EnvStep:
        turn = len(self.actions)
        self.actions.append(action)
        reward = self.rewards[turn] if self.rewards else 0.0
        if turn >= len(self.observations):
            return EnvStep(observation=None, reward=reward, done=True, role=self.role)
        return EnvStep(observation=self.observations[turn], reward=reward, done=False, role=self.role,
                       info={"tool_calls": 1 if self.role == "tool" else 0, "tool_errors": 0, "tool_seconds": 0.0})

    async def close(self) -> None:
        self.closed = True


@register_environment("echo")
class EchoEnvironment:
    """Repeats the model's turn back (role user) for ``turns`` model turns."""

    def __init__(self, turns: int = 2, target: str = "") -> None:
        if int(turns) < 1:
            raise ValueError(f"env.kwargs.turns for 'echo' is {turns}; it must be >= 1")
        self.turns = int(turns)
        self.target = target
        self.count = 0
        self.observation_roles = ("user",)

    async def reset(self, row: dict) -> str | None:
        self.count = 0
        return None

    async def step(self, action: str) -> EnvStep:
        self.count += 1
        reward = 1.0 if self.target and self.target in action else 0.0
        if self.count >= self.turns:
            return EnvStep(observation=None, reward=reward, done=True, role="user")
        return EnvStep(observation=f"You said: {action.strip()}", reward=reward, role="user")

    async def close(self) -> None:
        return None
