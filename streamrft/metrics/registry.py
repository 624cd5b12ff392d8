"""The Prometheus metrics of one rank's streaming pipeline, as explicit attributes.

Every metric lives in a private ``CollectorRegistry`` owned by :class:`PipelineMetrics` (never the
process-global default registry, so two instances in one process, as in tests, do not collide).
The constant label ``rank`` is added to every sample at exposition time by a wrapping collector,
so the runtime writes ``metrics.queue_depth.labels(stage="reward").set(3)`` without repeating it.

Counters are the source of truth for rates: tokens/s in Grafana is
``rate(streamrft_generated_tokens_total[1m])``; the ``*_tokens_per_second`` gauges only mirror
the last step's value as the trainer measured it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PHASE_VALUES = {"rollout": 0, "train": 1}  # the value of streamrft_phase for each phase name

# Transitions observed on streamrft_phase_switch_seconds: whole switches and their parts.
PHASE_TRANSITIONS = ("rollout_to_train", "train_to_rollout", "sleep", "wake", "weight_push")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_SWITCH_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
_TURN_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)

# observe_step's scalar names -> (attribute of PipelineMetrics, fixed labels). One name for one
# thing: these keys are also the TensorBoard / W&B tags. "reward/<component>" and
# "reward_std/<component>" are handled by prefix below; anything else goes to streamrft_train_scalar.
SCALAR_GAUGES: dict[str, tuple[str, dict[str, str]]] = {
    "loss": ("loss", {}),
    "kl": ("kl", {}),
    "entropy": ("entropy", {}),
    "clip_fraction": ("clip_fraction", {"side": "all"}),
    "clip_fraction_low": ("clip_fraction", {"side": "low"}),
    "clip_fraction_high": ("clip_fraction", {"side": "high"}),
    "dual_clip_fraction": ("clip_fraction", {"side": "dual"}),
    "value_clip_fraction": ("clip_fraction", {"side": "value"}),
    "tokens_kept_fraction": ("tokens_kept_fraction", {}),
    "kl_coef": ("kl_coef", {}),
    "value_loss": ("value_loss", {}),
    "grad_norm": ("grad_norm", {}),
    "lr": ("learning_rate", {}),
    "reward_mean": ("reward_mean", {"component": "total"}),
    "reward_std": ("reward_std", {"component": "total"}),
    "ratio_mean": ("importance_ratio_mean", {}),
    "ratio_max": ("importance_ratio_max", {}),
    "tis_clipped_fraction": ("tis_clipped_fraction", {}),
    "tis_weight_mean": ("tis_weight_mean", {}),
    "offpolicy_masked_fraction": ("offpolicy_masked_fraction", {}),
    "behaviour_proximal_kl": ("behaviour_proximal_kl", {}),
    "step_seconds": ("step_seconds", {}),
    "trained_tokens_per_s": ("trained_tokens_per_second", {}),
    "generated_tokens_per_s": ("generated_tokens_per_second", {}),
    "mfu": ("mfu", {}),
    # held-out evaluation (before training, every train.eval_every steps, after): the driver reports
    # them under these names at the step the evaluated policy reached (0 = before any update)
    "heldout/accuracy": ("heldout_accuracy", {}),
    "heldout/reward_mean": ("heldout_reward_mean", {}),
}
_REWARD_PREFIXES = {"reward/": "reward_mean", "reward_mean/": "reward_mean", "reward_std/": "reward_std"}
_UNSAFE_LABEL_CHARS = re.compile(r"[^A-Za-z0-9_:./-]")


def sanitise_scalar_name(name: str) -> str:
    """A label value safe for dashboards: odd characters become ``_``, at most 100 characters."""
    return _UNSAFE_LABEL_CHARS.sub("_", name)[:100] or "_"


class _ConstLabels(Collector):
    """Wraps a registry and adds fixed labels (``rank``) to every sample it exposes.

    A scrape collects under ``lock``, so updates grouped in ``PipelineMetrics.atomic()`` are seen
    all or none (e.g. admitted and trained counters of one step agree in every scrape).
    """

    def __init__(self, inner: CollectorRegistry, labels: Mapping[str, str], lock: threading.Lock):
        self._inner = inner
        self._labels = dict(labels)
        self._lock = lock
        self.hooks: list[Callable[[], None]] = []  # run at every scrape, under the lock, before collecting
        # Scrape bookkeeping for "was the last value scraped?": ``updates`` counts observe_scalars calls
        # (incremented after their gauges are set); a scrape that starts when it is n has seen those n.
        self.updates = 0
        self.scraped_updates = 0  # ``updates`` as of the start of the last counted scrape
        self.scrapes = 0  # completed collections for an exporter (PipelineMetrics.exposition() is not counted)
        self.scraped = threading.Condition(lock)  # notified after each counted collection

    def collect(self, count: bool = True) -> Iterable[Metric]:
        with self._lock:  # hooks too: a gauge a hook derives agrees with the counters collected with it
            seen = self.updates
            for hook in self.hooks:
                hook()
            families = list(self._inner.collect())
            if count:
                self.scrapes += 1
                self.scraped_updates = seen
                self.scraped.notify_all()
        for family in families:
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**s.labels, **self._labels}) for s in family.samples]
            yield out


class _ResourceCollector(Collector):
    """Process RSS and CUDA memory, read at scrape time (so they are current, not per step)."""

    def collect(self) -> Iterable[Metric]:
        rss = GaugeMetricFamily(
            "streamrft_process_resident_memory_bytes", "Resident set size of this rank's process."
        )
        rss.add_metric([], float(_resident_bytes()))
        yield rss
        try:  # torch is optional for a metrics-only process (e.g. the simulator)
            import torch
        except ImportError:
            return
        if not torch.cuda.is_available():
            return
        allocated = GaugeMetricFamily(
            "streamrft_gpu_memory_allocated_bytes", "CUDA memory held by tensors.", labels=["device"]
        )
        reserved = GaugeMetricFamily(
            "streamrft_gpu_memory_reserved_bytes", "CUDA memory reserved by the caching allocator.",
            labels=["device"],
        )
        for index in range(torch.cuda.device_count()):
            allocated.add_metric([str(index)], float(torch.cuda.memory_allocated(index)))
            reserved.add_metric([str(index)], float(torch.cuda.memory_reserved(index)))
        yield allocated
        yield reserved


def _resident_bytes() -> int:
    """RSS from /proc (Linux); falls back to the peak RSS from getrusage elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        import os

        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PipelineMetrics:
    """All pipeline metrics of one rank. The runtime uses the attributes directly; the trainer
    reports its per-step scalars through :meth:`observe_step`.

    ``registry`` is what an exporter serves: it yields every metric with ``rank="<rank>"`` added.
    """

    def __init__(self, rank: int = 0):
        self.rank = rank
        self._metrics = CollectorRegistry(auto_describe=True)
        self._metrics.register(_ResourceCollector())
        self._scrape_lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self._exposed = _ConstLabels(self._metrics, {"rank": str(rank)}, self._scrape_lock)
        self.registry.register(self._exposed)
        r = self._metrics

        # Queue pressure, per stage (generator, reward, teacher, advantage, learner, ...).
        self.queue_depth = Gauge(
            "streamrft_stage_queue_depth", "Items waiting in a stage's inbox.", ["stage"], registry=r
        )
        self.credits = Gauge(
            "streamrft_stage_credits", "Credits a stage's sender may still spend.", ["stage"], registry=r
        )
        self.in_flight = Gauge("streamrft_stage_in_flight", "Items a stage is working on now.", ["stage"], registry=r)
        self.stage_latency = Histogram(
            "streamrft_stage_latency_seconds", "Time one item spends in a stage.", ["stage"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )

        # Throughput: counters for rate(), gauges for the trainer's own last-step measurement.
        self.generated_tokens = Counter("streamrft_generated_tokens", "Response tokens generated.", registry=r)
        self.trained_tokens = Counter("streamrft_trained_tokens", "Response (loss) tokens trained on.", registry=r)
        self.generated_tokens_per_second = Gauge(
            "streamrft_generated_tokens_per_second", "Generated tokens/s over the last step.", registry=r
        )
        self.trained_tokens_per_second = Gauge(
            "streamrft_trained_tokens_per_second", "Trained tokens/s over the last step.", registry=r
        )
        self.step = Gauge("streamrft_step", "Last completed train step.", registry=r)
        self.policy_version = Gauge(
            "streamrft_policy_version", "Policy version the engine generates with.", registry=r
        )

        # Phases (colocated mode) and weight sync.
        self.phase = Gauge("streamrft_phase", "Current phase: 0 rollout, 1 train.", registry=r)
        self.phase_switch_seconds = Histogram(
            "streamrft_phase_switch_seconds",
            "Duration of a phase switch (rollout_to_train, train_to_rollout) or of one of its parts "
            "(sleep, wake, weight_push).", ["transition"], buckets=_SWITCH_BUCKETS, registry=r,
        )
        self.weight_sync_seconds = Histogram(
            "streamrft_weight_sync_seconds", "Duration of one learner-to-engine weight sync.",
            buckets=_SWITCH_BUCKETS, registry=r,
        )
        self.weight_sync_bytes = Counter("streamrft_weight_sync_bytes", "Bytes pushed to the engine.", registry=r)

        # Staleness and sample accounting: admitted = trained + filtered + failed (+ in flight).
        self.staleness = Histogram(
            "streamrft_sample_staleness_versions",
            "Policy versions between a sample's generation and the learner that trains on it.",
            buckets=_STALENESS_BUCKETS, registry=r,
        )
        self.admission_in_flight_groups = Gauge(
            "streamrft_admission_in_flight_groups",
            "Prompt groups admitted by the Generator and not yet kept or filtered (the admission gate's count).",
            registry=r,
        )
        self.admission_blocked = Gauge(
            "streamrft_admission_blocked",
            "1 while the admission gate holds the next group back for this reason (paused, in_flight, staleness).",
            ["reason"], registry=r,
        )
        self.samples_admitted = Counter(
            "streamrft_samples_admitted", "Samples admitted by the Generator.", registry=r
        )
        self.samples_trained = Counter("streamrft_samples_trained", "Samples the learner trained on.", registry=r)
        self.samples_filtered = Counter(
            "streamrft_samples_filtered", "Samples dropped by a filter, by reason.", ["reason"], registry=r
        )
        self.samples_failed = Counter(
            "streamrft_samples_failed", "Samples that failed, by reason.", ["reason"], registry=r
        )

        # Multi-turn episodes (env.name set; docs/agents.md), observed by the Generator as each episode ends.
        # Tool counts come from EnvStep.info (tool_calls, tool_errors, tool_error_reason, tool_seconds).
        self.env_turns_per_episode = Histogram(
            "streamrft_env_turns_per_episode", "Model turns of one episode.", buckets=_TURN_BUCKETS, registry=r
        )
        self.env_tool_calls = Counter("streamrft_env_tool_calls", "Tool calls made by the model in episodes.", registry=r)
        self.env_tool_errors = Counter(
            "streamrft_env_tool_errors", "Tool calls that failed, by reason (timeout, memory_limit, tool_parse, ...).",
            ["reason"], registry=r,
        )
        # the catch-all reason exists from the start (at 0): the series is scraped, and rate() works, before a first error
        self.env_tool_errors.labels(reason="error")
        self.env_tool_seconds = Histogram(
            "streamrft_env_tool_seconds", "Tool time of one episode (sum of its tool calls' seconds).",
            buckets=_LATENCY_BUCKETS, registry=r,
        )

        # Per-step training scalars (set through observe_step).
        self.reward_mean = Gauge("streamrft_reward_mean", "Mean reward of the last step.", ["component"], registry=r)
        self.reward_std = Gauge("streamrft_reward_std", "Reward std of the last step.", ["component"], registry=r)
        self.loss = Gauge("streamrft_loss", "Policy loss of the last step.", registry=r)
        self.kl = Gauge("streamrft_kl", "KL to the reference policy, last step.", registry=r)
        self.entropy = Gauge("streamrft_entropy", "Mean per-token entropy (nats), last step.", registry=r)
        self.clip_fraction = Gauge(
            "streamrft_clip_fraction", "Fraction of tokens clipped by the surrogate (side: all, low, high).",
            ["side"], registry=r,
        )
        self.importance_ratio_mean = Gauge(
            "streamrft_importance_ratio_mean", "Mean policy/behaviour ratio.", registry=r
        )
        self.importance_ratio_max = Gauge("streamrft_importance_ratio_max", "Max policy/behaviour ratio.", registry=r)
        self.tis_clipped_fraction = Gauge(
            "streamrft_tis_clipped_fraction", "Fraction of tokens whose truncated-IS weight was clipped.", registry=r
        )
        self.tis_weight_mean = Gauge(
            "streamrft_tis_weight_mean", "Mean truncated importance-sampling weight per token.", registry=r
        )
        self.offpolicy_masked_fraction = Gauge(
            "streamrft_offpolicy_masked_fraction",
            "Fraction of response tokens masked by algorithm.offpolicy_mask (proximal/behaviour ratio out of window).",
            registry=r,
        )
        self.behaviour_proximal_kl = Gauge(
            "streamrft_behaviour_proximal_kl", "k3 KL(behaviour || proximal policy) per response token, last step.",
            registry=r,
        )
        self.tokens_kept_fraction = Gauge(
            "streamrft_tokens_kept_fraction", "Fraction of response tokens kept in the loss (token filters).",
            registry=r,
        )
        self.kl_coef = Gauge("streamrft_kl_coef", "KL coefficient used in the last step (adaptive or fixed).", registry=r)
        self.value_loss = Gauge("streamrft_value_loss", "Critic value loss of the last step.", registry=r)
        self.step_seconds = Gauge("streamrft_step_seconds", "Wall time of the last train step.", registry=r)
        self.grad_norm = Gauge("streamrft_grad_norm", "Gradient norm before clipping, last step.", registry=r)
        self.learning_rate = Gauge("streamrft_learning_rate", "Learning rate of the last step.", registry=r)
        # Registered on its first value (see observe_scalars): with no known peak FLOP/s (CPU, an unknown
        # GPU and metrics.peak_flops=0) the series is absent rather than NaN or a misleading 0.
        self.mfu = Gauge("streamrft_mfu", "Model FLOPs utilisation (0..1) against the peak bf16 dense FLOP/s.",
                         registry=None)
        self._mfu_registered = False
        self.heldout_accuracy = Gauge(
            "streamrft_heldout_accuracy", "Held-out accuracy of the last evaluation (heldout/accuracy).", registry=r
        )
        self.heldout_reward_mean = Gauge(
            "streamrft_heldout_reward_mean", "Held-out mean reward of the last evaluation (heldout/reward_mean).",
            registry=r,
        )
        self.heldout_step = Gauge(
            "streamrft_heldout_step", "Train step whose policy the last held-out evaluation measured (0 = before "
            "training).", registry=r,
        )
        self.train_scalar = Gauge(
            "streamrft_train_scalar", "Any other per-step scalar, by its observe_step name.", ["name"], registry=r
        )

    def observe_episode(self, episode) -> None:
        """One finished episode (streamrft.envs.episode.Episode): turns, tool calls, tool errors by reason
        (errors without a reason count as "error"), tool seconds."""
        self.env_turns_per_episode.observe(episode.turns)
        info = episode.info
        self.env_tool_calls.inc(info.get("tool_calls", 0.0))
        reasons = list(episode.tool_error_reasons)  # one per environment step that reported a reason
        for reason in reasons:
            self.env_tool_errors.labels(reason=reason).inc()
        unexplained = int(info.get("tool_errors", 0.0)) - len(reasons)
        if unexplained > 0:
            self.env_tool_errors.labels(reason="error").inc(unexplained)
        if "tool_seconds" in info:
            self.env_tool_seconds.observe(info["tool_seconds"])

    def on_scrape(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` at every scrape, before collecting (e.g. to sample queue depths, so a
        gauge is current when Prometheus reads it rather than as of the last step). The hook runs
        on the exporter's thread, holding the ``atomic()`` lock: it must only read plain attributes
        (ints, ``len``) and set gauges, and must not take ``atomic()`` itself."""
        self._exposed.hooks.append(hook)

    def atomic(self) -> threading.Lock:
        """``with metrics.atomic(): ...`` groups updates so no scrape sees half of them. Single
        updates need no lock (prometheus_client's own are thread-safe); keep the block short."""
        return self._scrape_lock

    def set_phase(self, phase: str) -> None:
        """Set streamrft_phase from a phase name ("rollout" | "train")."""
        if phase not in PHASE_VALUES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {sorted(PHASE_VALUES)}")
        self.phase.set(PHASE_VALUES[phase])

    def observe_step(self, step: int, scalars: Mapping[str, float]) -> None:
        """Export one train step's scalars.

        Known names map through :data:`SCALAR_GAUGES` (e.g. ``"lr"`` -> ``streamrft_learning_rate``);
        ``"reward/<c>"`` (or ``"reward_mean/<c>"``) and ``"reward_std/<c>"`` set the reward gauges
        with ``component="<c>"``; any other name is exported as
        ``streamrft_train_scalar{name="<sanitised name>"}`` rather than dropped.
        """
        self.step.set(step)
        self.observe_scalars(scalars)

    def observe_heldout(self, step: int, scalars: Mapping[str, float]) -> None:
        """Export one held-out evaluation (``heldout/accuracy``, ``heldout/reward_mean``, ...) of the policy
        after ``step`` train steps; ``streamrft_step`` is left alone (no train step happened)."""
        self.heldout_step.set(step)
        self.observe_scalars(scalars)

    def observe_scalars(self, scalars: Mapping[str, float]) -> None:
        """Set the gauges of ``scalars`` by name (the mapping of :meth:`observe_step`)."""
        for name, value in scalars.items():
            value = float(value)
            if name == "mfu" and not self._mfu_registered:
                self._metrics.register(self.mfu)
                self._mfu_registered = True
            known = SCALAR_GAUGES.get(name)
            if known is not None:
                attr, labels = known
                gauge = getattr(self, attr)
                (gauge.labels(**labels) if labels else gauge).set(value)
                continue
            for prefix, attr in _REWARD_PREFIXES.items():
                if name.startswith(prefix) and len(name) > len(prefix):
                    getattr(self, attr).labels(component=sanitise_scalar_name(name[len(prefix):])).set(value)
                    break
            else:
                self.train_scalar.labels(name=sanitise_scalar_name(name)).set(value)
        self._exposed.updates += 1  # after the values: a scrape that reads this count has them (GIL-ordered)

    @property
    def scrapes(self) -> int:
        """How many times an exporter has collected these metrics."""
        return self._exposed.scrapes

    def wait_for_scrape_after_last_update(self, timeout_s: float) -> bool:
        """Block until a scrape has happened since the last observed value, at most ``timeout_s``; True if
        one did. Returns at once when nothing ever scraped this rank (no Prometheus is watching)."""
        exposed = self._exposed
        with exposed.scraped:
            if exposed.scrapes == 0:
                return False
            return exposed.scraped.wait_for(lambda: exposed.scraped_updates >= exposed.updates,
                                            timeout=max(timeout_s, 0.0))

    def exposition(self) -> str:
        """The text a scrape of this rank's exporter returns (handy for tests and debugging; not counted as
        a scrape)."""
        from prometheus_client import generate_latest

        exposed = self._exposed

        class _Uncounted:
            def collect(self) -> Iterable[Metric]:
                return exposed.collect(count=False)

        return generate_latest(_Uncounted()).decode()
