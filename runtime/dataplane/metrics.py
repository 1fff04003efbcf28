"""Prometheus metrics: one set of families for every embedding of hylinker.

The families are listed once, in :data:`FAMILIES` (each with its label names); each embedding
names them by its engine's convention (:data:`LIBRARY`, ``hylinker_*``; the SGLang plugin,
``sglang:hylinker_*``; the vLLM connector, ``vllm:hylinker_*``) and adds its own identity
labels (SGLang: ``tp_rank``; vLLM: its ``engine``/``model_name`` labels). The README table
("Metrics") lists them.

Most figures are cumulative statistics the runtime already keeps (``runtime/dataplane/statistics.py``,
the data plane's counts, ``stores/resilient.py``, ``runtime/linker/agreement.py``). They become
metrics through *figures*: a mapping ``(family key, *label values) -> value``, read from those
statistics by :func:`plane_figures`, :func:`store_figures` and the linker's :func:`~hylinker.runtime.linker.statistics.linker_figures`.
A counter is published as the increment its total grew by since the last publish
(:class:`Increments`), a gauge as its value; histograms are observed when a transfer ends.

Families outlive their exporter: closing a component stops its refresh and releases its
families, and a component built later on the same registry (a ``Linker`` rebuilt in one process)
takes them over, so its counters go on from the first one's totals (no reset, no duplicate
series). No label's values grow with traffic: every label is a pool, a direction, an outcome, a
reason, an event, a phase, a source, the engine's identity or ``hylinker_info``'s constants; no
request id or key is ever a label (``tests/runtime/test_metrics.py`` checks the series of two runs of
different lengths are the same).

Bad input never fails a request: two components open at once on one registry (the second
degrades), a missing ``prometheus_client`` or a metric that fails to record degrade to no
metrics with one log line.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import attrs

from ...stores.base import Store
from ...stores.resilient import ResilienceStatistics
from .statistics import DataPlaneStatistics, PoolActorStatistics

log = logging.getLogger(__name__)

Kind = Literal["counter", "gauge", "histogram"]
#: ``(family key, *label values) -> value``: counters as running totals, gauges as values now
Figures = dict[tuple[str, ...], float]
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@attrs.frozen
class Family:
    """One metric family: its key (also the name after the engine's prefix), kind and labels."""

    key: str
    kind: Kind
    doc: str
    labels: tuple[str, ...] = ()


def _f(key: str, kind: Kind, doc: str, *labels: str) -> Family:
    return Family(key, kind, doc, labels)


#: every family any embedding exports; the README's "Metrics" table lists the same
FAMILIES: tuple[Family, ...] = (
    # requests (the Linker, and each plugin's own lookups)
    _f("lookups", "counter", "Lookups by outcome (hit, miss, error).", "outcome"),
    _f("hit_tokens", "counter", "Prompt tokens a lookup found, by source (device, store).", "source"),
    _f("declined_hit_tokens", "counter", "Store hit tokens a lookup declined: loading them would "
       "take longer than recomputing them (restores that pay for themselves)."),
    _f("loads", "counter", "Loads (restores) by outcome.", "outcome"),
    _f("load_waits", "counter", "Loads that found no free pages and waited for them, by outcome "
       "(served: pages came; recomputed: the wait ended without them).", "outcome"),
    _f("offloads", "counter", "Offloads by outcome.", "outcome"),
    _f("objects_skipped", "counter", "Objects or offloads not written, by reason.", "reason"),
    _f("bad_objects_removed", "counter", "Objects a load proved bad (verification failed after the re-read), "
       "removed from the store (rewritten later)."),
    _f("bad_objects_kept", "counter", "Objects that did not land and were left in the store, by reason "
       "(unproven: the read failed, nothing proved the object bad; rewritten: proved bad, but the store "
       "held another object by the removal).", "reason"),
    _f("agreement_rounds", "counter", "Rounds the tensor-parallel ranks agreed in."),
    _f("rank_disagreements", "counter", "Lookups, loads and offloads another rank cut short.", "phase"),
    # the data path, per pool
    _f("bytes", "counter", "Object bytes moved (payload and frame header).", "pool", "direction"),
    _f("objects", "counter", "Objects moved.", "pool", "direction"),
    _f("verify_failures", "counter", "Loaded objects that did not verify (checksum, header).", "pool"),
    _f("rereads", "counter", "Objects read once more after a failed verification, by outcome "
       "(recovered: the second read verified; failed: declared bad).", "pool", "outcome"),
    _f("staging_restores", "counter", "Objects a load copied from a host-staging frame still draining to the "
       "store (two-stage offload), per pool.", "pool"),
    _f("transfer_failures", "counter", "Objects missing or failed in the store, per pool.", "pool", "direction"),
    _f("queue_depth", "gauge", "Transfer jobs queued or running; each holds or waits for the pool's "
       "staging frames (staging occupancy).", "pool", "direction"),
    _f("load_seconds", "histogram", "Load latency, submission to last object landed."),
    _f("offload_seconds", "histogram", "Offload latency, submission to last object stored."),
    # the store wrapper
    _f("store_events", "counter", "Store retries, timeouts, breaker trips and calls the open "
       "breaker refused.", "event"),
    _f("breaker_open", "gauge", "1 while the store's circuit breaker is open or half open."),
    # what runs, and what the store holds
    _f("info", "gauge", "1, labelled with the hylinker version, the integrity level and the store.",
       "version", "integrity", "store"),
    _f("store_bytes", "gauge", "Bytes the store holds (this client's view; not exported for a Mooncake "
       "client, whose master reports the cluster's)."),
    _f("store_objects", "gauge", "Objects the store holds (as store_bytes)."),
    _f("store_capacity_bytes", "gauge", "The store's capacity (a Mooncake client: the segment it contributes)."),
    _f("stored_tokens", "counter", "Prompt tokens whose KV pages an offload stored (written, or found stored)."),
)
FAMILY = {f.key: f for f in FAMILIES}
#: the families the data plane publishes; the Linker adds the rest
PLANE_KEYS = ("loads", "offloads", "bytes", "objects", "verify_failures", "rereads", "staging_restores",
              "transfer_failures", "queue_depth",
              "load_seconds", "offload_seconds", "store_events", "breaker_open", "info", "store_bytes",
              "store_objects", "store_capacity_bytes")
#: ``ResilienceStatistics`` field -> ``event`` label of ``store_events``
STORE_EVENTS = {"retries": "retry", "timeouts": "timeout", "breaker_trips": "breaker_trip",
                "rejected_calls": "rejected"}


@attrs.frozen
class Naming:
    """An engine's convention: the prefix of every name, and the labels it adds to each."""

    prefix: str
    base_labels: tuple[str, ...] = ()

    def name(self, family: Family) -> str:
        return self.prefix + family.key


LIBRARY = Naming("hylinker_")


# ---- figures: statistics -> metric keys ---------------------------------------------------
def plane_figures(pools: Mapping[str, PoolActorStatistics], counts: DataPlaneStatistics | None = None) -> Figures:
    """The data plane's per-pool figures (and, with its ``counts``, loads and offloads by outcome)."""
    out: Figures = {}
    for pool, s in pools.items():
        out["bytes", pool, "load"] = s.bytes_loaded
        out["bytes", pool, "offload"] = s.bytes_offloaded
        out["objects", pool, "load"] = s.objects_loaded
        out["objects", pool, "offload"] = s.objects_offloaded
        out["verify_failures", pool] = s.verify_failures
        out["rereads", pool, "recovered"] = s.rereads_recovered
        out["rereads", pool, "failed"] = s.rereads_failed
        out["staging_restores", pool] = s.staging_restores
        out["transfer_failures", pool, "load"] = s.load_misses + s.load_failures
        out["transfer_failures", pool, "offload"] = s.offload_failures
        out["queue_depth", pool, "load"] = s.load_queue.depth
        out["queue_depth", pool, "offload"] = s.offload_queue.depth
    if counts is not None:
        out["loads", "ok"], out["loads", "failed"] = counts.loads_ok, counts.loads_failed
        out["loads", "cancelled"] = counts.loads_cancelled
        out["offloads", "ok"], out["offloads", "failed"] = counts.offloads_ok, counts.offloads_failed
    return out


def store_figures(res: ResilienceStatistics | None) -> Figures:
    """The store wrapper's retries, timeouts and breaker (nothing without a wrapper)."""
    if res is None:
        return {}
    out: Figures = {("store_events", event): getattr(res, name) for name, event in STORE_EVENTS.items()}
    out["breaker_open",] = 0 if res.breaker == "closed" else 1
    return out


def installed_version() -> str:
    """hylinker's version as installed (the package's metadata, from ``__version__`` in the root
    ``__init__.py``, the one source); read here, not imported: the runtime imports no root module."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hylinker")
    except PackageNotFoundError:
        return "unknown"


def store_identity_figures(store: Store, integrity: str) -> Figures:
    """``info`` (version, integrity level, the backend's name) and the store's occupancy."""
    name = store.capabilities.name
    while name.endswith(")") and "(" in name:  # the backend under its wrappers: resilient(faulty(embedded))
        name = name[name.index("(") + 1:-1]
    st = store.statistics()
    out: Figures = {("info", installed_version(), integrity, name): 1, ("store_capacity_bytes",): st.capacity_bytes}
    if name != "mooncake":  # a Mooncake client keeps no occupancy; its master reports the cluster's
        out["store_bytes",] = st.used_bytes
        out["store_objects",] = st.objects
    return out


class Increments:
    """Running totals -> what each grew by since the last :meth:`take` (never negative)."""

    def __init__(self) -> None:
        # bounded: one per series, a family and its fixed label values (never per request or key)
        self._seen: dict[tuple[str, ...], float] = {}

    def take(self, totals: Mapping[tuple[str, ...], float]) -> Figures:
        grown: Figures = {}
        for key, total in totals.items():
            d = total - self._seen.get(key, 0)
            if d > 0:
                grown[key] = d
                self._seen[key] = total
        return grown


def split(figures: Mapping[tuple[str, ...], float]) -> tuple[Figures, Figures]:
    """``figures`` as (counters, gauges) by their family's kind."""
    counters: Figures = {}
    gauges: Figures = {}
    for key, value in figures.items():
        (gauges if FAMILY[key[0]].kind == "gauge" else counters)[key] = value
    return counters, gauges


# ---- export to a prometheus_client registry ------------------------------------------------
@attrs.define
class _Held:
    """What this process made on one registry: families by name, and the names an open
    exporter holds (a second exporter may not take them until the first closes)."""

    families: dict[str, Any] = attrs.field(factory=dict)
    claimed: set[str] = attrs.field(factory=set)


#: bounded: the registries alive (weak keys: a registry collected takes its entry with it)
_held: weakref.WeakKeyDictionary[Any, _Held] = weakref.WeakKeyDictionary()
_held_lock = threading.Lock()


def make_families(registry: Any, naming: Naming, keys: Iterable[str]) -> dict[str, Any]:
    """prometheus_client families for ``keys`` on ``registry``; raises ``ValueError`` when the
    registry already holds one of the names."""
    from prometheus_client import Counter, Gauge, Histogram

    out: dict[str, Any] = {}
    try:
        for key in keys:
            f = FAMILY[key]
            labels = [*naming.base_labels, *f.labels]
            name = naming.name(f)
            if f.kind == "counter":
                out[key] = Counter(name, f.doc, labels, registry=registry)
            elif f.kind == "gauge":
                out[key] = Gauge(name, f.doc, labels, registry=registry, multiprocess_mode="livemax")
            else:
                out[key] = Histogram(name, f.doc, labels, buckets=LATENCY_BUCKETS, registry=registry)
    except BaseException:  # all or none: a half-registered set would block a later attempt
        for metric in out.values():
            registry.unregister(metric)
        raise
    return out


def _child(metric: Any, values: Sequence[str]) -> Any:
    """The labelled child of ``metric`` (the metric itself when it has no labels)."""
    return metric.labels(*values) if values else metric


class _Refresh:
    """A collector with no metrics of its own, registered before the families: a scrape of
    the registry first publishes what the statistics grew by, so every scrape is exact."""

    exporter: Exporter | None = None

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        if self.exporter is not None:
            self.exporter.refresh()
        return []


class Exporter:
    """One component's metrics on a registry: its identity labels, its figures source.

    Every method is safe from any thread and never raises: a metric that fails to record is
    logged once and the component goes on.
    """

    def __init__(self, families: Mapping[str, Any], base_values: Sequence[str] = (),
                 figures: Callable[[], Mapping[tuple[str, ...], float]] | None = None,
                 interval_s: float = 1.0) -> None:
        self._f = families
        self._base = tuple(base_values)
        self._figures = figures
        self._interval_s = interval_s
        self._last_publish = 0.0
        self._increments = Increments()
        self._lock = threading.Lock()
        self._broken = False
        self._refresh: tuple[Any, _Refresh] | None = None
        self._claim: tuple[Any, list[str]] | None = None
        self._exported: set[tuple[str, ...]] = set()  # counter series made so far

    @classmethod
    def create(cls, registry: Any, naming: Naming, keys: Iterable[str], *, who: str,
               base_values: Sequence[str] = (), figures: Callable[[], Mapping[tuple[str, ...], float]] | None = None,
               shared: bool = False, refresh_on_scrape: bool = False, interval_s: float = 1.0) -> Exporter | None:
        """The exporter, or None (one log line) when the families cannot be registered.

        ``shared``: the families are made once per (registry, prefix) and shared by every
        exporter of this process (the plugins: one per rank, told apart by ``base_values``);
        otherwise a registry that already holds them degrades to no metrics.
        ``refresh_on_scrape``: a scrape publishes first (one process; not for multiprocess
        exposition, where another process scrapes the files)."""
        collector: _Refresh | None = None
        try:
            if refresh_on_scrape and figures is not None:  # first: collected before the families
                collector = _Refresh()
                registry.register(collector)
            families = _take(registry, naming, list(keys), claim=not shared)
            if collector is not None:  # families taken over sit before the new collector: move them after it
                for metric in families.values():
                    registry.unregister(metric)
                    registry.register(metric)
        except Exception as exc:  # missing package, names registered already
            if collector is not None:
                registry.unregister(collector)
            log.warning("%s: no metrics (%r)", who, exc)
            return None
        out = cls(families, base_values, figures, interval_s)
        if not shared:
            out._claim = (registry, [naming.name(FAMILY[k]) for k in families])
        if collector is not None:
            collector.exporter = out
            out._refresh = (registry, collector)
        return out

    def _safely(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:
            if not self._broken:
                self._broken = True
                log.warning("hylinker: a metric failed to record (%r); later failures are not logged", exc)

    def count(self, key: str, n: float = 1, *labels: str) -> None:
        if key in self._f:
            self._safely(lambda: _child(self._f[key], (*self._base, *labels)).inc(n))

    def observe(self, key: str, seconds: float, *labels: str) -> None:
        if key in self._f:
            self._safely(lambda: _child(self._f[key], (*self._base, *labels)).observe(seconds))

    def publish(self, figures: Mapping[tuple[str, ...], float] | None = None, *, force: bool = False) -> None:
        """Counters: add what their totals grew by since the last publish; gauges: set. At most
        once per interval unless ``force``. ``figures``: default, the exporter's source."""
        now = time.monotonic()
        with self._lock:
            if not force and now - self._last_publish < self._interval_s:
                return
            self._last_publish = now

            def push() -> None:
                source = figures if figures is not None else (self._figures() if self._figures else {})
                counters, gauges = split({k: v for k, v in source.items() if k[0] in self._f})
                for figure in counters.keys() - self._exported:  # every known series exists, at 0 until it grows
                    _child(self._f[figure[0]], (*self._base, *figure[1:]))
                    self._exported.add(figure)
                for (key, *values), grown in self._increments.take(counters).items():
                    _child(self._f[key], (*self._base, *values)).inc(grown)
                for (key, *values), value in gauges.items():
                    _child(self._f[key], (*self._base, *values)).set(value)

            self._safely(push)

    def refresh(self) -> None:
        """Publish now (a scrape is coming)."""
        self.publish(force=True)

    def close(self) -> None:
        """Publish the last figures, stop refreshing on scrapes and release the families: they
        stay on the registry with their last values, for the next exporter to take over."""
        self.publish(force=True)
        if self._refresh is not None:
            registry, collector = self._refresh
            self._refresh = None
            self._safely(lambda: registry.unregister(collector))
        if self._claim is not None:
            registry, names = self._claim
            self._claim = None
            with _held_lock:
                held = _held.get(registry)
                if held is not None:
                    held.claimed.difference_update(names)


def _take(registry: Any, naming: Naming, keys: list[str], *, claim: bool) -> dict[str, Any]:
    """The families of ``keys`` on ``registry``: made on first use, then reused (a component
    rebuilt in this process goes on counting on them). ``claim``: held until the exporter
    closes; a name another open exporter holds raises ``ValueError``. Unclaimed (the plugins'
    ranks, told apart by their labels): shared."""
    with _held_lock:
        held = _held.setdefault(registry, _Held())
        names = {key: naming.name(FAMILY[key]) for key in keys}
        busy = sorted(n for n in names.values() if n in held.claimed)
        if claim and busy:
            raise ValueError(f"another open component exports {busy[0]} on this registry")
        missing = [key for key, name in names.items() if name not in held.families]
        for key, metric in make_families(registry, naming, missing).items():
            held.families[names[key]] = metric
        if claim:
            held.claimed.update(names.values())
        return {key: held.families[name] for key, name in names.items()}


__all__ = ["FAMILIES", "FAMILY", "LATENCY_BUCKETS", "LIBRARY", "PLANE_KEYS", "STORE_EVENTS", "Exporter", "Family",
           "Figures", "Increments", "Naming", "plane_figures", "split", "store_figures", "store_identity_figures"]
