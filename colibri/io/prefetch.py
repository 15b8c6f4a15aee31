"""Prefetcher: start reads of the experts the next layers will probably want.

The prefetcher never routes. The pipeline applies layer L+1's (optionally L+2's) router to
layer L's hidden state with the one routing implementation (colibri.compute.moe) and hands the
predicted expert ids over:

    prefetcher = Prefetcher(cache)
    for each token:
        prefetcher.new_token()                  # judge the last token, cancel stale reads
        for each layer L:
            ...route L, cache.request(L, experts), await cache.get(...)...
            prefetcher.predict(L + 1, predicted_experts_of_L_plus_1)

`predict` starts low-priority reads through `ExpertCache.prefetch` (free or cold slots only,
never a leased or loading one; demand reads always go first). The cache tells the prefetcher
about every demand access (`on_demand`) and every prefetched record evicted unused
(`on_wasted`), which gives the statistics:
  predicted — (layer, expert) predictions made; issued — reads actually started (the others
  were cached already or found no free/cold slot); useful — predictions the same token then
  demanded; recall = useful / demands in predicted layers; precision = useful / predicted;
  useful_reads / wasted_reads — issued reads later demanded / never demanded.
Back-off: prefetch must not make things slower (on a saturated disk a wrong guess delays a
demand read). Tokens are grouped in windows of `window` tokens, timed between `new_token`
calls; a step's time counts only against steps of its own shape (`new_token(shape)`: the
pipeline passes its sequences' token counts), and steps of shape None (prompt chunks) are not
timed: a 32-token prompt chunk takes 10x a decode step, so a window holding one would decide
the comparison alone (in `colibri serve`, where prompts arrive between decode steps, that
backed prefetch off 3-4 times in 64 steps and left it off for most of them). Two checks,
after each window:
  - precision: if under `min_read_precision` of the reads issued in the window were demanded;
  - time: every `probe_every` windows one window runs with prefetch off (a probe); if the mean
    token time with prefetch on (EMA over windows) exceeds that with it off by `margin`.
Either one pauses prefetch for `cooldown` windows (doubling on each back-off up to
`max_cooldown`, reset when a window pays), after which it is tried again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from colibri.io.cache import ExpertCache, Key


@dataclass(frozen=True, slots=True)
class PrefetchStatistics:
    predicted: int
    issued: int
    useful: int
    demanded: int
    recall: float
    precision: float
    useful_reads: int
    wasted_reads: int
    cancelled: int
    enabled: bool
    backoffs: int
    skipped_while_backing_off: int


class Prefetcher:
    """Issues predicted experts as low-priority cache reads; see the module docstring.

    Args:
        cache: the ExpertCache (the prefetcher registers itself as `cache.observer`).
        min_read_precision: share of issued reads that must be demanded to keep going.
        window: tokens per judgement; probe_every: prefetch-on windows between two probes;
        margin: how much slower (fraction) prefetch-on tokens may be before backing off;
        cooldown / max_cooldown: windows to pause (doubling); clock: seconds (for tests).
    """

    def __init__(
        self,
        cache: ExpertCache,
        *,
        min_read_precision: float = 0.25,
        window: int = 4,
        probe_every: int = 4,
        margin: float = 0.05,
        cooldown: int = 2,
        max_cooldown: int = 64,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cache = cache
        cache.observer = self
        self.min_read_precision, self.margin = min_read_precision, margin
        self.window, self.probe_every = window, probe_every
        self.cooldown0, self.max_cooldown = cooldown, max_cooldown
        self._clock = clock
        self._cooldown = cooldown
        self._mode = "on"  # this window: "on" | "probe" (off, measuring) | "paused"
        self._paused = 0  # windows left to pause
        self._on_windows = 0
        # (mode, step shape) -> mean step time (EMA over windows)
        self._ema: dict[tuple[str, Hashable], float] = {}
        self._t_last: float | None = None
        self._shape: Hashable = ()  # the shape of the step that started at _t_last
        self._win_shape: Hashable = None  # the shape this window times (its first timed step's)
        self._predicted: set[Key] = set()  # this token
        self._carry: list[Key] = []  # guesses for the next token (predict_next_token)
        # guess sources: "router" (the next layer's router) and "repeat" (the previous
        # token's choice): this token's guessed keys -> their sources; per source decayed
        # [demanded, predicted] counts
        self._sources: dict[Key, set[str]] = {}
        self._src: dict[str, list[float]] = {"router": [0.0, 0.0], "repeat": [0.0, 0.0]}
        self._layers: set[int] = set()
        self._win_issued = self._win_useful = self._win_tokens = 0
        self._win_time = 0.0
        self._n = dict.fromkeys(
            (
                "predicted",
                "issued",
                "useful",
                "demanded",
                "useful_reads",
                "wasted_reads",
                "cancelled",
                "backoffs",
                "skipped",
            ),
            0,
        )

    @property
    def enabled(self) -> bool:
        """True while predictions are issued as reads (not probing, not backed off)."""
        return self._mode == "on"

    def predict(
        self,
        layer: int,
        experts: Iterable[int],
        *,
        repeat: Iterable[int] = (),
        limit: int | None = None,
    ) -> int:
        """Record the prediction for `layer` this token and start reads of those not cached
        (unless probing or backed off); those that find no slot wait for one (ExpertCache.prefetch
        with defer). experts: the router's guess, best first; repeat: a second guess, the
        experts the previous token chose there. Guessed by both go first, then the rest of
        the source whose guesses were demanded more often so far (the router's until both
        have a record), at most `limit` keys in all. Never waits. Returns the number of reads
        started at once."""
        router = [int(e) for e in experts]
        again = [int(e) for e in repeat]
        both = set(router) & set(again)
        first = [e for e in router if e in both]
        rest = [[e for e in router if e not in both], [e for e in again if e not in both]]
        if self._source_precision("repeat") > self._source_precision("router"):
            rest.reverse()
        order = list(dict.fromkeys(first + rest[0] + rest[1]))[:limit]
        for e in router:
            self._sources.setdefault((layer, e), set()).add("router")
        for e in again:
            self._sources.setdefault((layer, e), set()).add("repeat")
        self._src["router"][1] += len(router)
        self._src["repeat"][1] += len(again)
        keys = [(layer, e) for e in order]
        new = [k for k in keys if k not in self._predicted]
        self._predicted.update(new)
        self._layers.add(layer)
        self._n["predicted"] += len(new)
        if not self.enabled:
            self._n["skipped"] += len(new)
            return 0
        return self.cache.prefetch(layer, [k[1] for k in new], defer=True)

    def _source_precision(self, name: str) -> float:
        """Share of a guess source's predictions (decayed counts) that were demanded."""
        useful, predicted = self._src[name]
        return useful / predicted if predicted >= 16 else 0.0

    def on_issued(self, key: Key) -> None:
        """Called by the cache when a prefetch read starts (at once, or deferred until a
        slot freed)."""
        self._n["issued"] += 1
        self._win_issued += 1

    def predict_next_token(self, layer: int, experts: Iterable[int]) -> None:
        """Guess `layer`'s experts for the token after this one (e.g. this token's own, at
        its last layer): queued as reads that start as slots free up (during the output
        head), kept through `new_token` and judged as that token's predictions."""
        if not self.enabled:
            return
        keys = [(layer, int(e)) for e in experts]
        self._carry.extend(keys)
        self.cache.prefetch(layer, [e for _, e in keys], defer=True)

    def on_demand(self, key: Key, prefetch_used: bool) -> None:
        """Called by the cache on every demand `get` (prefetch_used: this get is the first
        demand of a record a prefetch read)."""
        for src in self._sources.pop(key, ()):
            self._src[src][0] += 1
        if key[0] in self._layers:
            self._n["demanded"] += 1
            if key in self._predicted:
                self._n["useful"] += 1
                self._predicted.discard(key)  # count once
        if prefetch_used:
            self._n["useful_reads"] += 1
            self._win_useful += 1

    def on_wasted(self, key: Key) -> None:
        """Called by the cache when a prefetched record is evicted before any demand."""
        self._n["wasted_reads"] += 1

    def new_token(self, shape: Hashable = ()) -> None:
        """A new token (forward pass) starts: cancel prefetch reads nobody waits for; at the
        end of a window, judge it and switch mode as described in the module docstring.
        shape: what kind of step starts, any hashable (the pipeline passes its sequences'
        token counts); a window times the steps of one shape (its first timed step's) and
        is compared with windows of that shape; None: do not time this step (a prompt
        chunk)."""
        now = self._clock()
        if self._t_last is not None and self._shape is not None:
            if self._win_shape is None:
                self._win_shape = self._shape
            if self._shape == self._win_shape:
                self._win_time += now - self._t_last
                self._win_tokens += 1
        self._t_last, self._shape = now, shape
        carry, self._carry = self._carry, []
        self._n["cancelled"] += self.cache.cancel_prefetches(keep=carry)
        self._predicted.clear()
        self._layers.clear()
        self._sources.clear()
        for src in self._src.values():  # decay: the guess sources' recent record counts
            src[0] *= 0.9
            src[1] *= 0.9
        for key in carry:
            self._sources[key] = {"repeat"}
        self._src["repeat"][1] += len(carry)
        self._predicted.update(carry)
        self._layers.update(k[0] for k in carry)
        self._n["predicted"] += len(self._predicted)
        if self._win_tokens < self.window:
            return
        kind = "on" if self._mode == "on" else "off"
        shape = self._win_shape
        mean, old = self._win_time / self._win_tokens, self._ema.get((kind, shape))
        self._ema[(kind, shape)] = mean if old is None else 0.5 * old + 0.5 * mean
        on, off = self._ema.get(("on", shape)), self._ema.get(("off", shape))
        slower = on is not None and off is not None and on > off * (1 + self.margin)
        if self._mode == "on":
            if (
                self._win_issued and self._win_useful / self._win_issued < self.min_read_precision
            ) or slower:
                self._back_off()
            else:
                self._cooldown = self.cooldown0
                self._on_windows += 1
                if self._on_windows >= self.probe_every:
                    self._mode, self._on_windows = "probe", 0
        elif self._mode == "probe":
            if slower:
                self._back_off()
            else:
                self._mode = "on"
        else:
            self._paused -= 1
            if self._paused <= 0:
                self._mode = "on"
        self._win_issued = self._win_useful = self._win_tokens = 0
        self._win_time = 0.0
        self._win_shape = None

    def _back_off(self) -> None:
        self._mode, self._paused = "paused", self._cooldown
        self._cooldown = min(2 * self._cooldown, self.max_cooldown)
        self._n["backoffs"] += 1

    def statistics(self) -> PrefetchStatistics:
        n = self._n
        return PrefetchStatistics(
            n["predicted"],
            n["issued"],
            n["useful"],
            n["demanded"],
            n["useful"] / n["demanded"] if n["demanded"] else 0.0,
            n["useful"] / n["predicted"] if n["predicted"] else 0.0,
            n["useful_reads"],
            n["wasted_reads"],
            n["cancelled"],
            self.enabled,
            n["backoffs"],
            n["skipped"],
        )
