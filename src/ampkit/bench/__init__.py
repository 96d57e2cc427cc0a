"""What ``ampkit bench`` and ``ampkit train`` run: workloads, the runner, data, reports.

Example:
    >>> from ampkit.bench import BenchSettings, parse_policy, run_policy
    >>> result = run_policy(parse_policy("bf16-mixed", "cpu"), BenchSettings(model="mlp", steps=2))
    >>> sorted(k for k in result if k in ("step_ms", "final_loss"))
    ['final_loss', 'step_ms']
"""

from __future__ import annotations

from .errors import UsageError
from .runner import (BenchSettings, PolicySpec, Precision, parse_policy, parse_policy_list,
                     run_bench, run_policy, train_step)
from .train import TrainSettings, train
from .workloads import Workload, get_workload

__all__ = [
    "UsageError",
    "BenchSettings", "PolicySpec", "Precision", "parse_policy",
    "parse_policy_list", "run_bench", "run_policy", "train_step",
    "TrainSettings", "train",
    "Workload", "get_workload",
]
