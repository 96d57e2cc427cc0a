"""``ampkit tune``: autotune from the command line (table, choice, JSON, bad inputs)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import ampkit
from ampkit._dtypes import device_policies
from ampkit.cli import main

TINY = ["--model", "mlp", "--batch-size", "16", "--steps", "4", "--quiet"]


def test_tune_prints_the_table_and_the_choice_and_writes_json(tmp_path, capsys):
    out = tmp_path / "tune.json"
    assert main(["tune", *TINY, "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    doc = json.loads(out.read_text())
    rows = doc["result"]["rows"]
    assert [r["policy"] for r in rows] == list(device_policies("cpu").candidates)
    assert doc["recommended"] == doc["result"]["policy"]
    chosen = next(r for r in rows if r["policy"] == doc["recommended"])
    if doc["recommended"] != "32-true":  # the rule, on what this run measured
        assert chosen["accepted"] and chosen["step_ms"] < rows[0]["step_ms"]
        assert chosen["max_loss_dev"] <= 0.02
    assert all(d["timed_steps"] == 2 for d in doc["result"]["details"])
    assert doc["settings"]["threads"] == 1 and doc["settings"]["candidates"] == [r["policy"] for r in rows]
    assert any(line.lstrip().startswith(rows[0]["policy"]) for line in lines)
    assert lines[-1].startswith(f"Chosen: {doc['recommended']}:")
    table = lines[:-1]
    assert max(len(line) for line in table) <= 80, table


def test_tune_candidates_and_threads(tmp_path, capsys):
    out = tmp_path / "tune.json"
    assert main(["tune", *TINY, "--candidates", "bf16-mixed", "--threads", "2",
                 "--max-loss-dev", "0", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["policy"] for r in doc["result"]["rows"]] == ["32-true", "bf16-mixed"]
    assert doc["settings"]["threads"] == 2
    bf16 = doc["result"]["rows"][1]
    if bf16["max_loss_dev"] > 0:  # a zero tolerance rejects any deviation
        assert doc["recommended"] == "32-true" and "loss moved" in bf16["reason"]


@pytest.mark.parametrize("argv, words", [
    (["--candidates", "bf17-mixed"], ["'bf17-mixed'", "valid:", "bf16-mixed"]),
    (["--candidates", "fp9"], ["'fp9'", "valid:", "fp8-rowwise"]),
    (["--candidates", ","], ["names no policy", "valid:"]),
    (["--steps", "2"], ["--steps", "at least 3"]),
    (["--max-loss-dev", "-1"], ["--max-loss-dev", "-1"]),
    (["--max-loss-dev", "inf"], ["--max-loss-dev", "inf"]),
    (["--threads", "0"], ["--threads", "0"]),
    (["--threads", "100000"], ["--threads", "100000", "[1,"]),
    (["--model", "vgg"], ["'vgg'", "valid: mlp"]),
    (["--steps", "x"], ["'x'", "int"]),
])
def test_bad_inputs_exit_2_before_training(capsys, monkeypatch, argv, words):
    def no_training(*args, **kwargs):
        raise AssertionError("autotune ran")
    monkeypatch.setattr(ampkit, "autotune", no_training)
    assert main(["tune", "--model", "mlp", "--quiet", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    for word in words:
        assert word in err[0], (word, err[0])


@pytest.mark.parametrize("function, words", [
    ("frozen", "no parameter of the model requires grad"),
    ("no_params", "has no parameters"),
    ("wrapped", "autotune takes the bare module, got it wrapped in DataParallel"),
    ("empty", "inputs hold no samples"),
])
def test_a_model_autotune_refuses_exits_2_with_one_line(tmp_path, capsys, monkeypatch,
                                                        function, words):
    """They exited 1 ("failed"), two lines, after the progress line, as if training broke."""
    (tmp_path / "tune_bad_models_for_tests.py").write_text(textwrap.dedent('''
        import torch
        from torch import nn

        def frozen():
            return nn.Linear(8, 4).requires_grad_(False), (torch.randn(4, 8), None)

        def no_params():
            return nn.ReLU(), (torch.randn(4, 8), None)

        def wrapped():
            return nn.DataParallel(nn.Linear(8, 4)), (torch.randn(4, 8), None)

        def empty():
            return nn.Linear(8, 4), (torch.randn(0, 8), None)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ampkit, "autotune", lambda *a, **k: pytest.fail("autotune ran"))
    assert main(["tune", "--model", f"tune_bad_models_for_tests:{function}", "--steps", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ampkit tune: error: cannot tune this model: ")
    assert words in err[0]


def test_seed_decides_a_user_functions_random_weights(tmp_path, capsys, monkeypatch):
    (tmp_path / "tune_models_for_tests.py").write_text(textwrap.dedent('''
        import torch
        from torch import nn

        def unseeded():
            return nn.Linear(4, 2), (torch.randn(3, 4), torch.randn(3, 2))
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    weights = []

    def record(model, *args, **kwargs):
        weights.append(model.weight.detach().clone())
        raise RuntimeError("recorded")
    monkeypatch.setattr(ampkit, "autotune", record)
    for earlier in (1, 2):  # whatever ran before the command left the RNG here
        torch.manual_seed(earlier)
        main(["tune", "--model", "tune_models_for_tests:unseeded", "--seed", "7", "--quiet"])
    assert len(weights) == 2 and torch.equal(weights[0], weights[1])


def test_help_says_the_separators_check_candidates_accepts(capsys):
    from ampkit.cli.tune import check_candidates

    assert main(["tune", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--candidates: comma-separated names ampkit.get_policy takes" in text
    assert "separated by ';' instead when one is an explicit policy such as \"p=f32,c=bf16,o=f32\"" in text
    assert check_candidates("32-true, bf16-mixed,fp8", "cpu") == ["32-true", "bf16-mixed", "fp8"]
    assert check_candidates("p=f32,c=bf16,o=f32; O2-bf16", "cpu") == ["p=f32,c=bf16,o=f32", "O2-bf16"]


def test_an_explicit_policys_commas_keep_it_one_candidate_as_in_bench():
    """Split on every comma, "p=f32,c=bf16,o=f32" was measured as O0 (merged into the
    reference) and "c=bf16" (bf16 outputs): not the policy typed. bench read it whole."""
    from ampkit.bench.policies import parse_policy_list
    from ampkit.cli.tune import check_candidates

    text = "16-mixed,p=f32,c=bf16,o=f32"
    assert check_candidates(text, "cpu") == ["16-mixed", "p=f32,c=bf16,o=f32"]
    assert check_candidates(text, "cpu") == [s.label for s in parse_policy_list(text, "cpu")]


def test_candidates_auto_is_the_device_default_as_bench_policies_auto(tmp_path):
    """'auto' was refused as an unknown candidate while bench --policies took it."""
    out = tmp_path / "tune.json"
    assert main(["tune", *TINY, "--candidates", "auto", "--json", str(out)]) == 0
    default = tmp_path / "default.json"
    assert main(["tune", *TINY, "--json", str(default)]) == 0
    assert (json.loads(out.read_text())["settings"]["candidates"]
            == json.loads(default.read_text())["settings"]["candidates"])


def test_a_non_finite_fp32_reference_is_not_called_the_fastest_choice():
    """fp32's own loss NaN: the last line said "no candidate was faster than fp32 ...; train
    in plain fp32", though a candidate was measured faster and fp32 itself was NaN."""
    from ampkit.cli.tune import choice_sentence
    from ampkit.tune import TuneResult, choose
    rows = [{"policy": "32-true", "step_ms": 10.0, "peak_mib": None, "max_loss_dev": None},
            {"policy": "bf16-mixed", "step_ms": 6.0, "peak_mib": None, "max_loss_dev": None}]
    policy, speedup = choose(rows, 0.02)
    line = choice_sentence(TuneResult(policy, rows, speedup), 0.02)
    assert line.startswith("Chosen: none judged (32-true by default): the fp32 reference")
    assert "faster" not in line
