"""What every publisher is, whatever travels: :class:`Publisher`, the base of :class:`~bridge.publisher.core.WeightPublisher`
(the whole model, in an encoding) and :class:`~bridge.lora.publisher.AdapterPublisher` (one LoRA adapter).

One publisher of either kind:

- is built on every trainer rank from its config (or the config's keyword arguments, not both);
- runs each step of a publish through one :class:`~bridge.publisher.agreement.Agreement`: every rank learns every
  rank's outcome within the step's bound plus the same slack (``SLACK_S``), and a failed publish raises the same
  error on every rank (:func:`~bridge.publisher.agreement.raise_agreed`);
- holds Ctrl-C and SIGTERM to the end of the step in progress (:mod:`bridge.publisher.interrupts`), and its own
  lock for the whole publish (what it does between publishes, the fleet's guard, waits for it);
- keeps one version record (:class:`~bridge.publisher.versions.Versions`): versions are non-negative integers that
  never go down; the last one again is a retry, safe only with the weights published then;
- belongs to one run, ``experiment/trial``, which the servers' version rule and writer lease name;
- takes every server it publishes to for itself alone while a publish runs (the writer lease), and finds its
  servers again at every publish, probing each one (:mod:`bridge.fleet`).

What varies is what travels and how it goes: ``_publish(source, version)``.
"""

from __future__ import annotations

import threading

from bridge.errors import ConfigError
from bridge.publisher.agreement import Agreement
from bridge.publisher.bounded import SLACK_S
from bridge.publisher.interrupts import held
from bridge.publisher.versions import Versions

__all__ = ["Publisher"]


class Publisher:
    """The base of both publishers (see the module docstring). Subclasses set :attr:`config_class` and implement
    :meth:`_publish`."""

    config_class: type

    def __init__(self, config=None, kwargs: dict | None = None, versions: Versions | None = None):
        if config is None:
            config = self.config_class(**(kwargs or {}))
        elif kwargs:
            raise ConfigError(f"pass either a {self.config_class.__name__} or keyword arguments, not both")
        self.config = config
        self._agree = Agreement.of_default_group()
        self._rank = self._agree.rank
        self._versions = versions if versions is not None else Versions()
        self._busy = threading.Lock()  # held by each publish: the fleet's guard probes only between publishes

    @property
    def last_version(self) -> int | None:
        """The last version this publisher published (None before the first)."""
        return self._versions.last

    @property
    def run_id(self) -> str:
        """The run this publisher's versions belong to, as servers and watchers see it: ``experiment/trial``."""
        return f"{self.config.experiment}/{self.config.trial}"

    def publish(self, source, version: int):
        """Publish ``source`` as ``version``. Collective: every trainer rank calls it with the same version; every
        rank returns the same result or raises the same error (see the subclass)."""
        self._versions.check(version)
        with held(self._rank), self._busy:  # Ctrl-C / SIGTERM: finish the step, clean up on every rank, then act
            return self._publish(source, version)

    def _publish(self, source, version: int):
        raise NotImplementedError

    def _step_on_every_rank(self, name: str, fn, bound: float, on_failure=None) -> list:
        """One agreed step: ``fn`` on every rank, within ``bound`` plus the slack every step has; what each rank's
        ``fn`` returned, or the same error on every rank."""
        return self._agree.step(name, fn, timeout=bound + SLACK_S, on_failure=on_failure)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError
