"""What ``ampkit bench`` and ``ampkit train`` run: workloads, the runner, data, reports.

Modules: ``workloads`` (the built-in models and package.module:function ones),
``policies`` (names -> PolicySpec), ``precision`` (a policy applied to one training
loop, the step), ``runner`` (the policies in rounds, compared, recommended), ``worker``
(a policy in a process of its own), ``report`` (tables, words, plots), ``train`` (what
``ampkit train`` runs; the package's ``train`` is its function: import the module's other
names from ``ampkit.bench.train``). Timing and memory: ``ampkit._measure``.

Example:
    >>> from ampkit.bench import BenchSettings, parse_policy, run_policy
    >>> result = run_policy(parse_policy("bf16-mixed", "cpu"), BenchSettings(model="mlp", steps=2))
    >>> sorted(k for k in result if k in ("step_ms", "final_loss"))
    ['final_loss', 'step_ms']
"""

from __future__ import annotations

from .errors import UsageError
from .policies import PolicySpec, parse_policy, parse_policy_list
from .precision import Precision, train_step
from .compare import recommend
from .runner import BenchSettings, run_bench, run_policy
from .train import TrainSettings, train
from .workloads import Workload, get_workload

__all__ = [
    "UsageError",
    "BenchSettings", "PolicySpec", "Precision", "parse_policy",
    "parse_policy_list", "recommend", "run_bench", "run_policy", "train_step",
    "TrainSettings", "train",
    "Workload", "get_workload",
]
