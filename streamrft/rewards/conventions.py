"""Calling conventions of reward functions written for other frameworks, one adapter each.

``reward.sources[].convention`` picks how a custom function is called and how its return value is read.
Every adapter maps a batch of :class:`protocols.RewardItem` to the function's own arguments, and its
return value back to one entry per item: a float, an :class:`Exception` (that item failed, the message
names source, convention and what was wrong), or :data:`NOT_APPLICABLE`.

=========  =====================================================  ==========================================
convention  call                                                   return value
=========  =====================================================  ==========================================
streamrft  ``fn(response, reference, prompt=, label=, images=)``   float (see streamrft.rewards.custom)
trl        ``fn(prompts=[...], completions=[...], **columns)``     list of float or None, one per completion
           (TRL GRPOTrainer: batched, every argument a keyword)
verl       ``compute_score(data_source=, solution_str=,            float, or a dict with ``score`` (other
           ground_truth=, extra_info=)`` per sample                numeric keys become components)
openrlhf   ``reward_func(queries, prompts, labels)`` batched       tensor / list, or a dict with ``rewards``
=========  =====================================================  ==========================================

How StreamRFT's fields map onto theirs (a RewardItem carries prompt, response, reference, label and
``columns``: the data row's other JSON-like fields, see :func:`reward_columns`):

* trl: ``prompts`` the prompt texts, ``completions`` the responses. A row whose prompt is a list of messages
  is conversational, as in TRL: ``prompts[i]`` is that message list (the row's own, as the dataset has it)
  and ``completions[i]`` is ``[{"role": "assistant", "content": response}]``; the messages reach the
  function through the item's ``columns["prompt"]`` (:func:`reward_columns`), so a remote ``serve-reward``
  sees them too, and are not passed again as a ``prompt`` keyword (TRL passes no ``prompt`` column either).
  The row's columns are the item's
  ``columns`` (one list per column name, None where a row lacks it), plus ``reference`` and ``label``,
  and the reference again under the names TRL's documentation and its own reward functions read a gold
  answer by (``ground_truth``, ``solution``) unless the rows have a column of that name.
  ``completion_ids`` and ``trainer_state`` are not available (a function that requires one is refused
  when the source is built); a required parameter that is no column of the rows fails the batch with an
  error naming it and the columns there are. Keywords are passed only when the signature takes them (by
  name or ``**kwargs``). ``None`` for a completion means "this
  function does not apply to it" (TRL's meaning): the item counts as not scored by this source, exactly
  as if the source's ``labels`` excluded it; its component is absent and its weight not added. An item
  no source scores fails ("no reward source scores ...").
* verl: ``data_source`` is the item's label (the key verl's default scorer dispatches on),
  ``solution_str`` the response, ``ground_truth`` the reference, ``extra_info`` the row's ``extra_info``
  column as it is (``{}`` when the row has none), as verl's reward manager passes it. verl's batch reward manager signature (``data_sources, solution_strs, ground_truths,
  extra_infos``, returning a list) is recognised by those plural names and called once per batch.
* openrlhf: ``queries`` are prompt + response (OpenRLHF's queries hold both), ``prompts`` the prompts,
  ``labels`` the references (OpenRLHF's labels are gold answers, not task labels); a dict reply's
  ``scores`` and ``extra_logs`` are not rewards and are not used.

Detection (``convention: auto``): by parameter names only, never by calling the function. ``solution_str``
or ``solution_strs`` -> verl; the first three parameters ``queries, prompts, labels`` -> openrlhf; a
parameter ``completions`` -> trl; none of these -> streamrft. A signature matching two is an error
naming the source. With ``convention: streamrft`` (the default) a signature that is unmistakably
another convention's is an error too, pointing at the key to set, instead of a TypeError per sample.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

from protocols import RewardItem

CONVENTIONS = ("streamrft", "trl", "verl", "openrlhf")


class _NotApplicable:
    """The value of an item a source does not score (TRL's None)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NOT_APPLICABLE"


NOT_APPLICABLE = _NotApplicable()


class ScoredWithExtras(float):
    """A reward plus named side values (verl's extra dict keys), exported as components ``source/key``
    by the scorer; the reward alone enters the weighted aggregate."""

    extras: dict[str, float]

    def __new__(cls, value: float, extras: dict[str, float]):
        obj = super().__new__(cls, value)
        obj.extras = extras
        return obj


def _json_like(value: Any, depth: int = 0) -> bool:
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if depth > 16:
        return False
    if isinstance(value, (list, tuple)):
        return all(_json_like(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_like(v, depth + 1) for k, v in value.items())
    return False


PROMPT_COLUMN = "prompt"  # the column that carries a conversational row's messages (TRL's name for it)


def reward_columns(extra: dict[str, Any], prompt: Any = None) -> dict[str, Any]:
    """The data row's other fields a reward function may read (TRL's extra columns, verl's ``extra_info``):
    the JSON-like ones (text, numbers, bools, null, lists and mappings of these). Media bytes and other
    objects stay behind: they would travel with every sample to every reward source.

    ``prompt``: the row's prompt; when it is a list of messages it is kept under ``"prompt"``, so that the
    trl convention can pass conversational ``prompts`` / ``completions`` (the rendered text alone loses them)."""
    columns = {k: v for k, v in extra.items() if isinstance(k, str) and _json_like(v)}
    if _is_conversation(prompt) and _json_like(prompt):
        columns[PROMPT_COLUMN] = [dict(m) for m in prompt]
    return columns


def _is_conversation(value: Any) -> bool:
    """A prompt given as messages: a non-empty list of {"role": ..., "content": ...} objects."""
    return (isinstance(value, (list, tuple)) and bool(value)
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in value))


class ConventionError(ValueError):
    """A function does not fit its convention (signature) or returned something the convention forbids."""


def _params(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature
        return None


def _has_var_kw(params: list[inspect.Parameter]) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _names(params: list[inspect.Parameter]) -> list[str]:
    return [p.name for p in params if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]


def matching_conventions(fn: Callable[..., Any]) -> list[str]:
    """The foreign conventions ``fn``'s parameter names point to (see the module docstring)."""
    params = _params(fn)
    if params is None:
        return []
    names = _names(params)
    found = []
    if "solution_str" in names or "solution_strs" in names:
        found.append("verl")
    if names[:3] == ["queries", "prompts", "labels"]:
        found.append("openrlhf")
    if "completions" in names:
        found.append("trl")
    return found


def resolve_convention(fn: Callable[..., Any], convention: str, where: str,
                       key: str = "reward.sources[].convention") -> str:
    """The convention ``fn`` is called with; ConventionError (naming ``where``) for an ambiguous
    ``auto`` signature, a default-``streamrft`` source whose signature is another convention's, or a
    signature that cannot take the convention's arguments. ``key``: the setting the errors point at
    (``--convention`` for serve-reward)."""
    if convention not in (*CONVENTIONS, "auto"):
        raise ConventionError(f"{where}: {key.split('[].')[-1] if key.startswith('reward.') else key}="
                              f"{convention!r} is not one of {', '.join(CONVENTIONS)}, auto")
    found = matching_conventions(fn)
    if convention == "auto":
        if len(found) > 1:
            raise ConventionError(
                f"{where}: convention=auto cannot tell {' from '.join(found)} by the signature "
                f"{_signature(fn)}; set {key} to one of them"
            )
        convention = found[0] if found else "streamrft"
    elif convention == "streamrft" and found:
        raise ConventionError(
            f"{where}: the signature {_signature(fn)} is a reward function in the {found[0]} convention, not StreamRFT's "
            f"fn(response, reference, ...); set {key}{' ' if key.startswith('--') else ': '}{found[0]}"
            + (f" (or {', '.join(found[1:])})" if len(found) > 1 else "")
        )
    if convention != "streamrft":
        ADAPTERS[convention].check_signature(fn, where)
    return convention


def _signature(fn: Callable[..., Any]) -> str:
    try:
        return f"{getattr(fn, '__name__', 'fn')}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return repr(fn)


def _number(value: Any, what: str) -> float:
    """A finite-or-not float from a number, a bool, a 0-d tensor / numpy scalar; ConventionError otherwise."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise ConventionError(f"{what} is a {type(value).__name__} {str(value)[:80]!r}, not a number")
    return float(value)


def _as_list(value: Any, what: str) -> list[Any]:
    """A list from a list / tuple / 1-d tensor or array (``.tolist()``, so torch need not be imported)."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()
        if not isinstance(value, list):  # a 0-d tensor: one number for the whole batch
            raise ConventionError(f"{what} is a single number, not one value per sample")
    if not isinstance(value, (list, tuple)):
        raise ConventionError(f"{what} is a {type(value).__name__}, not a list (one value per sample)")
    return list(value)


class _Adapter:
    name = ""
    batched = True
    required: tuple[str, ...] = ()  # parameters the function must accept
    provided: tuple[str, ...] = ()  # every keyword this adapter can pass

    def check_signature(self, fn: Callable[..., Any], where: str) -> None:
        params = _params(fn)
        if params is None:
            return
        names = _names(params)
        var_kw = _has_var_kw(params)
        for name in self.required:
            if name not in names and not var_kw:
                raise ConventionError(
                    f"{where}: a {self.name} reward function takes {', '.join(self.required)}; "
                    f"{_signature(fn)} has no parameter {name!r}"
                )
        for p in params:  # a required argument this convention never passes would fail every call
            if p.default is inspect.Parameter.empty and p.kind in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
            ) and p.name not in self.provided:
                raise ConventionError(
                    f"{where}: {_signature(fn)} requires {p.name!r}, which the {self.name} convention does "
                    f"not pass here; it passes {', '.join(self.provided)}"
                )

    def accepted(self, fn: Callable[..., Any]) -> set[str]:
        params = _params(fn)
        if params is None or _has_var_kw(params):
            return set(self.provided)
        return {n for n in _names(params) if n in self.provided}


class TRLAdapter(_Adapter):
    name = "trl"
    required = ("completions",)
    provided = ("prompts", "completions", "reference", "ground_truth", "solution", "label")
    unavailable = ("completion_ids", "trainer_state")  # TRL passes these; StreamRFT has no equivalent here

    def check_signature(self, fn: Callable[..., Any], where: str) -> None:
        params = _params(fn)
        if params is None:
            return
        if "completions" not in _names(params) and not _has_var_kw(params):
            raise ConventionError(f"{where}: a trl reward function takes completions; {_signature(fn)} has no "
                                  "parameter 'completions'")
        for p in params:  # other required names may be dataset columns: checked per batch
            if p.default is inspect.Parameter.empty and p.name in self.unavailable:
                raise ConventionError(
                    f"{where}: {_signature(fn)} requires {p.name!r}, which the trl convention does not pass here; "
                    f"it passes {', '.join(self.provided)} and the rows' columns"
                )

    def call(self, fn: Callable[..., Any], items: Sequence[RewardItem]) -> tuple[tuple, dict]:
        refs = [it.reference for it in items]
        # conversational rows (TRL's is_conversational): prompts are the messages, completions one assistant message
        conversation = [_is_conversation(it.columns.get(PROMPT_COLUMN)) for it in items]
        names = sorted({k for it in items for k in it.columns} - ({PROMPT_COLUMN} if any(conversation) else set()))
        kwargs: dict[str, list] = {"ground_truth": refs, "solution": refs}  # aliases, unless a column has the name
        kwargs.update({k: [it.columns.get(k) for it in items] for k in names})
        kwargs.update({
            "prompts": [it.columns[PROMPT_COLUMN] if conv else it.prompt for it, conv in zip(items, conversation)],
            "completions": [[{"role": "assistant", "content": it.response}] if conv else it.response
                            for it, conv in zip(items, conversation)],
            "reference": refs, "label": [it.label for it in items]})
        params = _params(fn)
        if params is None or _has_var_kw(params):
            return (), kwargs
        declared = _names(params)
        for p in params:
            if p.default is inspect.Parameter.empty and p.name in declared and p.name not in kwargs:
                raise ConventionError(
                    f"{_signature(fn)} requires {p.name!r}, which is no column of these rows (their columns: "
                    f"{', '.join(names) or 'none'}; also passed: {', '.join(self.provided)})"
                )
        return (), {k: v for k, v in kwargs.items() if k in declared}

    def read(self, result: Any, n: int, what: str) -> list[Any]:
        values = _as_list(result, f"{what}: the return value")
        if len(values) != n:
            raise ConventionError(f"{what} returned {len(values)} values for {n} completions")
        out: list[Any] = []
        for i, v in enumerate(values):
            if v is None:
                out.append(NOT_APPLICABLE)
                continue
            try:
                out.append(_number(v, f"{what} value [{i}]"))
            except ConventionError as exc:
                out.append(exc)
        return out


class VerlAdapter(_Adapter):
    name = "verl"
    required = ("solution_str",)
    provided = ("data_source", "solution_str", "ground_truth", "extra_info")

    def __init__(self, batch: bool = False) -> None:
        self.batched = batch
        if batch:  # verl's BatchRewardManager calls compute_score with plural names
            self.required = ("solution_strs",)
            self.provided = ("data_sources", "solution_strs", "ground_truths", "extra_infos")

    def check_signature(self, fn: Callable[..., Any], where: str) -> None:
        params = _params(fn)
        if params is not None and not self.batched and "solution_strs" in _names(params):
            return VerlAdapter(batch=True).check_signature(fn, where)
        super().check_signature(fn, where)

    @staticmethod
    def _extra(item: RewardItem) -> dict:
        extra = item.columns.get("extra_info")
        return dict(extra) if isinstance(extra, dict) else {}

    def call(self, fn: Callable[..., Any], items: Sequence[RewardItem]) -> tuple[tuple, dict]:
        if self.batched:
            kwargs = {"data_sources": [it.label for it in items], "solution_strs": [it.response for it in items],
                      "ground_truths": [it.reference for it in items], "extra_infos": [self._extra(it) for it in items]}
        else:
            (item,) = items
            kwargs = {"data_source": item.label, "solution_str": item.response, "ground_truth": item.reference,
                      "extra_info": self._extra(item)}
        keep = self.accepted(fn)
        return (), {k: v for k, v in kwargs.items() if k in keep}

    def read_one(self, result: Any, what: str) -> float:
        if isinstance(result, dict):
            if "score" not in result:
                raise ConventionError(f"{what} returned a dict without 'score' (keys: {', '.join(map(str, result)) or 'none'})")
            score = _number(result["score"], f"{what} 'score'")
            extras = {}
            for key, v in result.items():  # verl logs the other keys; numeric ones become components here
                if key == "score" or isinstance(v, (str, bytes)) or not hasattr(v, "__float__"):
                    continue
                extras[str(key)] = float(v)
            return ScoredWithExtras(score, extras) if extras else score
        return _number(result, f"{what} return value")

    def read(self, result: Any, n: int, what: str) -> list[Any]:
        values = _as_list(result, f"{what}: the return value")
        if len(values) != n:
            raise ConventionError(f"{what} returned {len(values)} values for {n} samples")
        out: list[Any] = []
        for v in values:
            try:
                out.append(self.read_one(v, what))
            except ConventionError as exc:
                out.append(exc)
        return out


class OpenRLHFAdapter(_Adapter):
    name = "openrlhf"
    required = ("queries", "prompts", "labels")
    provided = ("queries", "prompts", "labels")

    def call(self, fn: Callable[..., Any], items: Sequence[RewardItem]) -> tuple[tuple, dict]:
        # Positional, as OpenRLHF calls it: the names in user code vary (query/queries).
        return ([it.prompt + it.response for it in items], [it.prompt for it in items],
                [it.reference for it in items]), {}

    def check_signature(self, fn: Callable[..., Any], where: str) -> None:
        params = _params(fn)
        if params is None:
            return
        positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                      inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        var_pos = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
        if len(positional) < 3 and not var_pos:
            raise ConventionError(
                f"{where}: an openrlhf reward function is called as reward_func(queries, prompts, labels); "
                f"{_signature(fn)} takes {len(positional)} positional argument(s)"
            )
        for p in positional[3:] + [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]:
            if p.default is inspect.Parameter.empty:
                raise ConventionError(
                    f"{where}: {_signature(fn)} requires {p.name!r}, which the openrlhf convention does not "
                    "pass; it passes queries, prompts, labels"
                )

    def read(self, result: Any, n: int, what: str) -> list[Any]:
        if isinstance(result, dict):
            if "rewards" not in result:
                raise ConventionError(
                    f"{what} returned a dict without 'rewards' (keys: {', '.join(map(str, result)) or 'none'})"
                )
            result = result["rewards"]
            values = _as_list(result, f"{what}: 'rewards'")
        else:
            values = _as_list(result, f"{what}: the return value")
        if len(values) != n:
            raise ConventionError(f"{what} returned {len(values)} values for {n} samples")
        out: list[Any] = []
        for i, v in enumerate(values):
            try:
                out.append(_number(v, f"{what} value [{i}]"))
            except ConventionError as exc:
                out.append(exc)
        return out


ADAPTERS: dict[str, _Adapter] = {"trl": TRLAdapter(), "verl": VerlAdapter(), "openrlhf": OpenRLHFAdapter()}


def adapter_for(fn: Callable[..., Any], convention: str) -> _Adapter:
    """The adapter of a resolved (non-streamrft) convention; verl's batch signature gets the batch adapter."""
    if convention == "verl":
        params = _params(fn)
        if params is not None and "solution_strs" in _names(params):
            return VerlAdapter(batch=True)
    return ADAPTERS[convention]
