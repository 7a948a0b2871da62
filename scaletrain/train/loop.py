"""The training loop: steps dispatched one ahead of the host, their metrics read and logged, evaluation, saves,
preemption, and what a bad step does - a non-finite loss (`train.on_nonfinite`) or a loss spike (`train.spike.*`,
spike.py, docs/health.md). trainer.py builds everything and restores the state; this runs it to the end."""

from __future__ import annotations

import dataclasses
import math
import socket
import sys
import time
from typing import Any, Callable

import jax

from scaletrain.train import goodput
from scaletrain.train.control import Control
from scaletrain.train.metrics import MetricsLog, StepClock
from scaletrain.train.profiler import Profiler
from scaletrain.train.spike import Spike, SpikeRule
from scaletrain.train.stragglers import BatchTimes, Stragglers
from scaletrain.train.watchdog import Watchdog

# rewind(step) -> (the newest checkpoint's step from before `step`, or 0, its state, data position and the spike
# rule's window): where a rollback goes.
Rewind = Callable[[int], tuple[int, Any, dict, dict | None]]
STOPPED_ON_SPIKES = "stopped (loss spikes)"


@dataclasses.dataclass(frozen=True)
class Outcome:
    step: int  # the last step done (a halted run's too: the step dispatched before the one that halted it was read)
    newest: int | None  # the newest checkpoint's step
    ended: str  # finished, preempted, stopped (...)
    error: str | None = None  # why it stopped, when it did


class Loop:
    def __init__(self, cfg, setup, step_fn, state, start: int, newest: int | None, iterator, evaluator, ckpt,
                 lock, meta: dict, ledger: goodput.Ledger, control: Control, log: MetricsLog, watchdog: Watchdog,
                 rule: SpikeRule, rewind: Rewind, flops_per_step: float, peak: float | None):
        self.cfg, self.setup, self.step_fn, self.state, self.step, self.newest = (cfg, setup, step_fn, state,
                                                                                  start, newest)
        self.iterator, self.evaluator, self.ckpt, self.lock, self.meta = iterator, evaluator, ckpt, lock, meta
        self.ledger, self.control, self.log, self.watchdog, self.rule = ledger, control, log, watchdog, rule
        self.rewind, self.flops_per_step, self.peak = rewind, flops_per_step, peak
        self.main = jax.process_index() == 0
        self.tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
        self.clock = StepClock(start)
        self.no_ceiling = setup.loss_ceiling()
        self.drops: dict[int, int] = {}  # step -> batches left out before its own (a rollback's)
        self.rollbacks = self.skipped_in_a_row = 0
        self.spike: Spike | None = None  # a spike to roll back from
        self.halted: tuple[str, str] | None = None  # (how the run ended, its error line): the run stops
        self.batch_times, self.stragglers = BatchTimes(), Stragglers(cfg.train.hang.straggler)
        self.step_s: float | None = None  # the newest record's step time

    def _batch_for(self, step: int) -> dict:
        for _ in range(self.drops.get(step, 0)):
            next(self.iterator)
        return self.setup.put_batch(next(self.iterator))

    def _ceiling(self, step: int) -> jax.Array:
        ceiling = self.rule.dispatched(step)
        return self.no_ceiling if math.isinf(ceiling) else self.setup.loss_ceiling(ceiling)

    def _warn(self, line: str) -> None:
        if self.main:
            print(f"\nwarning: {line}", file=sys.stderr, flush=True)

    def _take(self, step: int, metrics: dict) -> dict:
        """Step `step`'s metrics, read (after it finished), and judged: a dropped update, a loss spike."""
        self.clock.wait(step, metrics)
        self.ledger.stepped(step)
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        spike = self.rule.judge(step, values["loss"], applied=not values["update_skipped"])
        # The step drops an update for a non-finite loss, gradient norm or penalty - or, with `skip`, a spike.
        if values["update_skipped"] and not (spike is not None and self.rule.action == "skip"):
            self._warn(f"step {step}: loss {values['loss']}, gradient norm {values['grad_norm']}; update dropped")
            if self.cfg.train.on_nonfinite == "stop" and self.halted is None:
                self.halted = ("stopped (non-finite loss)",
                               f"step {step}: non-finite loss or gradient norm (train.on_nonfinite=stop); the "
                               f"checkpoints hold only good updates")
        elif spike is None:
            self.skipped_in_a_row = 0
        elif self.halted is None:  # once stopping, the step dispatched meanwhile is not judged
            self._spiked(spike)
        return values

    def _spiked(self, spike: Spike) -> None:
        action, limit = self.rule.action, self.cfg.train.spike.limit
        if action == "warn":
            self._warn(f"loss spike at {spike.describe()} (train.spike.action=warn)")
            self.log.event(spike.record("warn"))
        elif action == "skip":
            self.skipped_in_a_row += 1
            self._warn(f"loss spike at {spike.describe()}; update dropped (train.spike.action=skip)")
            self.log.event(spike.record("skip", in_a_row=self.skipped_in_a_row))
            if self.skipped_in_a_row > limit:
                self.halted = (STOPPED_ON_SPIKES,
                               f"step {spike.step}: {self.skipped_in_a_row} loss spikes in a row, each update "
                               f"dropped (train.spike.limit={limit}): the loss has left its running median for "
                               f"good; the checkpoints hold only good updates")
        elif self.rollbacks >= limit:
            self.log.event(spike.record("stop", rollbacks=self.rollbacks))
            before = self.ckpt.newest_before(spike.step)
            self.halted = (STOPPED_ON_SPIKES,
                           f"loss spike at {spike.describe()} after {self.rollbacks} rollbacks "
                           f"(train.spike.limit={limit}); " + (
                               f"the newest checkpoint, step {before}, holds the state from before it" if before
                               is not None else "no checkpoint was saved before it: a restart begins from the run's "
                               "start (lower checkpoint.every_steps to keep one)"))
        else:
            self.spike = spike

    def _name_straggler(self, step: int, decision) -> None:
        """From the agreed values alone (process 0's step time among them), so every process names the same."""
        named = self.stragglers.check(step, decision.batch_s, decision.step_s)
        if named is None:
            return
        p, what = named["process"], (f"makes its batches in {named['batch_s']:.3f} s a step, the others in "
                                     f"{named['median_batch_s']:.3f} s (median), against a step of "
                                     f"{named['step_time_s']:.3f} s: they wait for it")
        if p == jax.process_index():  # only this process knows its host
            print(f"\nwarning: step {step}: this process ({p} on {socket.gethostname()}) is the straggler: it {what}",
                  file=sys.stderr, flush=True)
        elif self.main:
            self._warn(f"step {step}: process {p} is the straggler: it {what}")
        self.log.event(named)

    def _record(self, step: int, values: dict, last: bool, timed: dict | None = None) -> None:
        """Step `step`'s record, at a log interval, the last step, a dropped update, and with `timed` (the seconds
        an evaluation or a save at this step took)."""
        if step % self.cfg.train.log_every_steps == 0 or last or values["update_skipped"] or timed:
            dt = self.step_s = self.clock.record(step)
            self.watchdog.step_time(dt)
            self.log.log({"step": step, **values, "tokens_per_sec": self.tokens_per_step / dt, "step_time_s": dt,
                          "mfu": self.flops_per_step / dt / self.peak if self.peak else None, **(timed or {})})

    def _roll_back(self) -> dict:
        """Back to the newest checkpoint from before the spike, its batch to be left out: the next step's batch."""
        spike, self.spike = self.spike, None
        self.rollbacks += 1
        self.watchdog.enter("checkpoint", spike.step)
        t0 = time.perf_counter()
        self.ckpt.wait()
        for x in jax.tree.leaves(jax.block_until_ready(self.state)):  # one state on the devices, not two
            x.delete()
        self.control.dropped()
        self.step, self.state, data_state, window = self.rewind(spike.step)
        self.state = jax.block_until_ready(self.state)
        self.iterator.set_state(data_state)
        self.rule.restore(window)
        self.drops[spike.step] = self.drops.get(spike.step, 0) + 1
        self.ledger.rolled_back(self.step, time.perf_counter() - t0)
        self.log.rewind(self.step)
        self.log.event(spike.record("rollback", to_step=self.step, rollbacks=self.rollbacks))
        self._warn(f"loss spike at {spike.describe()}; rolled back to step {self.step}, its batch left out "
                   f"(train.spike.action=rollback, {self.rollbacks} of {self.cfg.train.spike.limit})")
        self.clock = StepClock(self.step)
        return self._batch_for(self.step + 1)

    def run(self) -> Outcome:
        cfg, ledger, watchdog = self.cfg, self.ledger, self.watchdog
        # The previous step's metrics and agreed flags are read after this step is dispatched, so the host never
        # waits for the device it is feeding. Everything that decides the loop's course is read from replicated
        # arrays, so every process takes the same course.
        # The next step's batch is made while this step runs, at every step alike - also before an evaluation or
        # a save, whose step's time then holds the same host work as any other's.
        pending, stop = None, False
        profiler = Profiler(cfg)
        try:
            ledger.started("startup")
            with ledger.timing("data"):
                batch = self._batch_for(self.step + 1)
            ledger.loop_started()
            while True:
                while self.step < cfg.steps and not stop and self.halted is None:
                    profiler.before(self.step + 1)
                    watchdog.enter("step", self.step + 1)
                    self.clock.dispatching(self.step + 1)
                    self.state, metrics = self.step_fn(self.state, batch, self._ceiling(self.step + 1))
                    self.step += 1
                    step = self.step
                    profiler.after(step, self.state)
                    evaluate = self.evaluator is not None and (step % cfg.train.eval_every_steps == 0
                                                               or step == cfg.steps)
                    agreed = self.control.propose(self.batch_times.mean(), self.step_s or 0.0)
                    save = step % cfg.checkpoint.every_steps == 0 or step == cfg.steps
                    if pending is not None:
                        if pending[1] is not None:
                            self._record(pending[0], self._take(*pending[:2]), last=False)
                        if self.spike is not None:
                            batch, pending = self._roll_back(), None
                            continue
                        decision = self.control.decide(pending[2])
                        stop, save = decision.stop, save or decision.save or decision.stop
                        self._name_straggler(pending[0], decision)
                    pending = (step, metrics, agreed)
                    data_state = self.iterator.get_state() if save else None  # after this step's batch
                    if step < cfg.steps and not stop and self.halted is None:
                        t0 = time.perf_counter()
                        watchdog.enter("data", step + 1)
                        batch = self._batch_for(step + 1)
                        seconds = time.perf_counter() - t0
                        self.batch_times.add(seconds)
                        if all(x.is_ready() for x in jax.tree.leaves(metrics)):  # the devices waited for it
                            ledger.spend("data", seconds)
                        watchdog.enter("step", step)
                    if evaluate or save:
                        # The host waits here anyway. It waits for the step first - judged before anything is
                        # saved -, then evaluates and saves before the next step is dispatched: each is timed alone,
                        # and neither counts in any step's time.
                        values = self._take(step, metrics)
                        if self.spike is not None:
                            batch, pending = self._roll_back(), None
                            continue
                        if self.halted is not None and self.halted[0] == STOPPED_ON_SPIKES:
                            self._record(step, values, last=True)
                            pending = None
                            break  # its state may hold a spike's update: not saved
                        self._evaluate_and_save(step, evaluate, save, values, data_state,
                                                last=stop or step == cfg.steps)
                        pending = (step, None, agreed)
                if pending is not None and pending[1] is not None:
                    self._record(pending[0], self._take(*pending[:2]), last=True)
                    pending = None
                    if self.spike is not None:
                        batch = self._roll_back()
                        continue
                break
            watchdog.enter("checkpoint", self.step)
            with ledger.timing("checkpoint"):
                self.ckpt.wait()
        finally:
            profiler.close()
        if self.halted is not None:
            return Outcome(self.step, self.newest, *self.halted)
        return Outcome(self.step, self.newest, "preempted" if stop else "finished")

    def _evaluate_and_save(self, step: int, evaluate: bool, save: bool, values: dict, data_state: dict | None,
                           last: bool) -> None:
        timed = {}
        if evaluate:
            self.watchdog.enter("evaluation", step)
            t0 = time.perf_counter()
            values["eval_loss"] = float(jax.block_until_ready(self.evaluator(self.state)))
            timed["eval_time_s"] = time.perf_counter() - t0
            self.ledger.spend("evaluation", timed["eval_time_s"])
        if save:
            self.watchdog.enter("checkpoint", step)
            t0 = time.perf_counter()
            if self.lock is not None:
                self.lock.check()
            on_disk = self.setup.to_disk(self.state)
            self.ckpt.save(step, self.setup.saved(on_disk), data_state, {**self.meta, "spike": self.rule.state()})
            self.state = jax.block_until_ready(self.setup.from_disk(on_disk))
            timed["checkpoint_time_s"] = time.perf_counter() - t0
            self.ledger.spend("checkpoint", timed["checkpoint_time_s"])
            self.newest = step
            self.drops = {s: n for s, n in self.drops.items() if s > step}  # in the saved data position now
            self.control.saved()
        # This step's record goes out now; with a checkpoint, a resume from it must find it.
        self._record(step, values, last=last, timed=timed)
        self.clock.paused(step)
        self.watchdog.enter("step", step)
        if save:
            self.ledger.write()
            self.ledger.sync()
            self.log.scalars(goodput.scalars(self.ledger.totals()), step)
            self.log.sync()
